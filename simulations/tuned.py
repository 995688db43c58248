"""Where the tuned configurations live and how they are named (``simulations/configs/tuned/``).

Shared by the search that writes them (``tune``), the sweep that runs them (``sweep``), the report tables that
cite them (``tables``) and the hazard study (``hazards``); it imports none of them, so none imports another
through it.
"""

from __future__ import annotations

from pathlib import Path

TUNED_CONFIGS = Path(__file__).resolve().parent / "configs" / "tuned"
TRANSFER_MARK = "# Transferred"  # first line of a file written by ``tune.transfer_tuned``
SEARCH_MARK = "# Tuned by `dpdro tune --dataset"  # first line of a file written by a search (``tune``)
# In a comment line at the top of a tuned file whose posthoc-tau was chosen after the search (or the transfer) on
# a validation split by the search's score (``dpdro lab tune --choose-posthoc-tau``, simulations/posthoc_tau.py; by hand
# before it: ``dpdro evaluate --posthoc-tau T1 T2 ...``); transferred files quote the source's first line, so the
# mark travels with the key.
RECHOSEN_MARK = "posthoc-tau then re-chosen"
# In a comment line at the top of a tuned file some of whose keys a one-factor lever table (``dpdro lab levers``,
# simulations/levers.py) chose on a validation split of the data set, after the search or the transfer:
# ``# <keys> {LEVERS_MARK} on <dataset>'s validation split ...``.
LEVERS_MARK = "re-chosen by `dpdro lab levers`"
# The configuration key through which a run knows what of it was chosen on a validation split of its private
# training records (the summary's not_accounted lists each item); the tools that choose set it in their files.
CHOSEN_KEY = "chosen-on-private-data"


def tuned_config_path(dataset: str, epsilon: float, algorithm: str, folder: Path = TUNED_CONFIGS) -> Path:
    """Config file written by ``dpdro lab tune`` for (dataset, epsilon, algorithm)."""
    return folder / f"{dataset}-eps{epsilon:g}-{algorithm}.toml"


def tuned_texts(dataset: str, epsilon: float, configs: Path) -> dict[str, str]:
    """Method -> the text of its tuned file of (dataset, epsilon) under ``configs``/tuned, in method order."""
    prefix = tuned_config_path(dataset, epsilon, "", Path()).stem  # '<dataset>-eps<e>-'
    files = sorted((configs / "tuned").glob(tuned_config_path(dataset, epsilon, "*", Path()).name))
    return {f.stem.removeprefix(prefix): f.read_text() for f in files}


def transferred_from(dataset: str, epsilon: float, configs: Path) -> str | None:
    """The source data set when the data set's tuned files were written by ``transfer_tuned`` (their first line
    says so); None when they came from a search on the data set or there are none."""
    texts = list(tuned_texts(dataset, epsilon, configs).values())
    if not texts:
        return None
    first = texts[0].splitlines()[0]
    if not first.startswith(TRANSFER_MARK) or "--transfer-from " not in first:
        return None
    return first.split("--transfer-from ")[1].split("`")[0]


def searched_methods(dataset: str, epsilon: float, configs: Path) -> list[str]:
    """The methods whose tuned file of (dataset, epsilon) a search on that data set wrote (its first line says so),
    sorted; [] when none did."""
    mark = f"{SEARCH_MARK} {dataset} "
    return [m for m, text in tuned_texts(dataset, epsilon, configs).items() if text.startswith(mark)]


def marked_methods(dataset: str, epsilon: float, configs: Path, mark: str) -> list[str]:
    """The methods whose tuned file of (dataset, epsilon) has ``mark`` in a comment line at its top, sorted:
    ``f"{RECHOSEN_MARK} on {dataset}'s"`` (a post-hoc tau re-chosen on the data set's validation split) or
    ``f"{LEVERS_MARK} on {dataset}'s"`` (keys a lever table chose on it)."""
    return [m for m, text in tuned_texts(dataset, epsilon, configs).items()
            if any(mark in line for line in leading_comments(text))]


def leading_comments(text: str) -> list[str]:
    """The comment lines at the top of a TOML file's ``text`` (a tuned file's header)."""
    lines = text.splitlines()
    return lines[:next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))]


def with_chosen_on_private(keys: dict, *items: str) -> dict:
    """``keys`` (a tuned file's) with ``items`` (of ``common.config.CHOSEN_ON_PRIVATE``) added to key
    chosen-on-private-data: the union with what it held, sorted and comma-separated; the other keys and their
    order stay. ValueError (a ConfigError) for an unknown item."""
    from ..common.config import Config

    held = keys.get(CHOSEN_KEY, "")
    merged = Config.from_mapping({CHOSEN_KEY: ",".join([held, *items])}).chosen_on_private
    return {**keys, CHOSEN_KEY: ",".join(merged)}
