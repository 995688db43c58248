"""dpdro: record-level differentially private distributionally robust optimisation.

The implementation lives in three sub-packages mapped from the repository's top-level folders:
``dpdro.common`` (math, models, data, configuration), ``dpdro.server`` (algorithms, privacy ledger,
engine, Flower ServerApp) and ``dpdro.client`` (the work of a node, Flower ClientApp).
"""

__version__ = "0.1.0"
