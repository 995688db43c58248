"""Client side: the work a node does on its own records (``worker``) and the Flower ClientApp (``app``)."""
