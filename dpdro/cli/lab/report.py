"""``dpdro lab report``: the results document, results.csv and plots from finished sweep runs."""

from __future__ import annotations

import argparse

from .sweep import add_report_arguments, report

NAME = "report"
HELP = "write RESULTS.md, results.csv and plots from finished sweep runs (default: under --root)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_report_arguments(p)


def run(args: argparse.Namespace) -> int:
    print(f"report: {report(args)}")
    return 0
