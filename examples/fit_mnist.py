"""Train with the Python API on the shipped MNIST-ST data, then use the model.

    DPDRO_DATA_ROOT=/path/to/datasets .venv/bin/python examples/fit_mnist.py [OUT_DIR]

A deliberately tiny run (3,000 training records, 30 iterations; measured 1 min 27 s to 1 min 57 s wall, 14-16 s
of CPU, on this project's 2-core machine while other jobs held it, 2026-12-02): it shows the calls, not good
accuracy (0.40 and 0.37 in two runs: the noise is fresh every run). The run directory (default
runs/example-fit, replaced on every run) holds what `dpdro train` writes: config.json, metrics.csv,
summary.json, model.pt, model.json, MODEL_CARD.md and plots/.
"""

from __future__ import annotations

import logging
import sys

import torch

import dpdro

logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's per-order convergence chatter (as the CLI)
out_dir = sys.argv[1] if len(sys.argv) > 1 else "runs/example-fit"
keys = {  # the same keys as `dpdro train --set ...` (`dpdro keys` lists them all)
    "dataset": "mnist-st", "algorithm": "dp-double-spider", "epsilon": 4.0,
    "max-train-records": 3000, "max-test-records": 1000, "num-clients": 2,
    "iterations": 30, "q": 5, "refresh-batch": 300, "diff-batch": 150, "eval-every": 10,
    "threads": 1, "seed": 0, "out-dir": out_dir, "overwrite": True,
}
result = dpdro.fit(keys)

p = result.privacy
print(f"epsilon spent {p['epsilon_spent']:.3f} of {p['epsilon_target']} at delta {p['delta']:.2g} ({p['trust_model']})")
print(f"test accuracy {result.summary['test_accuracy']:.4f}, worst-class {result.summary['worst_class_accuracy']:.4f}")
print(f"run directory: {result.run_dir} (model card: {result.run_dir / 'MODEL_CARD.md'})")

# The trained model is an ordinary nn.Module; later, dpdro.load_model(run_dir) rebuilds it from model.json.
model, spec = dpdro.load_model(result.run_dir)
with torch.no_grad():
    logits = model(torch.zeros(1, *spec.input_shape))  # one all-grey image, inputs scaled to [-1, 1]
print(f"a {tuple(spec.input_shape)} input -> class {int(logits.argmax(1))} of {spec.classes}")
