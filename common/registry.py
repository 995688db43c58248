"""A registry of plug-ins of one kind: a dict from a kebab-case name to an entry, filled at import time by a
decorator (the pattern of Opacus' ``register_grad_sampler``).

The project keeps one registry per plug-in kind, in the lowest layer that may hold it:

- per-record quantities: ``common.quantities.QUANTITIES`` (name -> function)
- data sets: ``common.data.DATASETS`` (name -> ``DatasetSpec``)
- models: ``common.models.MODELS`` (name -> ``nn.Module`` factory)
- algorithms: ``common.algorithm_specs.ALGORITHM_SPECS`` (name -> ``AlgorithmSpec``: what the config, the tuner
  and the tables need) and ``server.algorithms.ALGORITHMS`` (name -> the state-machine class)

Everything else that lists names (the config's allowed values, the default model of a data set, the tuning
spaces, the results tables) is derived from these. CONTRIBUTING.md says how to add a plug-in.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

# The value of a key whose setting is derived (from a registry entry, the environment, ...): "model = auto" takes
# the data set's default model. Here, in the leaf module, so that config and data both import it without a cycle.
AUTO = "auto"

# An import path 'package.module:attribute' (config values dataset=... and model=... naming user code).
_ENTRY_POINT = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_entry_point(value: str) -> bool:
    """Whether ``value`` is written as an import path 'package.module:attribute' (syntax only; imports nothing)."""
    return isinstance(value, str) and _ENTRY_POINT.fullmatch(value) is not None


def load_entry_point(path: str, kind: str) -> Any:
    """The object named by the import path 'package.module:attribute' (attribute may be dotted).

    Raises ValueError naming ``kind`` (e.g. "model"), the path and the cause: bad syntax, a module that cannot
    be imported (with the import error), or a missing attribute. The module's folder must be importable: on
    sys.path, e.g. installed or in the current directory / PYTHONPATH.
    """
    if not is_entry_point(path):
        raise ValueError(f"{kind} {path!r}: not an import path; allowed: 'package.module:attribute'")
    module_name, attribute = path.split(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{kind} {path!r}: cannot import module '{module_name}' ({type(e).__name__}: {e}); put "
                         "its folder on PYTHONPATH (or install it) on every machine that trains") from None
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{kind} {path!r}: module '{module_name}' has no attribute '{attribute}'") from None
        obj = getattr(obj, part)
    return obj


class Registry(dict[str, T], Generic[T]):
    """Name -> entry for one plug-in kind (``kind``, e.g. "data set", names it in errors).

    ``register(name)`` is a decorator; ``register(name, entry)`` registers directly. A name registered twice
    raises ValueError (two plug-ins may not silently shadow each other); ``get_entry`` raises ValueError naming
    the kind, the name and the registered names. With ``entry_point`` (object, path) -> entry, ``get_entry`` also
    accepts an import path 'package.module:attribute' of user code, imported then and converted by it (which
    raises ValueError for an object it cannot use).
    """

    def __init__(self, kind: str, entry_point: Callable[[Any, str], T] | None = None) -> None:
        super().__init__()
        self.kind = kind
        self.entry_point = entry_point

    def register(self, name: str, entry: T | None = None) -> Callable[[T], T] | T:
        def add(obj: T) -> T:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is already registered (by {self[name]!r})")
            self[name] = obj
            return obj

        return add if entry is None else add(entry)

    def get_entry(self, name: str) -> T:
        if name in self:
            return self[name]
        if self.entry_point is not None and is_entry_point(name):
            return self.entry_point(load_entry_point(name, self.kind), name)
        more = " or an import path 'package.module:attribute'" if self.entry_point is not None else ""
        raise ValueError(f"unknown {self.kind} {name!r}; allowed: {', '.join(self)}{more}")

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self)
