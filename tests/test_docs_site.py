"""The documentation site builds with mkdocs in strict mode (any warning fails: a broken link or anchor, a page
outside the nav, a nav entry without a page), its generated references follow the code, and the README stays
one screen of short lines whose links resolve."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built from this checkout with ``mkdocs build --strict`` into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    assert "WARNING" not in log, log
    return out


def _text(html: Path) -> str:
    return re.sub(r"<[^>]+>", "", html.read_text())


def test_site_builds_strict_and_has_every_nav_page(site):
    for page in ("index.html", "tutorials/own-data/index.html", "reference/configuration/index.html",
                 "reference/cli/index.html", "contributing/index.html", "research/RESULTS/index.html"):
        assert (site / page).is_file(), page


def test_key_reference_lists_every_key_with_its_default(site):
    from dpdro.common.config import FIELDS

    text = _text(site / "reference" / "configuration" / "index.html")
    for f in FIELDS:
        assert f"\n{f.key}\n" in text, f.key
    assert len(FIELDS) > 50


def test_cli_reference_has_every_listed_command(site):
    import argparse

    from dpdro.cli import build_parser

    text = _text(site / "reference" / "cli" / "index.html")
    commands = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)][0]
    names = [c.dest for c in commands._choices_actions]
    assert {"train", "simulate", "predict", "evaluate", "keys", "plan"} <= set(names)
    for name in names:
        assert f"dpdro {name}" in text, name


def test_nothing_generated_is_kept_in_docs():
    """The hook generates these pages at build time; a copy in docs/ would go stale (the hook refuses it too)."""
    for uri in ("reference/configuration.md", "reference/cli.md", "contributing.md"):
        assert not (DOCS / uri).exists(), uri


def test_readme_is_one_screen_of_short_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, len(lines)
    long = [i for i, line in enumerate(lines, 1) if len(line) > 120]
    assert not long, f"README.md lines longer than 120 characters: {long}"


def test_readme_links_to_own_data_on_its_first_screen():
    first_screen = "\n".join((ROOT / "README.md").read_text().splitlines()[:40])
    assert "(docs/tutorials/own-data.md)" in first_screen


@pytest.mark.parametrize("name", ["README.md", "CONTRIBUTING.md", "CHANGELOG.md"])
def test_relative_links_of_top_level_files_resolve(name):
    """Every relative link of README.md, CONTRIBUTING.md and CHANGELOG.md names a file of the checkout (the
    site does not build these three, so mkdocs does not check them)."""
    text = (ROOT / name).read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    assert targets or name == "CHANGELOG.md"
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert not missing, f"{name}: {missing}"


def test_docs_cite_no_tracker_numbers():
    """README, CONTRIBUTING and the docs cite no issue or stop numbers a reader cannot resolve."""
    pattern = re.compile(r"\b(?:issues?|stops?) \d+\b", re.I)
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]
    found = [f"{p.relative_to(ROOT)}: {m[0]}" for p in files for m in pattern.finditer(p.read_text())]
    assert not found, found
