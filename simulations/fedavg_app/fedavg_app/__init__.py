"""Flower FedAvg round-trip app for the deployment latency benchmark (simulations/bench_latency.py)."""
