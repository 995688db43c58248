"""A registry of plug-ins of one kind: a dict from a kebab-case name to an entry, filled at import time by a
decorator (the pattern of Opacus' ``register_grad_sampler``).

The project keeps one registry per plug-in kind, in the lowest layer that may hold it:

- per-record quantities: ``common.quantities.QUANTITIES`` (name -> function)
- data sets: ``common.data.DATASETS`` (name -> ``DatasetSpec``)
- models: ``common.models.MODELS`` (name -> ``nn.Module`` factory)
- algorithms: ``common.algorithm_specs.ALGORITHM_SPECS`` (name -> ``AlgorithmSpec``: what the config, the tuner
  and the tables need) and ``server.algorithms.ALGORITHMS`` (name -> the state-machine class)

Everything else that lists names (the config's allowed values, the default model of a data set, the tuning
spaces, the results tables) is derived from these. docs/DEVELOPING.md says how to add a plug-in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

# The value of a key whose setting is derived (from a registry entry, the environment, ...): "model = auto" takes
# the data set's default model. Here, in the leaf module, so that config and data both import it without a cycle.
AUTO = "auto"


class Registry(dict[str, T], Generic[T]):
    """Name -> entry for one plug-in kind (``kind``, e.g. "data set", names it in errors).

    ``register(name)`` is a decorator; ``register(name, entry)`` registers directly. A name registered twice
    raises ValueError (two plug-ins may not silently shadow each other); ``get_entry`` raises ValueError naming
    the kind, the name and the registered names.
    """

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, name: str, entry: T | None = None) -> Callable[[T], T] | T:
        def add(obj: T) -> T:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is already registered (by {self[name]!r})")
            self[name] = obj
            return obj

        return add if entry is None else add(entry)

    def get_entry(self, name: str) -> T:
        try:
            return self[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; allowed: {', '.join(self)}") from None

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self)
