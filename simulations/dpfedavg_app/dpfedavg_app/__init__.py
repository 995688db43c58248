"""Flower's own DP-FedAvg on dpdro's partition and model: the anchor of simulations/dp_fedavg.py."""
