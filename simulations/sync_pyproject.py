"""Regenerate pyproject.toml's [tool.flwr.app.config] table from common/config.py (FIELDS).

Usage: python simulations/sync_pyproject.py   (tests/test_config.py fails while the two disagree)
"""

from pathlib import Path

from dpdro.common.config import default_toml_table

MARKER = "[tool.flwr.app.config]"

path = Path(__file__).resolve().parent.parent / "pyproject.toml"
text = path.read_text()
head = text[: text.index(MARKER) + len(MARKER)]
path.write_text(head + "\n" + default_toml_table() + "\n")
print(f"updated {path}")
