"""Shared by server and clients: configuration, psi-divergences and DRO losses, per-record gradients and
clipping, models, data sets and partitioners, the message schema and its Flower-free codec, the transport
protocol and random number generation. Imports nothing else of dpdro; only ``common.flower`` imports Flower."""
