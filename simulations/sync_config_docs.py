"""Regenerate pyproject.toml's [tool.flwr.app.config] table from common/config.py (FIELDS), the single source of
keys. (The documentation site's key reference is generated from FIELDS when the site is built: mkdocs_hooks.py.)

Usage: .venv/bin/python simulations/sync_config_docs.py   (tests/test_docs.py fails while they disagree)
"""

from __future__ import annotations

from pathlib import Path

from dpdro.common.atomic import atomic_write_text
from dpdro.common.config import default_toml_table

ROOT = Path(__file__).resolve().parent.parent
TABLE = "[tool.flwr.app.config]"


def pyproject_text(text: str) -> str:
    """``text`` (pyproject.toml) with everything after the run-config table header regenerated from FIELDS."""
    return text[: text.index(TABLE) + len(TABLE)] + "\n" + default_toml_table() + "\n"


if __name__ == "__main__":
    path = ROOT / "pyproject.toml"
    atomic_write_text(path, pyproject_text(path.read_text()))
    print(f"updated {path}")
