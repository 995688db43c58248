"""``dpdro export``: a finished run's model as an ONNX file (the optional extra dpdro[onnx])."""

from __future__ import annotations

import argparse

NAME = "export"
HELP = "a finished run's model as an ONNX file (needs the extra dpdro[onnx])"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", required=True, metavar="RUN_DIR", help="run directory with model.pt and model.json")
    p.add_argument("--format", default="onnx", choices=("onnx",), help="file format (onnx: logits and the run's "
                   "prediction, batch size free)")
    p.add_argument("--out", help="output file (default: RUN_DIR/model.onnx)")


def run(args: argparse.Namespace) -> int:
    from dpdro.server.onnx_export import export_onnx  # torch-free: a missing extra is named before torch loads

    path = export_onnx(args.run, args.out)
    print(f"ONNX model written to {path} (input 'input' (batch, *input_shape); outputs 'logits' and 'predicted', "
          "the run's prediction)")
    return 0
