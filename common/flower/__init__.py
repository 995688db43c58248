"""Flower record packing that both Flower sides need (``wire``): the only shared code that imports ``flwr``."""
