"""One base class for dpdro's errors (common/errors.py) and one exit-code table, the same in the module, in
docs/how-to/OPERATOR.md and in what the command line does."""

from __future__ import annotations

import ast
import builtins
import importlib
import re
from pathlib import Path

from dpdro.common import errors
from dpdro.common.errors import DpdroError

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"common": "dpdro.common", "server": "dpdro.server", "client": "dpdro.client", "launch": "dpdro.launch",
           "simulations": "dpdro.simulations", "dpdro": "dpdro"}
CODES = {errors.EXIT_OK, errors.EXIT_FAILURE, errors.EXIT_USAGE, errors.EXIT_STOPPED}


def _exception_classes() -> list[type]:
    """Every public class of the package's modules whose bases look like exceptions (a builtin exception or a
    name ending in Error), imported to check what it really derives from."""
    found = []
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            names = [n.name for n in tree.body if isinstance(n, ast.ClassDef) and not n.name.startswith("_")
                     and any(isinstance(b, ast.Name) and (b.id.endswith("Error") or isinstance(
                         getattr(builtins, b.id, None), type) and issubclass(getattr(builtins, b.id), BaseException))
                             for b in n.bases)]
            if names:
                rel = path.relative_to(ROOT / folder).with_suffix("")
                module = importlib.import_module(".".join([package, *rel.parts]).removesuffix(".__init__"))
                found += [c for c in (getattr(module, n) for n in names) if issubclass(c, BaseException)]
    return found


def test_every_error_of_dpdro_derives_from_the_base_and_keeps_its_other_base():
    found = [c for c in _exception_classes() if c.__module__.startswith("dpdro.")]
    exits = [c for c in found if issubclass(c, SystemExit)]  # an exit status on purpose, not an error
    assert [c.__name__ for c in exits] == ["TerminatedBySignal"]
    classes = [c for c in found if c not in exits]
    assert len(classes) >= 18, [c.__name__ for c in classes]
    outside = [f"{c.__module__}.{c.__name__}" for c in classes if not issubclass(c, DpdroError)]
    assert not outside, f"not a DpdroError: {outside}"
    assert all(c.exit_code in CODES for c in classes)
    # callers that catch the builtin base are unaffected
    from dpdro.common.config import ConfigError
    from dpdro.common.data_types import DataError
    from dpdro.launch.certs import CertificateExistsError
    from dpdro.server.engine import TrainingStopped

    assert issubclass(ConfigError, ValueError) and issubclass(DataError, FileNotFoundError)
    assert issubclass(CertificateExistsError, FileExistsError)
    assert (ConfigError.exit_code, DataError.exit_code, TrainingStopped.exit_code) == (2, 2, 130)


def test_the_exit_code_table_is_the_same_in_the_module_and_the_operator_guide():
    module = {int(m) for m in re.findall(r"^(\d+)\s{2,}\S", errors.__doc__, re.M)}
    guide = (ROOT / "docs" / "how-to" / "OPERATOR.md").read_text().split("## Exit status", 1)[1].split("\n## ", 1)[0]
    documented = {int(m) for m in re.findall(r"^\| (\d+) \|", guide, re.M)}
    assert module == documented == CODES == {0, 1, 2, 130}
    assert re.search(r"^128\+N\s+terminated by signal N", errors.__doc__, re.M) and "| 128+N | terminated" in guide
