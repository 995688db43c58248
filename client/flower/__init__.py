"""The Flower side of a node (layer above ``dpdro.client``): the ClientApp (``app``), which answers the
server's messages with the node's ``ShardWorker``."""
