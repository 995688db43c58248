"""mkdocs hooks (``hooks:`` in mkdocs.yml): the pages generated from the code at build time, so that nothing
generated is kept in git and the site cannot disagree with the code.

- ``reference/configuration.md``: every configuration key from ``dpdro.common.config.FIELDS`` (key, default,
  allowed values, help), the same schema that validates a run.
- ``reference/cli.md``: every ``dpdro`` command and sub-command, the help argparse prints for it
  (``dpdro.cli.build_parser``).
- ``contributing.md``: CONTRIBUTING.md from the repository root, its ``docs/`` links made relative to the site.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent
HELP_WIDTH = "100"  # argparse wraps to $COLUMNS: a fixed width keeps the page the same on every machine


def _cell(text: object) -> str:
    """``text`` as one Markdown table cell: pipes escaped, no line breaks."""
    return " ".join(str(text).split()).replace("|", "\\|")


def configuration_page() -> str:
    """Markdown of the key reference: one table row per ``FIELDS`` entry, under a heading per section when the
    fields declare one (``Field.section``)."""
    from dpdro.common.config import FIELDS

    lines = ["# Configuration keys", "",
             "Every key works the same in `--set key=value`, in a `--config FILE.toml` (plain `key = value` lines), "
             "in `dpdro.fit({...})` and in Flower's `--run-config`. A bad value stops the run before any work, with "
             "a message naming the key, the value and what is allowed. `dpdro keys` prints this list. This page is "
             "generated from the schema (`common/config.py`, `FIELDS`) when the site is built.", ""]
    header = ["| key | default | allowed | meaning |", "|---|---|---|---|"]
    current, first = None, True
    for f in FIELDS:
        here = getattr(f, "section", None)
        if first or here != current:
            if here:
                lines += ["", f"## {here}", ""]
            lines += header
            current, first = here, False
        default = "" if f.default == "" else f"`{f.default}`"
        lines.append(f"| `{f.key}` | {default} | {_cell(f.allowed())} | {_cell(f.help)} |")
    return "\n".join(lines) + "\n"


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each listed sub-command of ``parser``; aliases and sub-commands whose
    help is suppressed are left out, as ``--help`` leaves them out."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                out.append((choice.dest, choice.help or "", action.choices[choice.dest]))
    return out


def cli_page() -> str:
    """Markdown of the command reference: the ``--help`` of ``dpdro`` and of every sub-command, depth first."""
    from dpdro.cli import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        root = build_parser()
        lines = ["# Command line", "",
                 "Every `dpdro` command with the help it prints (`dpdro COMMAND --help`), generated from the "
                 "command line's own parser (`dpdro.cli.build_parser`) when the site is built.", ""]

        def add(parser: argparse.ArgumentParser, words: list[str], summary: str) -> None:
            name = " ".join(words)
            lines.extend([f"{'#' * len(words)} `{name}`", ""] if len(words) > 1 else [])  # lab tune: ###
            if summary:
                lines.extend([summary[0].upper() + summary[1:] + ".", ""])
            lines.extend(["```text", parser.format_help().rstrip(), "```", ""])
            for sub, helptext, child in _subcommands(parser):
                add(child, [*words, sub], helptext)

        add(root, ["dpdro"], "")
        return "\n".join(lines)
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def contributing_page() -> str:
    """CONTRIBUTING.md with its links into ``docs/`` made relative to the site's root."""
    return re.sub(r"\]\(docs/", "](", (ROOT / "CONTRIBUTING.md").read_text())


GENERATED = {"reference/configuration.md": configuration_page, "reference/cli.md": cli_page,
             "contributing.md": contributing_page}


def on_files(files, config):
    """mkdocs event: add the generated pages to the site's files (they are not in docs/)."""
    for uri, make in GENERATED.items():
        if files.get_file_from_path(uri) is not None:
            raise ValueError(f"docs/{uri} is generated at build time (mkdocs_hooks.py): delete the file")
        files.append(File.generated(config, uri, content=make()))
    return files
