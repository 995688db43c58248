"""The import layers of CONTRIBUTING.md hold (import-linter contracts in pyproject.toml), and a new upward
import makes this test fail."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import importlinter  # noqa: F401 - the dev extra; fail loudly rather than skip the contracts
import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"


def mirror_packages(dest: Path) -> Path:
    """Copy the sources into one ``dpdro/`` tree, as [tool.setuptools.package-dir] maps them (``common/`` ->
    ``dpdro/common/``, ...): grimp, under import-linter, only walks a package's own folder. Returns ``dest``."""
    package_dir = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in package_dir.items():
        target = dest.joinpath(*package.split("."))
        shutil.copytree(ROOT / folder, target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "configs", "*.md"))
    return dest


def lint(tree: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with this project's contracts on the package tree ``tree`` (first on the path)."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(PYPROJECT)!r}, no_cache=True))")
    env = {"PYTHONPATH": str(tree), "PATH": "", "COLUMNS": "300"}  # wide: contract names on one line
    return subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return mirror_packages(tmp_path_factory.mktemp("layers"))


def test_every_import_contract_is_kept(tree):
    out = lint(tree)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Contracts: 5 kept, 0 broken." in out.stdout, out.stdout


@pytest.mark.parametrize(("module", "line", "contract", "offence"), [
    ("common/rng.py", "from ..server import engine", "layers", "dpdro.common.rng -> dpdro.server.engine"),
    ("server/ledger.py", "from ..client import worker", "layers", "dpdro.server.ledger -> dpdro.client.worker"),
    ("server/engine.py", "import flwr", "flower-only-in-adapters", "dpdro.server.engine -> flwr"),
    ("client/worker.py", "from .flower import app", "core-below-adapters",
     "dpdro.client.worker -> dpdro.client.flower.app"),
    ("simulations/tuned.py", "from . import sweep", "no-sibling-cycles", "- .tuned -> .sweep"),
    ("cli/evaluate.py", "from ..simulations import tuned", "product-without-lab",
     "dpdro.cli.evaluate -> dpdro.simulations.tuned"),
])
def test_a_new_upward_or_cross_import_is_caught(tree, tmp_path, module, line, contract, offence):
    """One injected import breaks the contract that forbids it (an upward one also makes a cycle), and the
    report names the import."""
    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    name = next(c["name"] for c in contracts if c["id"] == contract)
    broken = shutil.copytree(tree, tmp_path / "broken")
    path = broken / "dpdro" / module
    path.write_text(path.read_text() + f"\n{line}  # injected by the test\n")
    out = lint(broken)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"{name} BROKEN" in out.stdout, out.stdout
    assert offence in out.stdout, out.stdout
