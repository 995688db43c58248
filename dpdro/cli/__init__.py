"""The ``dpdro`` command line: the product's commands, one module each, and the experiment tools under
``dpdro lab`` (dpdro/cli/lab/).

    dpdro train [--config FILE.toml] [--set key=value ...]    single-node training (in-process clients)
    dpdro train --resume RUN_DIR                              continue a stopped run with its saved config
    dpdro train|simulate|deploy --overwrite ...               replace the run in a non-empty out-dir (refused
                                                              without it, before any work)
    dpdro simulate [--config FILE.toml] [--set key=value ...] the same run on Flower's simulation engine
    dpdro deploy [--config FILE.toml] [--set key=value ...]   the run on a loopback deployment (TLS + node auth)
    dpdro plan [--config FILE.toml] [--format json]           releases, noise multipliers, planned epsilon
    dpdro keys [--format json]                                every configuration key with default and help
    dpdro predict --run RUN_DIR [--data test|PATH] [--out F]   predictions of the run's model (model.pt) as CSV
    dpdro evaluate --run RUN_DIR [--data test|PATH] [--format json]   accuracy, worst-class accuracy, confusion
                                                              matrix PNG (on --data train|validation: "not
                                                              private (reads private records)", nothing written
                                                              without --out)
    dpdro export --run RUN_DIR [--format onnx] [--out F]      the model as ONNX (optional extra dpdro[onnx])
    dpdro certs create|add-node --out DIR ...                 CA, SuperLink TLS certificate, SuperNode keys
    dpdro lab sweep|report|tune|audit|hazards|noise-modes|equivalence|bench ...   experiment tools (research)
    dpdro --version; dpdro -v COMMAND ...                     the version; the full traceback on an error

Exit status: the table in ``dpdro.common.errors`` (0 success, 1 failure, 2 configuration, data or usage error,
130 stopped by Ctrl-C); docs/how-to/OPERATOR.md, "Exit status".
"""

from .entry import build_parser, main

__all__ = ["build_parser", "main"]
