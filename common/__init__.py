"""Shared by server and clients: configuration, psi-divergences and DRO losses, per-record gradients and
clipping, models, data sets and partitioners, the message schema and random number generation."""
