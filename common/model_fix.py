"""Config key ``model-fix``: make a user's model usable for record-level DP before it is validated.

``groupnorm`` replaces every BatchNorm layer (BatchNorm1d/2d/3d, SyncBatchNorm and the lazy variants) with
``nn.GroupNorm(gcd(32, C), C, affine=...)``, the rule of Opacus' ``ModuleValidator.fix``
(``opacus/validators/batch_norm.py: _batchnorm_to_groupnorm``; 32 groups from Wu and He 2018, "Group
Normalization", or the largest divisor of C that divides 32). BatchNorm normalises with the statistics of the batch,
so one record's output depends on the others and per-record clipping bounds nothing (``models.validate_model``);
GroupNorm normalises each record on its own. The new layer starts from GroupNorm's own initialisation (weight 1,
bias 0: no random draw, so the run's seed gives the same parameters elsewhere), on the device and in the dtype of the
layer it replaces; BatchNorm's running statistics are dropped.

Two differences from Opacus, both to refuse less: every BatchNorm is replaced, also one without trainable
parameters (``affine=False`` or frozen), which Opacus' fix skips but which mixes records all the same; and Opacus
itself is not needed (a development dependency only). A fix is a pure function of the architecture: model.json
records it, so ``load_model`` rebuilds the same layers.
"""

from __future__ import annotations

import copy
import math

from torch import nn

# config key ``model-fix``: the allowed values (common/config.py repeats them without importing torch; a test checks)
MODEL_FIXES = ("none", "groupnorm")


def batchnorm_to_groupnorm(module: nn.modules.batchnorm._BatchNorm) -> nn.GroupNorm:
    """The GroupNorm that replaces ``module``: gcd(32, C) groups over its C = ``num_features`` channels, affine as
    ``module`` (Opacus' ``_batchnorm_to_groupnorm``), on the device and in the dtype of ``module``'s tensors.
    Input (B, C, *) as the BatchNorm's. Raises ValueError for a lazy BatchNorm whose channels are not known yet."""
    _refuse_lazy(module, type(module).__name__)
    channels = int(module.num_features)
    norm = nn.GroupNorm(math.gcd(32, channels), channels, affine=module.affine)
    tensor = next((t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()), None)
    return norm if tensor is None else norm.to(device=tensor.device, dtype=tensor.dtype)


def _refuse_lazy(module: nn.Module, name: str) -> None:
    if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
        raise ValueError(f"layer '{name}' is a {type(module).__name__} that has not been initialised (its channel "
                         "count is unknown until a first forward): use BatchNorm1d/2d/3d(C), or run one forward "
                         "before training")


def fix_model(model: nn.Module, fix: str) -> nn.Module:
    """``model`` made usable by config key ``model-fix`` = ``fix``: 'none' returns ``model`` itself; 'groupnorm'
    returns a copy (``model`` is left as it is) in which every BatchNorm layer, the root included, is replaced by
    ``batchnorm_to_groupnorm`` of it (a layer registered under several names by one GroupNorm); every other layer,
    parameter and buffer is copied unchanged, in the same order.
    Raises ValueError naming the key for an unknown ``fix`` (and for a lazy BatchNorm not yet initialised)."""
    if fix not in MODEL_FIXES:
        raise ValueError(f"config key 'model-fix': got {fix!r}; allowed: {', '.join(MODEL_FIXES)}")
    if fix == "none":
        return model
    if isinstance(model, nn.modules.batchnorm._BatchNorm):
        return batchnorm_to_groupnorm(model)
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            _refuse_lazy(module, name)  # before the copy, which cannot copy an uninitialised tensor
    model = copy.deepcopy(model)
    # collected first (the loop changes the tree), every name of a shared layer included: one GroupNorm per layer
    names = [name for name, m in model.named_modules(remove_duplicate=False)
             if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    replacements: dict[int, nn.GroupNorm] = {}
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        norm = parent._modules[child]
        if id(norm) not in replacements:
            replacements[id(norm)] = batchnorm_to_groupnorm(norm)
        parent._modules[child] = replacements[id(norm)]
    return model
