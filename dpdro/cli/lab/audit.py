"""``dpdro lab audit``: privacy audits, white-box canaries per release (--mode canary) or membership inference
(--mode mia: loss threshold, LiRA); each mode writes its section of AUDIT.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import shared

NAME = "audit"
HELP = ("privacy audits: white-box canaries per release (--mode canary) or membership inference (--mode mia: loss "
        "threshold, LiRA); writes AUDIT.md")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=("mia", "canary"), default="mia",
                   help="mia: membership inference on trained models; canary: empirical epsilon lower bound of "
                        "every release (and the negative controls)")
    p.add_argument("--configs", nargs="*", default=[], help="canary: audited configurations (default: all)")
    p.add_argument("--slots", type=int, default=1000, help="canary: records of each audited run")
    p.add_argument("--trials", type=int, default=200_000, help="canary: trials per release (present + absent)")
    p.add_argument("--max-releases", type=int, default=20_000,
                   help="canary: most releases per audited release kind (bounds releases with few coordinates)")
    p.add_argument("--epsilons", nargs="*", default=["1", "8", "inf"])
    p.add_argument("--shadows", type=int, default=4)
    p.add_argument("--records", type=int, default=4000)
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--algorithm", default="dp-sgd")
    p.add_argument("--root", default="runs/audit")
    shared.add_output_arguments(p, "AUDIT.md", "runs/audit")


def run(args: argparse.Namespace) -> int:
    if args.mode == "canary":
        return _canary(args)
    from dpdro.simulations.audit import run_audit

    path = run_audit([float(e) for e in args.epsilons], args.shadows, args.records, args.iterations,
                     Path(args.root), shared.docs_dir(args), args.algorithm)
    print(path.read_text())
    return 0


def _canary(args: argparse.Namespace) -> int:
    """--mode canary: exit status 1 when a correct release exceeds its claim or a broken one is not caught."""
    for key in ("slots", "trials", "max_releases"):
        if getattr(args, key) < 1:
            print(f"dpdro: error: --{key.replace('_', '-')}: got {getattr(args, key)}; allowed: >= 1", file=sys.stderr)
            return 2
    from dpdro.simulations.canary_audit import DEFAULT_PLAN, report_lines, run_canary_audit

    plan = [p for p in DEFAULT_PLAN if not args.configs or p[0] in args.configs]
    node_evaluation = not args.configs or "node-evaluation" in args.configs  # simulations/eval_audit.py
    if not plan and not node_evaluation:
        print(f"dpdro: error: --configs: none of {args.configs} is audited; allowed: "
              f"{', '.join(sorted({p[0] for p in DEFAULT_PLAN} | {'node-evaluation'}))}", file=sys.stderr)
        return 2
    command = " ".join(["dpdro lab audit --mode canary", *(["--configs", *args.configs] if args.configs else []),
                        f"--slots {args.slots} --trials {args.trials} --max-releases {args.max_releases}"])

    def progress(rows) -> None:
        print("\n".join(report_lines(rows, command, args.slots)[-len(rows):]), flush=True)

    path, rows = run_canary_audit(shared.docs_dir(args), slots=args.slots, trials=args.trials,
                                  max_releases=args.max_releases, plan=plan, command=command, progress=progress)
    if node_evaluation:  # the node evaluation's counts (eval-data=nodes), its own section
        from dpdro.simulations.eval_audit import run_eval_audit

        path, evals = run_eval_audit(shared.docs_dir(args), args.trials, command)
        rows += evals
    print(f"wrote {path}")
    wrong = [r for r in rows if r.flagged != bool(r.broken)]
    for r in wrong:
        what = "a correct release exceeds its claim" if not r.broken else "a broken release was not caught"
        print(f"dpdro: audit: {what}: {r.config} {r.mechanism} ({r.noise_mode}, {r.broken or 'correct'}): bound "
              f"{r.bound.lower:.3f}, claim {r.claimed:.3f}", file=sys.stderr)
    return 1 if wrong else 0
