"""pyproject.toml declares what the code imports, and records the torch, torchvision and flwr versions CI tests.

- Every third-party package imported anywhere in the package (also inside functions) is a declared requirement:
  the product's folders need the core list or a user-facing extra, the lab (simulations/) may also use the dev
  extra. (scipy, pillow, httpx, starlette and uvicorn were imported without being declared.)
- torch, torchvision and flwr are ranges; [tool.dpdro.tested] records the versions CI tests, which must lie in
  them, as must the installed ones (printed: `pytest -s tests/test_dependencies.py`).
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PRODUCT = ("dpdro", "common", "server", "client", "launch")
LAB = ("simulations",)
RANGED = ("torch", "torchvision", "flwr")


def imported_distributions(folders: tuple[str, ...]) -> dict[str, set[str]]:
    """{distribution: files importing it} of every absolute import (module level or inside a function) of the
    .py files under ``folders``, leaving out the standard library and dpdro itself."""
    owners = md.packages_distributions()
    found: dict[str, set[str]] = defaultdict(set)
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"dpdro"}:
                    assert top in owners, f"{path.relative_to(ROOT)} imports {top}, which no installed package has"
                    for dist in owners[top]:
                        found[canonicalize_name(dist)].add(str(path.relative_to(ROOT)))
    return found


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def test_every_imported_package_is_declared():
    core = _names(PYPROJECT["project"]["dependencies"])
    extras = {k: _names(v) for k, v in PYPROJECT["project"]["optional-dependencies"].items()}
    user_facing = core.union(*(v for k, v in extras.items() if k != "dev"))
    product = imported_distributions(PRODUCT)
    missing = {d: sorted(f) for d, f in product.items() if d not in user_facing}
    assert not missing, f"imported by the product, not declared in dependencies or a user-facing extra: {missing}"
    lab = imported_distributions(LAB)
    missing = {d: sorted(f) for d, f in lab.items() if d not in user_facing | extras["dev"]}
    assert not missing, f"imported by the lab, not declared: {missing}"
    # the ones once imported without a declaration are now core requirements (the ledger needs scipy at import)
    assert {"scipy", "pillow", "httpx", "starlette", "uvicorn"} <= core
    assert {"scipy", "pillow", "httpx", "starlette", "uvicorn", "torch", "flwr"} <= set(product)


def test_torch_torchvision_and_flwr_are_ranges_holding_the_tested_and_installed_versions(capsys):
    specs = {canonicalize_name(r.name): r.specifier
             for r in map(Requirement, PYPROJECT["project"]["dependencies"])}
    tested = PYPROJECT["tool"]["dpdro"]["tested"]
    assert sorted(tested) == sorted(RANGED)
    lines = []
    for name in RANGED:
        spec = specs[name]
        assert len(spec) >= 2 and not any(s.operator == "==" for s in spec), f"{name}: {spec} is not a range"
        installed = md.version(name)
        assert Version(tested[name]) in spec, f"{name}: tested {tested[name]} outside {spec}"
        assert Version(installed) in spec, f"{name}: installed {installed} outside {spec}"
        lines.append(f"{name}: range {spec}, CI-tested {tested[name]}, installed {installed}")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
