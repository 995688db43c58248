"""``dpdro lab bench``: performance ratios measured inside one process (simulations/bench.py)."""

from __future__ import annotations

import argparse

from .. import shared

NAME = "bench"
HELP = "measure performance ratios; writes PERFORMANCE.md (default: runs/bench/)"
DEFAULT_DOC = "runs/bench/PERFORMANCE.md"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="fewer repetitions, smaller sweep (a few minutes)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="torch device of the timed steps")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--batch", type=int, default=256, help="records per step of ratios (a)-(c)")
    p.add_argument("--chunk-size", type=int, default=256, help="records per vectorised chunk")
    p.add_argument("--repeats", type=int, default=0, help="interleaved repetitions (0: 5 quick, 15 default)")
    p.add_argument("--no-flower", action="store_true", help="skip (d), the Flower simulation")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--doc", default=None, help=f"generated Markdown (and .json beside it); default {DEFAULT_DOC}")
    g.add_argument("--write-docs", action="store_true",
                   help="write the checkout's docs/research/PERFORMANCE.md, the published copy")
    g.add_argument("--no-doc", action="store_true", help="print only, write no document")
    p.add_argument("--app", default=None, help="Flower app directory (default: this dpdro checkout) for (d)")


def document(args: argparse.Namespace) -> str | None:
    """Where the Markdown goes: --doc, --write-docs (the checkout's docs/research/PERFORMANCE.md), DEFAULT_DOC, or None
    with --no-doc."""
    if args.no_doc:
        return None
    if args.write_docs:
        return str(shared.CHECKOUT / "docs" / "research" / "PERFORMANCE.md")
    return args.doc or DEFAULT_DOC


def run(args: argparse.Namespace) -> int:
    from dpdro.simulations.bench import BenchOptions, run_bench

    opts = BenchOptions(quick=args.quick, device=args.device, threads=args.threads, batch=args.batch,
                        chunk_size=args.chunk_size, repeats=args.repeats, flower=not args.no_flower,
                        doc=document(args), app_dir=shared.app_dir(args.app))
    run_bench(opts)
    if opts.doc:
        print(f"written: {opts.doc}")
    return 0
