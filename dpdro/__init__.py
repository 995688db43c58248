"""dpdro: record-level differentially private distributionally robust optimisation.

The implementation lives in sub-packages mapped from the repository's top-level folders, in layers that only
import downward (CONTRIBUTING.md; tests/test_architecture.py checks it):
``dpdro.common`` (math, models, data, configuration, message and transport types) <- ``dpdro.server``
(algorithms, privacy ledger, engine) and ``dpdro.client`` (the work of a node, the in-process transport) <- their
``flower`` sub-packages (ServerApp, ClientApp, SecAgg+) <- ``dpdro.launch`` (flwr run, deployment, certificates)
<- ``dpdro.simulations`` (experiments, measurements) <- ``dpdro.cli`` and the Python API ``dpdro.api``
(``dpdro.fit``, ``dpdro.records``, ``dpdro.load_model``, ``dpdro.predict``, ``dpdro.evaluate``; imported when
first used, so ``import dpdro`` and the CLI's start-up stay free of torch).
"""

__version__ = "0.1.0"

_API = {"fit": "dpdro.api", "records": "dpdro.api", "FitResult": "dpdro.api", "load_model": "dpdro.server.model_files",
        "predict": "dpdro.server.prediction", "evaluate": "dpdro.server.prediction"}


def __getattr__(name: str):
    """The API names (``_API``), imported on first use."""
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'dpdro' has no attribute {name!r}")
