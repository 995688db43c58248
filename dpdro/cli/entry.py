"""The ``dpdro`` parser and ``main``: one module per command (``NAME``, ``HELP``, ``add_arguments``, ``run``),
the product's at the top level, the experiment tools under ``dpdro lab``; errors end as one line and the exit
status of ``dpdro.common.errors`` (its table), the traceback too with ``-v``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from dpdro.common.errors import EXIT_FAILURE, EXIT_OK, EXIT_STOPPED, DpdroError

from . import certs, deploy, evaluate, export, keys, lab, plan, predict, shared, simulate, train

PRODUCT = (train, simulate, deploy, plan, keys, predict, evaluate, export, certs)


class _Version(argparse.Action):
    """--version: the installed package's version (its metadata), read only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("dpdro")
        except PackageNotFoundError:  # run from a checkout that is not installed
            from dpdro import __version__ as v
        parser.exit(message=f"dpdro {v}\n")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command: ``PRODUCT`` at the top level, ``lab.TOOLS`` under ``dpdro lab`` (and as
    hidden deprecated aliases). Each sub-command's ``run`` is ``args.command_run`` (``args.run`` is --run)."""
    p = argparse.ArgumentParser(prog="dpdro", description="Record-level differentially private DRO training.",
                                epilog="Experiment tools (research): dpdro lab --help. Exit status: 0 success, 1 "
                                       "failure, 2 configuration, data or usage error, 130 stopped by Ctrl-C "
                                       "(docs/how-to/OPERATOR.md).")
    p.add_argument("--version", action=_Version, help="print the version and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="on an error, print the full traceback too")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parents = [shared.verbose_parent()]
    for mod in PRODUCT:
        s = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP, parents=parents)
        mod.add_arguments(s)
        s.set_defaults(command_run=mod.run)
    lab.add_group(sub, parents)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``dpdro ARGV``; returns the exit status (common/errors.py's table)."""
    shared.mark_started()
    if argv is None:  # the console script: a warning is one 'dpdro: warning:' line, not Python's file:line form
        warnings.showwarning = _show_warning
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's per-order convergence chatter
    args = build_parser().parse_args(argv)
    if getattr(args, "deprecated", None):
        lab.warn_deprecated(args.deprecated)
    code = _run_command(args)
    return _leave_process(code) if argv is None else code


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"dpdro: warning: {message}", file=file or sys.stderr)


def _run_command(args: argparse.Namespace) -> int:
    """The exit status of the parsed command: an error becomes one line on stderr and its class's exit code."""
    try:
        return args.command_run(args)
    except BrokenPipeError:  # output piped into e.g. `head`, which closed early: not an error
        sys.stderr.close()
        return EXIT_OK
    except DpdroError as e:
        if args.verbose:
            import traceback

            traceback.print_exc()
        print(f"dpdro: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        if args.verbose:
            raise
        print("dpdro: stopped by Ctrl-C", file=sys.stderr)
        return EXIT_STOPPED
    except Exception as e:  # noqa: BLE001 - the CLI's boundary: one line, the traceback with -v
        if args.verbose:
            raise
        print(f"dpdro: error: {type(e).__name__}: {e} (dpdro -v ... prints the traceback)", file=sys.stderr)
        return EXIT_FAILURE


def _leave_process(code: int) -> int:
    """``code``, or, when a client thread is still running (a round interrupted by a second Ctrl-C, or a client
    abandoned after its round-timeout: ``client.local_transport.busy_client_threads``), leave the process now
    with ``code`` after flushing the output: shutting the interpreter down around a thread inside torch's C++ code
    aborts it with "terminate called without an active exception". Every file of the run directory is already
    complete (atomic writes; events.jsonl is fsynced), so nothing is lost. Only the console script calls this
    (``main()`` without argv): an in-process caller keeps its interpreter."""
    local = sys.modules.get("dpdro.client.local_transport")
    if local is None or not local.busy_client_threads():
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
