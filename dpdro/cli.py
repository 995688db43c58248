"""The ``dpdro`` command line.

    dpdro train [--config FILE.toml] [--set key=value ...]    single-node training (in-process clients)
    dpdro train --resume RUN_DIR                              continue a stopped run with its saved config
    dpdro simulate [--config FILE.toml] [--set key=value ...] the same run on Flower's simulation engine
    dpdro keys                                                every configuration key with default and help

Exit status: 0 on success, 2 for a configuration or data error (message on stderr), 1 otherwise.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import tomllib
from pathlib import Path
from typing import Any

from dpdro.common.config import FIELDS, Config, ConfigError, parse_set_args


def _load_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML ({e})") from None
    # Accept a plain table of keys or a pyproject-style [tool.flwr.app.config] table.
    return data.get("tool", {}).get("flwr", {}).get("app", {}).get("config", data)


def config_from_args(args: argparse.Namespace) -> Config:
    """Config from --config FILE then --set overrides; raises ConfigError."""
    values: dict[str, Any] = {}
    if args.config:
        values.update(_load_toml(args.config))
    values.update(parse_set_args(args.set or []))
    return Config.from_mapping(values)


def _progress_bar(total: int, start: int = 0):
    from tqdm import tqdm

    from dpdro.server.engine import Progress

    bar = tqdm(total=total, initial=start, desc="training", unit="it", dynamic_ncols=True)

    def on_step(t: int) -> None:
        bar.update(t - bar.n)

    def on_eval(row: dict) -> None:
        eps = row["epsilon_spent"]
        bar.set_postfix_str(f"eps={eps:.3f} acc={row['test_accuracy']:.4f} "
                            f"worst={row['worst_class_accuracy']:.4f}" if eps != math.inf else
                            f"eps=inf acc={row['test_accuracy']:.4f} worst={row['worst_class_accuracy']:.4f}")
        bar.write(f"iteration {row['iteration']:>6}  epsilon {eps:.4f}  test accuracy {row['test_accuracy']:.4f}  "
                  f"worst-class accuracy {row['worst_class_accuracy']:.4f}")

    return bar, Progress(on_step=on_step, on_eval=on_eval)


def cmd_train(args: argparse.Namespace) -> int:
    from dpdro.common.data import load_from_config
    from dpdro.server.engine import load_run_config, train
    from dpdro.server.transport import LocalTransport

    if args.resume:
        cfg = load_run_config(args.resume).with_updates({"out-dir": args.resume})
    else:
        cfg = config_from_args(args)
    train_set = load_from_config(cfg, train=True)
    test_set = load_from_config(cfg, train=False)
    transport = LocalTransport(cfg, train_set)
    bar, progress = _progress_bar(cfg.iterations)
    try:
        result = train(cfg, transport, test_set, resume=bool(args.resume), progress=progress)
    finally:
        bar.close()
    _print_summary(result.summary, cfg.out_dir)
    return 0


def _print_summary(s: dict, out_dir: str) -> None:
    eps = s["epsilon_spent"]
    private = "" if s["private"] else "  (NOT PRIVATE: epsilon=inf)"
    print(f"done: {s['algorithm']} on {s['dataset']}: test accuracy {s['test_accuracy']:.4f}, worst-class "
          f"accuracy {s['worst_class_accuracy']:.4f}, epsilon {eps if isinstance(eps, str) else round(eps, 4)} "
          f"at delta {s['delta']:.3g}, {s['wall_seconds']:.1f} s{private}\nrun directory: {out_dir}")


def cmd_simulate(args: argparse.Namespace) -> int:
    from dpdro.server.simulate import run_simulation

    cfg = config_from_args(args)
    summary = run_simulation(cfg, app_dir=Path(args.app), stream=not args.quiet)
    _print_summary(summary, cfg.out_dir)
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    for f in FIELDS:
        print(f"{f.key} = {f.default!r}\n    {f.help} Allowed: {f.allowed()}.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dpdro", description="Record-level differentially private DRO training.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, helptext in (("train", "train single-node (clients in this process)"),
                           ("simulate", "train on Flower's simulation engine (flwr run)")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("--config", help="TOML file of configuration keys")
        s.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="configuration overrides")
        if name == "train":
            s.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR with its saved config")
        else:
            s.add_argument("--app", default=".", help="Flower app directory (the project root)")
            s.add_argument("--quiet", action="store_true", help="do not stream the run's log")
    sub.add_parser("keys", help="list configuration keys")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from dpdro.common.data import DataError
    from dpdro.common.models import ModelError

    handlers = {"train": cmd_train, "simulate": cmd_simulate, "keys": cmd_keys}
    try:
        return handlers[args.command](args)
    except (ConfigError, DataError, ModelError) as e:
        print(f"dpdro: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - CLI boundary: one clear line, traceback only with -v logging
        from dpdro.server.engine import ResumeError
        from dpdro.server.ledger import PrivacyBudgetExceeded

        if isinstance(e, (ResumeError, PrivacyBudgetExceeded)):
            print(f"dpdro: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
