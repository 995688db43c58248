"""Client side: the work a node does on its own records (``worker``) and the in-process transport that runs
every node's worker in one process (``local_transport``). Imports only ``dpdro.common``; never Flower nor the
server. The Flower ClientApp is the ``flower`` sub-package, one layer up."""
