"""What several ``dpdro`` commands share: the configuration arguments, the done line, the Flower app folder,
JSON output and where a lab tool writes its document. Imports nothing heavy (no torch, Flower or lab code)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from dpdro.common.config import SEEDED_NOT_PRIVATE, Config, ConfigError, load_toml_keys, parse_set_args

OVERWRITE_HELP = ("replace the run in a non-empty out-dir (config key overwrite); without it a non-empty out-dir "
                  "is refused")
# The checkout this command runs from (dpdro/cli/shared.py -> the folder of pyproject.toml).
CHECKOUT = Path(__file__).resolve().parents[2]

_started = [time.perf_counter()]


def mark_started() -> None:
    """Start the clock of the done line (main() calls it: the time printed is the command's wall time)."""
    _started[0] = time.perf_counter()


def verbose_parent() -> argparse.ArgumentParser:
    """``-v/--verbose`` for every sub-command (``dpdro train -v`` as well as ``dpdro -v train``); SUPPRESS: a
    sub-command without it keeps the top level's value."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="on an error, print the full traceback too")
    return p


def add_config_arguments(p: argparse.ArgumentParser, overwrite: bool = True) -> None:
    """--config FILE.toml and --set KEY=VALUE ... (and --overwrite for the commands that write a run)."""
    p.add_argument("--config", help="TOML file of configuration keys")
    p.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="configuration overrides")
    if overwrite:
        p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)


def given_keys(args: argparse.Namespace) -> set[str]:
    """The configuration keys the user set (--config file and --set), e.g. to default the others by command."""
    return ({a.split("=", 1)[0] for a in (args.set or [])}
            | (set(load_toml_keys(args.config)) if args.config else set()))


def config_from_args(args: argparse.Namespace) -> Config:
    """Config from --config FILE then --set overrides, with --overwrite when the command has it; raises
    ConfigError naming the key, before anything heavy is imported."""
    values: dict[str, Any] = {}
    if args.config:
        values.update(load_toml_keys(args.config))
    values.update(parse_set_args(args.set or []))
    if getattr(args, "overwrite", False):
        values["overwrite"] = True
    return Config.from_mapping(values)


def check_out(args: argparse.Namespace) -> None:
    """ConfigError naming --out when it is an existing folder (it names the file to write), before any work."""
    if args.out and Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out}: is a folder; allowed: the path of the file to write")


def app_dir(value: str | None) -> Path:
    """The Flower app directory: ``value`` (--app), or by default the dpdro checkout this command runs from (its
    pyproject.toml declares the app), so that simulate and deploy work from any folder (a user's data folder)."""
    return Path(value) if value is not None else CHECKOUT


def own_children():
    """For commands that start Flower processes: this process becomes their subreaper, and whatever is
    still below it when the command ends (also by SIGTERM or Ctrl-C) is stopped by PID."""
    import contextlib

    from dpdro.launch.processes import become_subreaper, stop_descendants

    @contextlib.contextmanager
    def scope():
        become_subreaper()
        try:
            yield
        finally:
            stop_descendants()

    return scope()


def print_summary(s: dict, out_dir: str, resumed: bool = False) -> None:
    """The done line: results, and the command's wall time (from the start of main(), data loading and Flower
    start-up included) beside the training loop's (summary.json wall_seconds; over all sessions of a resumed
    run)."""
    from dpdro.server.evaluate import worst_group_words
    eps = s["epsilon_spent"]
    seeded = str(s.get("trust_model", "")).startswith(SEEDED_NOT_PRIVATE)  # reproducible-for-testing
    private = "" if s["private"] else f"  ({SEEDED_NOT_PRIVATE.upper() if seeded else 'NOT PRIVATE: epsilon=inf'})"
    loop = f"training loop {s['wall_seconds']:.1f} s" + (" over all sessions" if resumed else "")
    split = s.get("eval_split", "test")
    print(f"done: {s['algorithm']} on {s['dataset']}: {split} accuracy {s['test_accuracy']:.4f}, worst-class "
          f"accuracy {s['worst_class_accuracy']:.4f}"
          + worst_group_words(s)
          + f", epsilon {eps if isinstance(eps, str) else round(eps, 4)} "
          f"at delta {s['delta']:.3g}, {time.perf_counter() - _started[0]:.1f} s ({loop}){private}\n"
          f"run directory: {out_dir}")
    returned = s.get("checkpoint_returned") or {}
    if returned.get("rule") == "private-best":  # server/checkpoint_selection.py
        print(f"returned: the iterate of iteration {returned['iteration']} of {s['iterations']}, the best of "
              f"{returned['candidates']} by noisy {split} counts (checkpoint-select=private-best, accounted; the "
              "figures above are that evaluation's, biased upwards: dpdro evaluate --data test for the test split)")
    if s.get("worst_still_rising"):  # server/convergence.py: worth training longer
        print(f"note: {s['worst_still_rising']}")


def add_format_argument(p: argparse.ArgumentParser) -> None:
    """--format text|json: text for a reader, json (one object on stdout) for a script."""
    p.add_argument("--format", default="text", choices=("text", "json"),
                   help="text (default) or json: one JSON object on stdout (infinity as the string 'inf')")


def jsonable(v: Any) -> Any:
    """``v`` with non-finite floats as strings ('inf', '-inf', 'nan': strict JSON has none), numpy scalars and
    arrays as Python numbers and lists, tuples as lists and paths as strings."""
    if hasattr(v, "tolist"):  # numpy arrays and scalars
        v = v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, Path):
        return str(v)
    return v


def print_json(obj: Any) -> None:
    """``obj`` as one strict JSON object on stdout (``jsonable``)."""
    json.dump(jsonable(obj), sys.stdout, indent=2, allow_nan=False)
    print()


def add_output_arguments(p: argparse.ArgumentParser, what: str, root: str) -> None:
    """Where a lab tool writes ``what``: --docs DIR, or --write-docs for the checkout's docs/; by default the
    tool's own folder ``root`` (--root), never the checkout's docs/ unless asked."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--docs", default=None, metavar="DIR",
                   help=f"where {what} goes (default: --root, i.e. {root}; the checkout's docs/ only when asked)")
    g.add_argument("--write-docs", action="store_true",
                   help=f"write {what} into the checkout's docs/research/, the published copy")


def docs_dir(args: argparse.Namespace) -> Path:
    """The folder a lab tool writes its document into: --docs, --write-docs (the checkout's docs/research/) or
    --root."""
    if args.docs:
        return Path(args.docs)
    return CHECKOUT / "docs" / "research" if args.write_docs else Path(args.root)
