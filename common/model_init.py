"""A model's starting point and which of its parameters train: config keys ``init-weights`` and ``trainable``.

``init-weights = PATH``: a state_dict saved with ``torch.save`` (a dpdro run's ``model.pt`` is one) of weights
trained on public data, loaded into the model before training. The file is public input: it costs no privacy,
and it must never have been trained on the private records (docs/how-to/own-data.md). It is loaded with
``torch.load(weights_only=True)`` and strictly: every tensor of the model's state_dict must be in it with the
model's shape, and nothing else.

``trainable = all | head | NAME,...``: the parameters that train; the others are frozen at their initial values
(``requires_grad`` False). 'head' is the parameters of the model's last ``nn.Linear`` (in registration order);
otherwise a comma-separated list of module or parameter names, each selecting the parameters whose name is it or
begins with it followed by '.'. ``per_sample.FlatModel`` covers the trainable parameters only, so per-record
gradients, clipping, noise and the ledger's dimension (``FlatModel.dim``) do too; frozen parameters never leave
the module and are saved with it in model.pt.

The same function prepares the model on the server and on every node (``prepare_model``): nodes receive the
trainable parameters as model versions, so a node needs the file only when the model keeps something the versions
do not carry (frozen parameters or buffers).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .config import ConfigError

ALL, HEAD = "all", "head"
TRAINABLE_ALLOWED = "'all', 'head' (the last nn.Linear layer) or a comma-separated list of module or parameter names"


@dataclass(frozen=True)
class InitialModel:
    """What ``prepare_model`` did: the file loaded (``init_weights`` '' for none, its ``sha256`` hex digest or
    None), ``trainable`` (the config value) and the parameters it selects (``trainable_names``, in the model's
    order), their element count ``trainable_count`` and the model's total ``parameter_count``."""

    init_weights: str
    sha256: str | None
    trainable: str
    trainable_names: tuple[str, ...]
    trainable_count: int
    parameter_count: int

    def facts(self) -> dict:
        """The summary.json / model.json entries: init_weights ({path, sha256} or None), trainable,
        trainable_parameters and parameters."""
        loaded = {"path": self.init_weights, "sha256": self.sha256} if self.init_weights else None
        return {"init_weights": loaded, "trainable": self.trainable, "trainable_parameters": self.trainable_count,
                "parameters": self.parameter_count}


def file_sha256(path: str | Path) -> str:
    """SHA-256 hex digest of the bytes of ``path`` (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def trainable_names(module: nn.Module, trainable: str) -> tuple[str, ...]:
    """The names of ``module``'s parameters that config value ``trainable`` selects, in ``named_parameters`` order
    (module docstring). Raises ConfigError naming the key, the value and what is allowed for an empty item, a
    name that selects no parameter (listing the model's top-level modules), or 'head' on a model without an
    ``nn.Linear`` layer."""
    names = [n for n, _ in module.named_parameters()]
    value = trainable.strip()
    if value == ALL:
        return tuple(names)
    if value == HEAD:
        linear = [m for m in module.modules() if isinstance(m, nn.Linear)]
        if not linear:
            raise ConfigError(f"config key 'trainable': got 'head'; the model has no nn.Linear layer. Allowed: "
                              f"{TRAINABLE_ALLOWED}")
        chosen = {id(p) for p in linear[-1].parameters()}
        return tuple(n for n, p in module.named_parameters() if id(p) in chosen)
    items = [s.strip() for s in value.split(",")]
    if not value or any(not s for s in items):
        raise ConfigError(f"config key 'trainable': got {trainable!r}, which has an empty name; allowed: "
                          f"{TRAINABLE_ALLOWED}")
    for item in items:
        if not any(_selects(item, n) for n in names):
            tops = sorted({n.split(".")[0] for n in names})
            raise ConfigError(f"config key 'trainable': got {trainable!r}; {item!r} selects no parameter of the "
                              f"model. Allowed: {TRAINABLE_ALLOWED}; this model's modules: {', '.join(tops)} "
                              f"(parameters such as {names[0]!r})")
    return tuple(n for n in names if any(_selects(item, n) for item in items))


def _selects(item: str, name: str) -> bool:
    """Whether list item ``item`` (a module or parameter name; a trailing '.' allowed) selects parameter ``name``."""
    item = item.rstrip(".")
    return name == item or name.startswith(item + ".")


def load_state_file(path: str) -> dict[str, torch.Tensor]:
    """The state_dict (name -> tensor) saved at ``path`` by ``torch.save``, read with ``weights_only=True`` (no code
    from the file runs). Raises ConfigError naming key 'init-weights' and the path when the file is missing,
    unreadable or not a mapping of names to tensors."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config key 'init-weights': got {path!r}, which is not a file; allowed: a state_dict saved "
                          "with torch.save (a dpdro run's model.pt is one), of weights trained on public data")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load raises many kinds (pickle, zip, weights_only refusals)
        raise ConfigError(f"config key 'init-weights': {path!r} cannot be read as a state_dict with "
                          f"torch.load(weights_only=True) ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ConfigError(f"config key 'init-weights': {path!r} holds a {type(state).__name__}, not a state_dict "
                          "(a mapping of parameter names to tensors, as module.state_dict() gives)")
    return dict(state)


def check_state(module: nn.Module, state: dict[str, torch.Tensor], path: str) -> None:
    """Raise ConfigError naming the first tensor of ``state`` (from file ``path``) that does not fit ``module``'s
    state_dict: one the model has and the file lacks (in the model's order), one whose shape differs (expected
    and found), one the file has and the model lacks, or a floating-point tensor with a NaN or infinite entry."""
    own = module.state_dict()
    lead = f"config key 'init-weights': {path!r} does not fit the model"
    for name, tensor in own.items():
        if name not in state:
            missing = [n for n in own if n not in state]
            raise ConfigError(f"{lead}: tensor {name!r} is missing (the file lacks {len(missing)} of the model's "
                              f"{len(own)} tensors; it must hold every parameter and buffer of the model)")
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ConfigError(f"{lead}: tensor {name!r} has shape {tuple(state[name].shape)} in the file, expected "
                              f"{tuple(tensor.shape)}")
    extra = [n for n in state if n not in own]
    if extra:
        raise ConfigError(f"{lead}: tensor {extra[0]!r} is not in the model ({len(extra)} extra tensor(s); the "
                          "model's tensors are " + ", ".join(list(own)[:6]) + (", ..." if len(own) > 6 else "") + ")")
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ConfigError(f"{lead}: tensor {name!r} has a NaN or infinite entry")


def prepare_model(module: nn.Module, init_weights: str, trainable: str, *, load: bool = True) -> InitialModel:
    """Freeze the parameters of ``module`` that ``trainable`` does not select (``requires_grad_(False)``) and load
    the state_dict file ``init_weights`` ('' for none) into it: in place, before any training.

    ``load``: False on a node that needs the file only for what the model versions do not carry (see
    ``node_needs_file``): the file is then read only when the model has frozen parameters or buffers.
    Raises ConfigError (key, value, what is allowed) for a bad ``trainable`` or an unusable file, before the
    module is changed.
    """
    names = trainable_names(module, trainable)
    chosen = set(names)
    sha = None
    if init_weights and (load or node_needs_file(module, chosen)):
        state = load_state_file(init_weights)
        check_state(module, state, init_weights)
        sha = file_sha256(init_weights)
        with torch.no_grad():
            module.load_state_dict(state, strict=True)
    for name, p in module.named_parameters():
        p.requires_grad_(name in chosen)
    counts = {n: p.numel() for n, p in module.named_parameters()}
    return InitialModel(init_weights, sha, trainable, names, sum(counts[n] for n in names), sum(counts.values()))


def node_needs_file(module: nn.Module, chosen: set[str]) -> bool:
    """Whether a node must read the init-weights file itself: the model versions it receives carry the trainable
    parameters only, so it needs the file when ``module`` has a parameter outside ``chosen`` or a buffer."""
    return any(n not in chosen for n, _ in module.named_parameters()) or any(True for _ in module.buffers())
