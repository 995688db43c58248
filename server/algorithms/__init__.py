"""One state machine per algorithm (ALGORITHMS.md); ``make_algorithm`` picks one from the config."""

from __future__ import annotations

from .base import Algorithm, State
from .double_spider import DoubleSpider
from .dp_sgd import DpSgd, DpSgdDual, DpSgdLA
from .dp_sgda import DpSgda
from .dp_spiderboost import DpSpiderBoost
from .recursive_spider import RecursiveSpider

REGISTRY: dict[str, type[Algorithm]] = {
    cls.name: cls for cls in (DoubleSpider, RecursiveSpider, DpSgd, DpSgdLA, DpSgdDual, DpSpiderBoost, DpSgda)}


def make_algorithm(cfg, n: int, dim: int, num_classes: int = 10) -> Algorithm:
    """The algorithm named by config key ``algorithm``. Raises ValueError for an unknown name."""
    try:
        cls = REGISTRY[cfg.algorithm]
    except KeyError:
        raise ValueError(f"unknown algorithm {cfg.algorithm!r}; allowed: {', '.join(REGISTRY)}") from None
    return cls(cfg, n, dim, num_classes)


__all__ = ["Algorithm", "State", "REGISTRY", "make_algorithm"]
