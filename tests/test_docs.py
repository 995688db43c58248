"""Generated listings stay in sync with the configuration schema (the single source of keys)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _sync_module():
    spec = importlib.util.spec_from_file_location("sync_config_docs", ROOT / "simulations" / "sync_config_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_key_table_matches_schema():
    mod = _sync_module()
    text = (ROOT / "README.md").read_text()
    assert mod.readme_text(text) == text, "run simulations/sync_config_docs.py"


def test_pyproject_run_config_matches_schema():
    mod = _sync_module()
    text = (ROOT / "pyproject.toml").read_text()
    assert mod.pyproject_text(text) == text, "run simulations/sync_config_docs.py"
