"""``dpdro keys``: every configuration key with its default, help and allowed values."""

from __future__ import annotations

import argparse

from dpdro.common.config import FIELDS

from . import shared

NAME = "keys"
HELP = "list configuration keys"


def add_arguments(p: argparse.ArgumentParser) -> None:
    shared.add_format_argument(p)


def run(args: argparse.Namespace) -> int:
    if args.format == "json":
        shared.print_json({"keys": [{"key": f.key, "default": f.default, "help": f.help, "allowed": f.allowed()}
                                    for f in FIELDS]})
        return 0
    for f in FIELDS:
        print(f"{f.key} = {f.default!r}\n    {f.help} Allowed: {f.allowed()}.")
    return 0
