"""The declaration of a configuration key (``Field``) and of the sections keys belong to; no key is declared here.

common/config.py declares the keys every run reads; each algorithm declares the keys only it reads in its
``AlgorithmSpec`` (common/algorithm_specs.py for the built-in ones, the plug-in's own file otherwise). Both import
this module, which imports nothing of the project but ``common.registry``, so that declaring a key never imports
torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import keyword
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .errors import DpdroError
from .registry import AUTO, is_entry_point

# What a key changes (Field.role): 'data' which records a node holds or evaluates (the client's shard-cache key);
# 'runtime' how a run executes, not what it computes (a resumed run may change it); 'privacy' the target, the
# accountant and where noise goes; 'algorithm' everything else that changes what a run computes.
ROLES = ("data", "runtime", "privacy", "algorithm")

# Where a key lives in a Config (Field.section): 'data', 'privacy' and 'runtime' as their role; 'training' the
# keys of role 'algorithm' every run reads (the algorithm's name, the model, iterations, the step and clip of the
# model, the DRO objective evaluated); 'algorithm' the parameters some algorithms read, each declared by an
# algorithm's spec (``Config.params`` holds those of the chosen algorithm).
SECTIONS = ("data", "training", "privacy", "runtime", "algorithm")

# The Python type of a value of each Field.kind (a key that allows 'auto' also holds that string).
KIND_TYPES: dict[str, type] = {"int": int, "float": float, "bool": bool, "str": str}


class ConfigError(ValueError, DpdroError):
    """A configuration value is missing, of the wrong type or out of range.

    The message names the key, the value given and what is allowed.
    """


@dataclass(frozen=True)
class Field:
    """Declaration of one configuration key.

    kind: "int", "float", "bool" or "str". ``choices`` restricts a str: a tuple, or a function returning one
    (the names of a plug-in registry, read when a value is checked, so that a plug-in registered later is
    allowed); with ``entry_point`` also an import path 'package.module:attribute' (user code, checked by
    ``Config`` validation). ``low``/``high`` bound a number (``low_open``/``high_open`` make the bound strict).
    ``auto`` allows the string "auto" (meaning: derived, see help). ``allow_inf`` allows +inf for a float.
    ``role`` (one of ``ROLES``) says what the key changes; the key lists of the engine and the client derive from it.
    ``section`` (one of ``SECTIONS``): where the key lives in a Config; '' derives it from the role ('algorithm'
    for a key an ``AlgorithmSpec`` declares: ``param``).
    """

    key: str
    kind: str
    default: Any
    help: str
    choices: tuple[str, ...] | Callable[[], tuple[str, ...]] | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    auto: bool = False
    allow_inf: bool = False
    role: str = ""
    entry_point: bool = False
    section: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"config field '{self.key}': role {self.role!r}; allowed: one of {', '.join(ROLES)}")
        if not self.section:
            object.__setattr__(self, "section", "training" if self.role == "algorithm" else self.role)
        if self.section not in SECTIONS:
            raise ValueError(f"config field '{self.key}': section {self.section!r}; allowed: one of "
                             f"{', '.join(SECTIONS)}")

    @property
    def type(self) -> Any:
        """The Python type of a parsed value (``float | str`` for a key that allows 'auto')."""
        t = KIND_TYPES[self.kind]
        return t | str if self.auto and t is not str else t

    @property
    def options(self) -> tuple[str, ...] | None:
        """The allowed strings (``choices`` resolved), or None for any string."""
        return self.choices() if callable(self.choices) else self.choices

    @property
    def attr(self) -> str:
        """Python attribute name: '-' becomes '_', and a keyword gets a trailing '_' ('lambda_')."""
        name = self.key.replace("-", "_")
        return name + "_" if keyword.iskeyword(name) else name

    def allowed(self) -> str:
        """What the key accepts, in words (error messages, `dpdro keys`, the README's key table)."""
        if self.kind == "bool":
            return "true or false"
        if self.choices is not None:
            more = " or an import path 'package.module:name'" if self.entry_point else ""
            return "one of " + ", ".join(repr(c) for c in self.options) + more
        if self.kind == "str":
            return "a string" + (" or 'auto'" if self.auto else "")
        lo = "-inf" if self.low is None else f"{self.low:g}"
        hi = "inf" if self.high is None else f"{self.high:g}"
        lb = "(" if self.low_open or self.low is None else "["
        rb = ")" if (self.high_open or self.high is None) and not self.allow_inf else "]"
        text = f"{'an integer' if self.kind == 'int' else 'a number'} in {lb}{lo}, {hi}{rb}"
        if self.allow_inf and self.high is not None:
            text += " or inf"
        if self.auto:
            text += " or 'auto'"
        return text

    def parse(self, value: Any) -> Any:
        """Convert and check ``value``; raise ConfigError naming this key otherwise."""

        def fail() -> ConfigError:
            near = (difflib.get_close_matches(value, self.options, n=1, cutoff=0.6)
                    if isinstance(value, str) and self.choices is not None else [])
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            return ConfigError(f"config key '{self.key}': got {value!r}{hint}; allowed: {self.allowed()}")

        if self.auto and isinstance(value, str) and value.strip().lower() == AUTO:
            return AUTO
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
                return value.strip().lower() in ("true", "1")
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            raise fail()
        if self.kind == "str":
            if not isinstance(value, str):
                raise fail()
            if self.choices is not None and value not in self.options and not (
                    self.entry_point and is_entry_point(value)):
                raise fail()
            return value
        if isinstance(value, bool):
            raise fail()
        if self.kind == "int":
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, str):
                try:
                    value = int(value.strip())
                except ValueError:
                    raise fail() from None
            if not isinstance(value, int) or abs(value) > 2**63:
                raise fail()
            out: float = value
        else:
            if isinstance(value, str):
                try:
                    value = float(value.strip())
                except ValueError:
                    raise fail() from None
            if not isinstance(value, (int, float)):
                raise fail()
            try:
                out = float(value)
            except OverflowError:  # an int beyond float range
                raise fail() from None
            if math.isnan(out) or (math.isinf(out) and not (self.allow_inf and out > 0)):
                raise fail()
        if self.low is not None and (out < self.low or (self.low_open and out == self.low)):
            raise fail()
        if self.high is not None and not math.isinf(out):
            if out > self.high or (self.high_open and out == self.high):
                raise fail()
        return out


def param(key: str, kind: str, default: Any, help: str, **kw: Any) -> Field:
    """A ``Field`` of section 'algorithm': a key that an algorithm declares in its ``AlgorithmSpec.params``
    (role 'algorithm' unless given)."""
    return Field(key, kind, default, help, **{"role": "algorithm", **kw, "section": "algorithm"})


def section_class(name: str, fields: Iterable[Field]) -> type:
    """A frozen dataclass named ``name`` with one typed attribute per field (``Field.attr``, ``Field.type``, the
    default), e.g. the ``privacy`` section of a Config or an algorithm's parameters."""
    spec = [(f.attr, f.type, dataclasses.field(default=f.default)) for f in fields]
    return dataclasses.make_dataclass(name, spec, frozen=True)
