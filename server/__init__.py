"""Server side: algorithms (state machines), the privacy ledger, noise and aggregation, the training
engine, transports, run directories and checkpoints, and the Flower ServerApp."""
