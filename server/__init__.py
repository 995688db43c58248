"""Server core: algorithms (state machines), the privacy ledger, noise and aggregation, the training engine,
run directories and checkpoints. Imports only ``dpdro.common``; never Flower nor the client. The Flower
ServerApp is the ``flower`` sub-package, one layer up."""
