"""The one base class of dpdro's own errors, and what each makes the ``dpdro`` command exit with.

Every error dpdro raises on purpose subclasses :class:`DpdroError` (keeping its other base, e.g. ``ValueError``,
so that callers catching that are unaffected); the command line catches the base, prints one line
``dpdro: error: <message>`` on stderr (the traceback too with ``-v``) and exits with the class's ``exit_code``.

Exit status of ``dpdro`` (also in docs/how-to/OPERATOR.md, "Exit status"):

====  ==========================================================================================================
code  meaning
====  ==========================================================================================================
0     success
1     a run failed for a reason other than its input (:class:`RunFailed`: a deployment or client failure, a
      malformed reply); a lab check that found a problem (an audit flag, no post-hoc tau reaching the floor);
      an unexpected error (one line; ``-v`` for the traceback)
2     the input cannot be used as given (:class:`DpdroError`: configuration, data, run directory, model, budget,
      a missing optional extra) or a command-line usage error (argparse); nothing was trained
130   stopped by Ctrl-C (:class:`Stopped`); a stopped ``dpdro train`` names its checkpoint and ``--resume``
128+N terminated by signal N while Flower processes ran (simulate, deploy: SIGTERM 143, SIGHUP 129); a
      SystemExit (``launch.processes.TerminatedBySignal``), not an error: the processes were stopped first
====  ==========================================================================================================
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_STOPPED = 130


class DpdroError(Exception):
    """Base of dpdro's errors: the input (configuration, data, files, run directory) cannot be used as given.
    ``exit_code``: what ``dpdro`` exits with when the error reaches it (EXIT_USAGE, 2)."""

    exit_code = EXIT_USAGE


class RunFailed(DpdroError):
    """A run (or a process it depends on) failed for a reason other than its input; ``dpdro`` exits with 1."""

    exit_code = EXIT_FAILURE


class Stopped(DpdroError):
    """Stopped on request (Ctrl-C); ``dpdro`` exits with 130, the shell's status for SIGINT."""

    exit_code = EXIT_STOPPED
