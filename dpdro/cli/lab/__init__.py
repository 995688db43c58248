"""``dpdro lab``: the experiment tools (research, not the product): sweeps, reports, tuning, audits,
measurements. None writes into the checkout's docs/ unless told to (``--write-docs`` or ``--docs DIR``; by
default each writes under its --root in runs/). Their old top-level names (``dpdro tune``, ...) still work as
hidden aliases that print a deprecation line.

The tools' modules import nothing of ``dpdro.simulations`` at import time (only when a tool runs): the CLI's
start-up stays free of lab code (tests/test_cli_startup.py)."""

from __future__ import annotations

import argparse
import sys

from . import audit, bench, equivalence, estimator, hazards, levers, noise_modes, report, sweep, tune

TOOLS = (sweep, report, tune, audit, hazards, levers, noise_modes, equivalence, bench, estimator)
OLD_TOP_LEVEL = tuple(t for t in TOOLS if t is not levers)  # tools that had a top-level name before the lab group


def add_group(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    """``dpdro lab <tool>`` for every tool, and each tool's old top-level name as a hidden alias (not listed in
    the help: no ``help=``; its ``deprecated`` default makes main() print the deprecation line)."""
    lab = sub.add_parser("lab", help="experiment tools: sweep, report, tune, audit, hazards, levers, noise-modes, "
                                     "equivalence, bench, estimator (research; output under runs/ unless --write-docs)",
                         description=__doc__.split("\n\n")[0].replace("``", ""), parents=parents)
    tools = lab.add_subparsers(dest="tool", required=True, metavar="TOOL")
    for mod in TOOLS:
        s = tools.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP, parents=parents)
        mod.add_arguments(s)
        s.set_defaults(command_run=mod.run)
    for mod in OLD_TOP_LEVEL:
        s = sub.add_parser(mod.NAME, description=f"deprecated name of dpdro lab {mod.NAME}: {mod.HELP}",
                           parents=parents)
        mod.add_arguments(s)
        s.set_defaults(command_run=mod.run, deprecated=mod.NAME)


def warn_deprecated(name: str) -> None:
    """The one line an old top-level name prints (stderr) before the tool runs."""
    print(f"dpdro: warning: 'dpdro {name}' is deprecated; use 'dpdro lab {name}'", file=sys.stderr)
