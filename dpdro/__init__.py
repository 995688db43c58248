"""dpdro: record-level differentially private distributionally robust optimisation.

The implementation lives in sub-packages mapped from the repository's top-level folders, in layers that only
import downward (docs/DEVELOPING.md; tests/test_architecture.py checks it):
``dpdro.common`` (math, models, data, configuration, message and transport types) <- ``dpdro.server``
(algorithms, privacy ledger, engine) and ``dpdro.client`` (the work of a node, the in-process transport) <- their
``flower`` sub-packages (ServerApp, ClientApp, SecAgg+) <- ``dpdro.launch`` (flwr run, deployment, certificates)
<- ``dpdro.simulations`` (experiments, measurements) <- ``dpdro.cli``.
"""

__version__ = "0.1.0"
