"""One state machine per algorithm (docs/explanation/ALGORITHMS.md); ``make_algorithm`` picks one from the config.

Importing this package registers the built-in algorithms (``ALGORITHMS``, filled by ``register_algorithm``).
"""

from __future__ import annotations

from . import double_spider, dp_sgd, dp_sgda, dp_spiderboost, recursive_spider  # noqa: F401  (they register)
from .base import Algorithm, State
from .registry import ALGORITHMS, make_algorithm, register_algorithm

__all__ = ["Algorithm", "State", "ALGORITHMS", "make_algorithm", "register_algorithm"]
