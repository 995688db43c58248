"""The algorithm registry: name -> state-machine class, filled by the ``register_algorithm`` decorator.

The name must be declared in ``common.algorithm_specs.ALGORITHM_SPECS`` (what the config, the client and the
tuner know of an algorithm); a plug-in passes its ``AlgorithmSpec`` instead of the name, which declares it there
too, so that a new algorithm is one file (CONTRIBUTING.md).
"""

from __future__ import annotations

from ...common.algorithm_specs import ALGORITHM_SPECS, AlgorithmSpec, declare_algorithm
from ...common.registry import Registry
from .base import Algorithm

ALGORITHMS: Registry[type[Algorithm]] = Registry("algorithm")


def register_algorithm(spec: str | AlgorithmSpec):
    """Class decorator: register an ``Algorithm`` subclass under a declared name (or declare ``spec`` first).

    Sets the class's ``name`` and ``spec``. Raises ValueError for an undeclared or already registered name.
    """
    if isinstance(spec, AlgorithmSpec):
        declare_algorithm(spec)
        spec = spec.name
    declared = ALGORITHM_SPECS.get_entry(spec)

    def add(cls: type[Algorithm]) -> type[Algorithm]:
        cls.name, cls.spec = declared.name, declared
        return ALGORITHMS.register(declared.name, cls)

    return add


def make_algorithm(cfg, n: int, dim: int, num_classes: int = 10, num_groups: int = 0) -> Algorithm:
    """The algorithm named by config key ``algorithm`` (``num_groups``: G of the data set's declared group
    attribute, 0 if none). Raises ValueError for an unknown name."""
    cls = ALGORITHMS.get_entry(cfg.algorithm)
    algo = cls.variant_for(cfg)(cfg, n, dim, num_classes)
    algo.num_groups = num_groups
    algo.name, algo.spec = cls.name, cls.spec  # a variant runs under its algorithm's name
    return algo
