"""Generated listings stay in sync with the configuration schema (the single source of keys), citations of the
design notes resolve, and no doc or source makes a claim that was once false of the code."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _sync_module():
    spec = importlib.util.spec_from_file_location("sync_config_docs", ROOT / "simulations" / "sync_config_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pyproject_run_config_matches_schema():
    mod = _sync_module()
    text = (ROOT / "pyproject.toml").read_text()
    assert mod.pyproject_text(text) == text, "run simulations/sync_config_docs.py"


DESIGN_DOCS = ("ALGORITHMS", "ARCHITECTURE", "FLOWER")
SOURCE_FOLDERS = ("dpdro", "common", "server", "client", "launch", "simulations", "tests")
DESIGN_FOLDER = ROOT / "docs" / "explanation"  # where the design notes the code cites live


def doc_files() -> list[Path]:
    """README.md, CONTRIBUTING.md and every Markdown page under docs/ (any depth)."""
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


def design_references() -> list[tuple[str, str, str]]:
    """(where, document, section or pitfall) of every "ALGORITHMS.md 5.4"-style citation in the code; the
    section is "" when none is named, "pitfall N" for FLOWER.md's pitfalls."""
    import re

    pattern = re.compile(rf"\b({'|'.join(DESIGN_DOCS)})\.md(?:,? (?:sections? )?(\d+(?:\.\d+)?\b|pitfall \d+))?")
    refs = []
    for folder in SOURCE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                refs += [(f"{path.relative_to(ROOT)}:{i}", m[1], m[2] or "") for m in pattern.finditer(line)]
    return refs


def test_design_references_in_the_code_resolve_to_docs():
    """Every ARCHITECTURE.md / FLOWER.md / ALGORITHMS.md citation names a file in docs/explanation/ and a section
    (or pitfall) that it has."""
    import re

    refs = design_references()
    assert {doc for _, doc, _ in refs} == set(DESIGN_DOCS), "the pattern no longer finds the citations"
    assert sum(1 for _, doc, _ in refs if doc in ("ARCHITECTURE", "FLOWER")) >= 16
    for where, doc, section in refs:
        path = DESIGN_FOLDER / f"{doc}.md"
        assert path.is_file(), f"{where}: {doc}.md is not in docs/explanation/"
        text = path.read_text()
        if section.startswith("pitfall"):
            pitfalls = text.split("## 7. Pitfalls", 1)[1]
            assert re.search(rf"^{section.split()[1]}\. ", pitfalls, re.M), f"{where}: {doc}.md has no {section}"
        elif section:
            heading = rf"^#+ {re.escape(section)}[. ]"
            assert re.search(heading, text, re.M), f"{where}: {doc}.md has no section {section}"


# Claims that reading private records, or choosing on them, costs no privacy: each was in the docs or the code once.
FREE_CLAIMS_ON_PRIVATE_RECORDS = (
    "Post-hoc tau costs no training and no budget",  # README: choosing tau on validation
    "Predictions and the model files are post-processing of the released model: no privacy cost",  # any split
    "`train` and `validation` also work.",  # README: with no word that they are not private
    "validation split of this data set (post-processing of a released model, no budget",  # RESULTS.md, tables.py
    "no privacy budget beyond the run's",  # simulations/posthoc_tau.py
    "post-processing, no training, no budget",  # TUNING.md: choosing tau on validation
    "to choose tau on the validation split (post-processing of the released model with the released priors; no "
    "budget spent)",  # server/prediction.py
)
FREE = ("no budget", "no privacy cost", "costs nothing", "no privacy budget", "free of privacy")


def _normalised(path: Path) -> str:
    return " ".join(path.read_text().split())


def test_no_doc_says_reading_or_choosing_on_private_splits_is_free():
    """Applying a post-hoc tau, and predicting or evaluating on the public test split, are post-processing; choosing
    a tau or a checkpoint on a validation split, or evaluating on train / validation, is not accounted (README:
    'What is private'). No README, CONTRIBUTING, docs/ or source sentence may say otherwise."""
    import re

    docs = doc_files()
    code = [p for folder in SOURCE_FOLDERS if folder != "tests" for p in sorted((ROOT / folder).rglob("*.py"))]
    for path in docs + code:
        text = _normalised(path)
        for claim in FREE_CLAIMS_ON_PRIVATE_RECORDS:
            assert claim not in text, f"{path.relative_to(ROOT)}: {claim!r}"
    private = re.compile(r"validation split|--data validation|`train`|--data train")
    for path in docs:
        for sentence in re.split(r"(?<=[.;])\s+", _normalised(path)):
            if any(f in sentence for f in FREE) and private.search(sentence):
                assert "not accounted" in sentence or "not private" in sentence, (
                    f"{path.relative_to(ROOT)}: {sentence!r}")


# Claims about randomness that were false of the code: by default the noise comes from numpy's PCG64 seeded from
# the OS CSPRNG (common/rng.py), not from the CSPRNG itself (only secure-noise=true builds it of CSPRNG bytes, which
# the docs say in those words); and Opacus' secure_mode does resist floating-point attacks on the Gaussian
# mechanism (Mironov 2012), which dpdro's default does not.
WRONG_CLAIMS = {
    r"\b(?:noise|draws?|samples?|sampling)\b(?: (?:all )?(?:comes?|is drawn|are drawn))? from the "
    r"(?:OS|operating system's) CSPRNG": "the noise comes from PCG64 seeded from the OS CSPRNG, not the CSPRNG",
    r"\ball noise comes from": "the noise comes from PCG64 seeded from the OS CSPRNG",
    r"\bnoise \((?:the )?OS CSPRNG": "the noise comes from PCG64 seeded from the OS CSPRNG, not the CSPRNG",
    r"\b(?:as in|like) Opacus\b": "Opacus' secure_mode protects against floating-point attacks; dpdro does not",
}


def test_docs_and_sources_make_no_wrong_randomness_claims():
    """README.md, CONTRIBUTING.md, docs/**/*.md and the Python sources (docstrings, comments, help text) never
    say that the noise comes from the OS CSPRNG or that dpdro handles floating-point attacks 'as in Opacus'
    (case-insensitive; a phrase broken across lines, comment lines or adjacent string literals counts)."""
    import re

    files = doc_files()
    files += [p for folder in SOURCE_FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))
              if p != Path(__file__).resolve()]
    assert len(files) > 100
    found = []
    for path in files:
        flat = re.sub(r"\s*#\s*|\s+", " ", re.sub(r'"\s+"', " ", path.read_text()))
        found += [f"{path.relative_to(ROOT)}: '{m.group()}' ({why})" for pattern, why in WRONG_CLAIMS.items()
                  for m in re.finditer(pattern, flat, re.IGNORECASE)]
    assert not found, "\n".join(found)
