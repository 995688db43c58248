"""One configuration schema for every entry point (CLI, Flower run config, checkpoints).

Keys are kebab-case and identical everywhere (ARCHITECTURE.md section 7). Each key is declared once in
``FIELDS`` with its type, default, allowed values or range and help text; ``Config.from_mapping``
validates a whole mapping before any work starts and raises ``ConfigError`` naming the key, the value
and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import keyword
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .algorithm_specs import ALGORITHM_SPECS, algorithm_names, eta_algorithms
from .batches import over_n
from .errors import DpdroError
from .registry import AUTO, is_entry_point  # AUTO re-exported: config.AUTO is the public name

# What a key changes (Field.role): 'data' which records a node holds or evaluates (the client's shard-cache key);
# 'runtime' how a run executes, not what it computes (a resumed run may change it); 'privacy' the target, the
# accountant and where noise goes; 'algorithm' everything else that changes what a run computes.
ROLES = ("data", "runtime", "privacy", "algorithm")


# Config key ``model-fix``: common/model_fix.py's MODEL_FIXES, repeated so that validating a key imports no torch
# (tests/test_model_fix.py checks that both agree).
MODEL_FIXES = ("none", "groupnorm")

# Config key ``features``: common/scattering.py's FEATURES, repeated for the same reason (a test checks), and the
# built-in models that take its scattering features (config validation pairs them: ``_check_features``).
FEATURES = ("none", "scatternet")
SCATTER_MODELS = ("scatter-linear", "scatter-cnn")

# What every output of a run with noise_from_saved_seed says (log, summary.json, MODEL_CARD.md).
SEEDED_NOT_PRIVATE = "not private: noise derived from the saved seed"


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

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"config field '{self.key}': role {self.role!r}; allowed: one of {', '.join(ROLES)}")

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


def _dataset_names() -> tuple[str, ...]:
    from .data import DATASETS  # late: data.py imports this module (it imports torch only where tensors are built)

    return DATASETS.names()


# The models common/models.py registers when it is imported. Its classes need torch, which `dpdro keys`, `--help`
# and config errors must not import (seconds on a loaded machine): until that module is imported nothing else can
# have registered a model (a plug-in registers through it), so these are then all the names.
# tests/test_cli_startup.py checks this tuple against a fresh import of MODELS.
BUILTIN_MODELS = ("cnn", "cnn32", "resnet20", "cnn64", "mlp", "convnet", *SCATTER_MODELS)


def _model_names() -> tuple[str, ...]:
    registry = getattr(sys.modules.get(f"{__package__}.models"), "MODELS", None)
    return ("auto", *(registry.names() if registry is not None else BUILTIN_MODELS))


def __getattr__(name: str) -> tuple[str, ...]:
    """ALGORITHMS, ETA_ALGORITHMS, DATASETS: derived from the plug-in registries when read."""
    derived = {"ALGORITHMS": algorithm_names, "ETA_ALGORITHMS": eta_algorithms, "DATASETS": _dataset_names}
    if name in derived:
        return derived[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


PSIS = ("chi2", "kl", "cvar", "smoothed-cvar")
# The items of key chosen-on-private-data: choices made on a validation split of the private training records.
CHOSEN_ON_PRIVATE = ("hyper-parameters", "model", "posthoc-tau")

FIELDS: tuple[Field, ...] = (
    # what to run
    Field("algorithm", "str", "dp-double-spider", "Training algorithm.", choices=algorithm_names, role="algorithm"),
    Field("dataset", "str", "mnist-st", "Training/test data set ('-st': long-tailed, ALGORITHMS.md 6.2); 'csv' "
          "and 'image-folder' read your own files (docs: how-to/own-data); 'package.module:function' calls your "
          "function (split, data_root) -> (x, y[, groups]) or a Dataset; 'python-data' is recorded by "
          "dpdro.fit(data=...) (records from Python, no file).", choices=_dataset_names, role="data",
          entry_point=True),
    Field("data-root", "str", AUTO, "Built-in data sets: folder holding <Name>/raw/ in torchvision's layout (.gz or "
          "extracted); 'auto': $DPDRO_DATA_ROOT, else ../shared/datasets beside the project, else the cache. "
          "dataset=csv: a .csv file or a folder with train.csv [test.csv]; dataset=image-folder: a folder of "
          "class sub-folders, or with train/ [test/] holding them.", auto=True, role="data"),
    Field("cache-dir", "str", AUTO, "Writable folder for decompressed data. 'auto': $DPDRO_CACHE_DIR, "
          "else ~/.cache/dpdro.", auto=True, role="data"),
    Field("download", "bool", False, "Let torchvision download missing data into the cache (needs internet).",
          role="data"),
    Field("imbalance-ratio", "float", 0.02, "Fraction of each first-half class kept in '-st' sets.",
          low=0.0, high=1.0, low_open=True, role="data"),
    Field("split-seed", "int", 0, "Seed of the stratified train/validation/test split of the CelebA subset "
          "(kept apart from 'seed' so that the split stays fixed across training seeds).", low=0, high=2**63 - 1,
          role="data"),
    Field("max-train-records", "int", 0, "Keep at most this many training records, evenly spaced in file "
          "order after the '-st' construction (0: all). For tests and smoke runs.", low=0, role="data"),
    Field("max-test-records", "int", 0, "Evaluate on at most this many test records, evenly spaced (0: all).",
          low=0, role="data"),
    Field("validation-fraction", "float", 0.0, "Fraction of the training records held out as a validation split "
          "(stratified by class, seeded by split-seed; never trained on). 0: none. The CelebA subset has its own "
          "fixed 10% validation split, so this key must stay 0 there.", low=0.0, high=0.5, high_open=True, role="data"),
    Field("classes", "str", "", "User data (csv, image-folder, an entry point): comma-separated class names in "
          "label order ('' = from the training split: its sorted labels or class folders). Declare them when nodes "
          "hold different files, so that every node maps labels alike.", role="data"),
    Field("image-size", "int", 32, "dataset=image-folder: images are resized to this many pixels square "
          "(bilinear; 0: kept as they are, then all must have one size).", low=0, high=4096, role="data"),
    Field("image-channels", "int", 3, "dataset=image-folder: 1 (grey) or 3 (RGB); images are converted to it.",
          low=1, high=3, role="data"),
    Field("image-mean", "str", "", "dataset=image-folder: public per-channel means (comma-separated, on [0, 1]) "
          "for (x - mean) / std, e.g. ImageNet's; '' with image-std '': x / 255 * 2 - 1. Never statistics of the "
          "private images.", role="data"),
    Field("image-std", "str", "", "dataset=image-folder: public per-channel standard deviations (with "
          "image-mean).", role="data"),
    Field("csv-label", "str", "label", "dataset=csv: the label column.", role="data"),
    Field("csv-features", "str", "", "dataset=csv: comma-separated feature columns ('' = every column but the "
          "label and group columns); cells must be numbers.", role="data"),
    Field("csv-group", "str", "", "dataset=csv: a group column for worst-group accuracy ('' = none).", role="data"),
    Field("csv-bounds", "str", "", "dataset=csv: the public range of every feature, 'lo:hi' for all, "
          "'name=lo:hi,...' per column, or both ('0:1,age=0:120'); features are clipped to it and scaled to "
          "[-1, 1]. Declared, never computed from the records.", role="data"),
    Field("eval-split", "str", "test", "Split evaluated during and after training: 'test' (public) or "
          "'validation' (held-out training records, for tuning: their metrics are not privacy-accounted).",
          choices=("test", "validation"), role="data"),
    Field("num-clients", "int", 4, "Number of clients (Flower nodes) the training records are split over.",
          low=1, high=10_000, role="data"),
    Field("partition", "str", "iid", "How records are split over clients: 'iid' or 'dirichlet' (by label) from one "
          "data set; 'node-local': each Flower node trains on its own data, read from its node config "
          "(flower-supernode --node-config \"data-root='/site/data'\"), nothing partitioned centrally, the server "
          "learning only the shard sizes (deployment only: docs/how-to/OPERATOR.md).",
          choices=("iid", "dirichlet", "node-local"), role="data"),
    Field("dirichlet-alpha", "float", 0.5, "Concentration of the Dirichlet-by-label partition.",
          low=0.0, low_open=True, high=1e6, role="data"),
    Field("features", "str", "none", "Feature front-end, computed once per record on the node that holds it "
          "(cached in cache-dir): 'none' (the model reads the records) or 'scatternet' (wavelet scattering, "
          "kymatio Scattering2D(J=2) as Tramer and Boneh 2021: images (C, H, W) become (81 C, H/4, W/4) features; "
          "needs the 'features' extra and model scatter-linear or scatter-cnn). No privacy cost: a fixed "
          "function of each record.", choices=FEATURES, role="data"),
    Field("model", "str", "auto", "Model: 'cnn' (GroupNorm CNN, 1x28x28), 'cnn32' (small GroupNorm CNN, 3x32x32, "
          "CIFAR10-ST's CPU default), 'resnet20' (GroupNorm ResNet20, 3x32x32, the paper model for a GPU), 'cnn64' "
          "(GroupNorm CNN, 3x64x64), 'mlp' (tabular: any input, flattened), 'convnet' (GroupNorm "
          "CNN, any CxHxW), 'scatter-linear' and 'scatter-cnn' (GroupNorm + linear layer, GroupNorm + small CNN, "
          "on features=scatternet); 'auto' picks the data set's; 'package.module:factory' builds your nn.Module "
          "(factory(num_classes[, input_shape=...])).", choices=_model_names, role="algorithm", entry_point=True),
    Field("model-fix", "str", "none", "Make the model usable before it is checked: 'groupnorm' replaces every "
          "BatchNorm layer (which mixes the records of a batch, so is refused) with GroupNorm(gcd(32, C), C), as "
          "Opacus' ModuleValidator.fix; 'none' changes nothing.", choices=MODEL_FIXES, role="algorithm"),
    Field("init-weights", "str", "", "Path of a state_dict (torch.save; a dpdro run's model.pt is one) of weights "
          "trained on PUBLIC data, loaded into the model before training ('' = the seed's initialisation); every "
          "tensor must fit. No privacy cost: it must never come from the private records. Its sha256 goes into "
          "summary.json.", role="algorithm"),
    Field("trainable", "str", "all", "Parameters that train: 'all', 'head' (the model's last nn.Linear layer) or "
          "comma-separated module or parameter names (e.g. 'head.,features.6'); the others stay frozen at their "
          "initial (or init-weights) values. Gradients, clipping, noise and the ledger's dimension cover the "
          "trainable ones only.", role="algorithm"),
    # DRO problem
    Field("psi", "str", "chi2", "psi-divergence of the DRO penalty (ALGORITHMS.md 1.3).", choices=PSIS,
          role="algorithm"),
    Field("lambda", "float", 1.0, "Penalty weight lambda > 0 of the psi-divergence (public constant).",
          low=0.0, low_open=True, high=1e6, role="algorithm"),
    Field("cvar-alpha", "float", 0.1, "Level alpha of 'cvar' and 'smoothed-cvar'.",
          low=0.0, high=1.0, low_open=True, high_open=True, role="algorithm"),
    Field("eta-scale", "float", 1.0, "G in L(x, eta) = L^(x, G eta): rescales the dual variable "
          "(ALGORITHMS.md 1.1).", low=0.0, low_open=True, high=1e6, role="algorithm"),
    Field("eta-init", "float", 0.0, "Initial dual variable when eta-init-source='config' (public).",
          low=-1e6, high=1e6, role="algorithm"),
    Field("eta-init-source", "str", "config", "'config': eta starts at eta-init; 'private-mean-loss': at the mean "
          "loss min(l, B) of all records at the initial model divided by eta-scale, released once with Gaussian "
          "noise (multiplier eta-init-noise-multiplier, sensitivity B) and charged to the ledger (chi2's optimal "
          "eta when every DRO weight is positive).", choices=("config", "private-mean-loss"), role="algorithm"),
    Field("eta-init-noise-multiplier", "float", 10.0, "Noise multiplier of the private eta initialisation "
          "(std = multiplier * loss-bound on the loss sum over all n records).", low=0.0, low_open=True, high=1e6,
          role="privacy"),
    Field("dro-clip", "str", "product", "How DRO weights meet clipping (dp-double-spider): 'product' clips "
          "w grad l to C (weights of clipped records are erased); 'weight-after-clip' uses w~ clip_C(grad l) with "
          "w~ the weight of min(l, B), sensitivity C W for the public bound W = psi*'((B - G eta) / lambda) "
          "(ALGORITHMS.md 5.4).", choices=("product", "weight-after-clip"), role="algorithm"),
    Field("eta-clip-rule", "str", "fixed", "Clip of dp-double-spider's eta-refresh: 'fixed' clips G (1 - w) at "
          "clip-eta (biased where weights exceed 1 + clip-eta / G: fatal for kl); 'weight-bound' computes w from "
          "min(l, B) and clips at G max(1, W - 1), W = min(psi*'((B - G eta_t) / lambda), weight-cap) the public "
          "weight bound at the released eta_t, which no record exceeds: no clipping bias (ALGORITHMS.md 3.1).",
          choices=("fixed", "weight-bound"), role="algorithm"),
    Field("block-order", "str", "sequential", "Order of the dual (eta, or the group weights) and model blocks of "
          "dp-double-spider and group-level recursive-spider: 'sequential' (the paper's Algorithm 2: the x block is "
          "evaluated at the eta or weights released in the same iteration, two message rounds per iteration) or "
          "'simultaneous' (both blocks at the same point (x_t, eta_t), the x block with the weights of the previous "
          "iteration's release: one round per iteration, the same releases and sensitivities; ALGORITHMS.md 3.4). "
          "Record-level recursive-spider is simultaneous by construction (Algorithm 3) and ignores the key.",
          choices=("sequential", "simultaneous"), role="algorithm"),
    Field("dro-level", "str", "record", "Uncertainty set of dp-double-spider and recursive-spider: 'record' (the "
          "paper's: a psi-divergence ball over records) or 'group' (over the K classes: q near the class priors pi, "
          "group losses from SPIDER / STORM releases of the K-vector of class loss sums, record weights w_y public "
          "functions of them; ALGORITHMS.md 3.3, 4.3). 'group' releases the class histogram before training.",
          choices=("record", "group"), role="algorithm"),
    Field("dro-groups", "str", "class", "The groups of dro-level=group and of dp-sgda: 'class' (the K classes) or "
          "'attribute' (the data set's declared group attribute, e.g. CelebA's 4 groups 2 * Blond_Hair + Male; a data "
          "set without one is refused). With dro-level=group, 'attribute' releases a histogram of the groups before "
          "training (prior-noise-multiplier); dp-sgda estimates the group frequencies from its own releases.",
          choices=("class", "attribute"), role="algorithm"),
    Field("dro-reference", "str", "prior", "Reference distribution r of dro-level=group's psi-divergence "
          "D_psi(q || r): 'prior' (the group priors pi: the paper's centre, the empirical distribution, so q = pi is "
          "ERM) or 'uniform' (1/K: the balanced centre, as dp-sgda's KL(p || uniform); q = r weighs every group "
          "equally). A public choice: the record weights are w_k = r_k v_k / pi_k with v_k = q_k / r_k "
          "(ALGORITHMS.md 3.3, 4.3).", choices=("prior", "uniform"), role="algorithm"),
    Field("weight-cap", "float", math.inf, "Public cap W_cap > 1 of dp-double-spider's DRO weights: every weight is "
          "min(w, W_cap) in both blocks (the psi-divergence with likelihood ratios <= W_cap). With "
          "dro-clip='weight-after-clip' the x sensitivity is C min(W, W_cap); with eta-clip-rule='weight-bound' the "
          "eta clip is G max(1, min(W, W_cap) - 1) (ALGORITHMS.md 3.1). inf: no cap.", low=1.0, low_open=True,
          high=1e6, allow_inf=True, role="algorithm"),
    # class-prior correction for long-tailed data (Menon et al. 2021)
    Field("logit-adjust-tau", "float", AUTO, "tau of the logit-adjusted loss CE(f(x) + tau log pi, y) used by "
          "every per-record loss (0: plain cross-entropy). 'auto': 1 for dp-sgd-la, 0 otherwise.", low=0.0,
          high=100.0, auto=True, role="algorithm"),
    Field("posthoc-tau", "float", 0.0, "Post-hoc logit adjustment at prediction: argmax f(x) - tau log pi "
          "(0: argmax f(x)).", low=0.0, high=100.0, role="algorithm"),
    Field("class-prior", "str", "private", "Where pi comes from when a tau is > 0: 'private' = a class histogram "
          "of all records released once with Gaussian noise (prior-noise-multiplier) and charged to the ledger; "
          "'public' = class-prior-values, declared public by you (not accounted).", choices=("private", "public"),
          role="privacy"),
    Field("class-prior-values", "str", "", "Comma-separated class counts or frequencies (K non-negative numbers) "
          "for class-prior='public'.", role="privacy"),
    Field("prior-noise-multiplier", "float", 10.0, "Noise multiplier (std on each class count; sensitivity 1) "
          "of the private class histogram.", low=0.0, low_open=True, high=1e6, role="privacy"),
    # KL-DRO as a compositional problem (recursive-spider) and bounded losses
    Field("rho", "float", 0.5, "KL radius rho of the constrained KL-DRO (recursive-spider, ALGORITHMS.md 2.1).",
          low=0.0, high=1e3, role="algorithm"),
    Field("lambda-init", "float", 1.0, "Initial lambda of recursive-spider (public).", low=0.0, low_open=True,
          high=1e6, role="algorithm"),
    Field("lambda0", "float", 0.1, "Lower bound lambda0 > 0 of recursive-spider's lambda.", low=0.0,
          low_open=True, high=1e6, role="algorithm"),
    Field("lambda-max", "float", 10.0, "Upper bound of recursive-spider's lambda.", low=0.0, low_open=True,
          high=1e6, role="algorithm"),
    Field("loss-bound", "float", 4.0, "Public loss bound B: losses are clamped at B in the KL terms "
          "g~ = exp((min(l, B) - B) / lambda) and in dp-sgda's class losses (ALGORITHMS.md 2.4).",
          low=0.0, low_open=True, high=1e4, role="algorithm"),
    Field("u-scale", "float", 1.0, "c_u: the d_lambda block is multiplied by c_u before the joint clip of "
          "recursive-spider's v/u release (and divided after), so it is not swamped by the d-dim block.",
          low=0.0, low_open=True, high=1e6, role="algorithm"),
    Field("beta", "float", 0.5, "STORM weight beta in [0, 1] of recursive-spider's estimate s_t of g(w) (at "
          "dro-level=group: of its group-loss estimate; dp-double-spider at dro-level=group: the weight of the newest "
          "SPIDER estimate in the bias-corrected exponential average of the group losses; 0: their running mean).",
          low=0.0, high=1.0, role="algorithm"),
    Field("s-min", "float", 1e-3, "Floor s_min > 0 of s_t before log and division.", low=0.0, low_open=True,
          high=1.0, role="algorithm"),
    Field("s-batch", "int", 1024, "Expected Poisson batch size of recursive-spider's s release.", low=1,
          high=10**9, role="algorithm"),
    Field("clip-s", "float", 1.0, "Clipping norm of the per-record STORM term g~(w_t) - (1-beta) g~(w_{t-1}) "
          "(|term| <= 1, so 1 clips nothing).", low=0.0, low_open=True, high=1e6, role="algorithm"),
    Field("s-noise-ratio", "float", 2.0, "Noise multiplier of the s releases relative to the v/u releases.",
          low=0.0, low_open=True, high=1e3, role="privacy"),
    Field("s-clip-units", "str", "absolute", "recursive-spider's s release: 'absolute' (clip-s bounds the STORM term "
          "g~(w_t) - (1-beta) g~(w_{t-1}), noise std z clip-s / N) or 'relative' (the term is divided by the released "
          "s_{t-1} before the clip and the mean multiplied back, so clip-s bounds a relative change and the noise is a "
          "fixed fraction of s; ALGORITHMS.md 2.5).", choices=("absolute", "relative"), role="algorithm"),
    Field("loss-clamp", "str", "hard", "How recursive-spider's KL terms bound the loss at loss-bound B: 'hard' "
          "min(l, B) (records with l > B get zero gradient) or 'soft' B - softplus(B - l) (smooth, strictly "
          "increasing, < B: every record keeps a gradient; g~ stays in (0, 1], so sensitivities are unchanged; "
          "ALGORITHMS.md 2.4).", choices=("hard", "soft"), role="algorithm"),
    Field("lr-lambda", "float", 0.05, "Step size gamma_lambda of recursive-spider's lambda.", low=0.0,
          high=1e6, role="algorithm"),
    Field("lr-p", "float", 0.1, "Mirror-ascent step size of dp-sgda's class weights p.", low=0.0, high=1e6,
          role="algorithm"),
    Field("clip-stats", "float", 4.2, "Clipping norm of dp-sgda's per-record class statistics "
          "[e_y min(l, B); e_y] (norm <= sqrt(B^2 + 1)).", low=0.0, low_open=True, high=1e6, role="algorithm"),
    # optimisation
    Field("iterations", "int", 400, "Number of iterations T.", low=1, high=10_000_000, role="algorithm"),
    Field("warmup-iterations", "int", 0, "Linear warm-up of every step size (lr-x, lr-eta, lr-lambda, lr-p): "
          "iteration t < W uses (t + 1) / W of each (0: off). Post-processing of released values, no privacy cost "
          "(ALGORITHMS.md 5.5).",
          low=0, high=10_000_000, role="algorithm"),
    Field("q", "int", 5, "SPIDER phase length: a refresh every q iterations, differences in between.",
          low=1, high=10_000_000, role="algorithm"),
    Field("refresh-batch", "int", 1024, "Expected Poisson batch size of refresh releases (sampling rate = "
          "refresh-batch / n).", low=1, high=10**9, role="algorithm"),
    Field("diff-batch", "int", 512, "Expected Poisson batch size of difference releases.", low=1, high=10**9,
          role="algorithm"),
    Field("lr-x", "float", 1.0, "Step size gamma_x of the model.", low=0.0, low_open=True, high=1e6, role="algorithm"),
    Field("lr-eta", "float", 0.5, "Step size gamma_eta of the dual variable.", low=0.0, high=1e6, role="algorithm"),
    Field("clip-x", "float", 1.0, "Clipping norm C_x of per-record x-gradients (refresh).",
          low=0.0, low_open=True, high=1e6, role="algorithm"),
    Field("clip-eta", "float", 1.0, "Clipping norm C_eta of per-record eta-gradients (refresh).",
          low=0.0, low_open=True, high=1e6, role="algorithm"),
    Field("clip-diff", "float", 4.0, "C_diff: difference clip C_t = min(C_diff * Delta_t, C_max), Delta_t the "
          "distance between the two parameter points.", low=0.0, low_open=True, high=1e6, role="algorithm"),
    Field("clip-diff-max", "float", 0.15, "C_max, the largest difference clipping norm (0.15 with q = 5 and "
          "diff-batch = refresh-batch / 2 keeps a phase's difference noise near its refresh noise: "
          "server/diagnostics.py).",
          low=0.0, low_open=True, high=1e6, role="algorithm"),
    Field("eta-noise-ratio", "float", 2.0, "Noise multiplier of the eta releases relative to the x releases "
          "(calibration scales both to meet the target; noise-allocation='ratios').", low=0.0, low_open=True,
          high=1e3, role="privacy"),
    Field("noise-allocation", "str", "variance", "How the noise multipliers of an algorithm's mechanisms relate: "
          "'ratios' = eta-noise-ratio / s-noise-ratio; 'variance' = the rule of server/allocation.py minimising "
          "the weighted noise variance of the released estimates per unit of privacy (calibration then scales "
          "all of them to the target).", choices=("ratios", "variance"), role="privacy"),
    Field("rs-clip-units", "str", "absolute", "recursive-spider's v/u clip bounds: 'absolute' (clip-x, clip-diff "
          "on [grad_x g~ ; c_u d_lambda g~]) or 'relative' (the vector is scaled by lambda_t / s_{t-1} first, so the "
          "bounds are in the units of the update z = lambda v / s; ALGORITHMS.md 5.4).",
          choices=("absolute", "relative"), role="algorithm"),
    Field("clip-count-scale", "float", 0.1, "c: every private release carries one more coordinate "
          "c * clip * 1[record clipped], so its noisy value estimates the clipped fraction (the sensitivity becomes "
          "clip sqrt(1 + c^2): 0.5% more noise at 0.1). 0: not measured.", low=0.0, high=10.0, role="algorithm"),
    Field("output-iterate", "str", "last", "'last': the final iterate; 'random': a uniformly drawn iterate "
          "(public coin) as in the theory.", choices=("last", "random"), role="algorithm"),
    # privacy
    Field("epsilon", "float", 4.0, "Target epsilon of (epsilon, delta)-DP at record level; inf: not private "
          "(no clipping, no noise).", low=0.0, low_open=True, allow_inf=True, high=1e4, role="privacy"),
    Field("delta", "float", AUTO, "Target delta; 'auto': 1/(10 n) for n training records. A private run refuses "
          "delta >= 1/n before training and warns above 1/(10 n).", low=0.0,
          high=1.0, low_open=True, high_open=True, auto=True, role="privacy"),
    Field("accountant", "str", "pld", "dp-accounting accountant: 'pld' (privacy loss distributions: the tight one, "
          "about 5-10% less noise at the same target) or 'rdp' (Renyi DP: a looser bound, cheaper at huge epsilons).",
          choices=("pld", "rdp"), role="privacy"),
    Field("noise-mode", "str", "central", "Where the Gaussian noise is added: 'central' (the server adds it to the "
          "sum of clipped sums: a trusted server), 'distributed' (each client adds 1/m_min of the variance, m_min = "
          "min-clients with on-client-failure=drop, else num-clients; the server only sees the SecAgg+ sum on "
          "Flower), 'local' (each client adds the full noise: private even "
          "against the server). Docs: explanation/privacy.",
          choices=("central", "distributed", "local"), role="privacy"),
    Field("secagg-num-shares", "float", 1.0, "SecAgg+ (noise-mode=distributed on Flower): fraction of the nodes each "
          "node secret-shares its keys with (1: all).", low=0.0, high=1.0, low_open=True, role="privacy"),
    Field("secagg-threshold", "float", 0.5, "SecAgg+: fraction of a node's shares needed to reconstruct its masks "
          "(at least 2 shares): lower tolerates more dropouts, higher resists more colluding nodes.", low=0.0,
          high=1.0, low_open=True, role="privacy"),
    Field("chosen-on-private-data", "str", "", "What was chosen on a validation split of the private training "
          "records, comma-separated: 'hyper-parameters' (a search, e.g. dpdro tune), 'model' (the method or "
          "checkpoint kept for its validation metrics), 'posthoc-tau' (the post-hoc tau); not privacy-accounted, and "
          "the summary's not_accounted lists each. dpdro tune writes it into the files it produces; computes "
          "nothing.", role="privacy"),
    # reproducibility and outputs
    Field("seed", "int", 0, "Seed of initialisation, partition and (when reproducible) sampling and noise.",
          low=0, high=2**63 - 1, role="data"),
    Field("reproducible", "bool", False, "true: every random draw derives from seed (tests, equivalence); with a "
          "finite epsilon only together with reproducible-for-testing. false: each draw site's PCG64 generator is "
          "seeded from the OS CSPRNG and the seed is never saved.", role="privacy"),
    Field("reproducible-for-testing", "bool", False, "Testing only: true allows reproducible=true with a finite "
          "epsilon. Such a run is not private (its noise and samples derive from the seed that summary.json saves); "
          "the log, summary.json and MODEL_CARD.md say so.", role="privacy"),
    Field("eval-every", "int", 50, "Evaluate (and report epsilon spent) every this many iterations.",
          low=1, role="runtime"),
    Field("checkpoint-every", "int", 100, "Write a checkpoint every this many iterations, and always after the "
          "first (a run stopped early can be resumed) and the last (0: only those two).", low=0, role="runtime"),
    Field("resume", "bool", False, "Continue the run in out-dir from its checkpoint (its config must match).",
          role="runtime"),
    Field("overwrite", "bool", False, "Replace the run in a non-empty out-dir (CLI --overwrite); without it (or "
          "resume) a non-empty out-dir is refused before any work.", role="runtime"),
    Field("out-dir", "str", "runs/latest", "Run directory (relative paths resolve against the current "
          "directory of the process that trains).", role="runtime"),
    Field("device", "str", "cpu", "Torch device for computation.", choices=("cpu", "cuda"), role="algorithm"),
    Field("dtype", "str", "float32", "Torch dtype of model computations.", choices=("float32", "float64"),
          role="algorithm"),
    Field("chunk-size", "int", 256, "Records per vectorised per-record gradient chunk (bounds memory).",
          low=1, high=1_000_000, role="runtime"),
    Field("per-record-engine", "str", "torch.func", "Library computing per-record gradients: 'torch.func' (vmap), "
          "'opacus' (Opacus' grad-sample hooks; needs opacus installed) or 'ghost' (ghost clipping of a model "
          "whose trainable parameters are one linear layer's, e.g. scatter-linear or trainable=head: norms and "
          "sums without per-record gradient vectors); equal up to rounding, speed differs by model and device "
          "(dpdro bench).", choices=("torch.func", "opacus", "ghost"), role="runtime"),
    Field("threads", "int", 0, "Torch intra-op threads (0: torch's default).", low=0, high=1024, role="runtime"),
    Field("round-timeout", "float", 600.0,
          "Seconds the server waits for a round's replies: on Flower for all nodes, in-process for each client; "
          "a client that misses it counts as failed (on-client-failure).",
          low=0.0, low_open=True, high=1e6, role="runtime"),
    Field("on-client-failure", "str", "retry", "When a client fails or sends a malformed reply: 'fail' the run "
          "with its error; 'retry' the release (max-retries times, then fail); 'drop' the failed clients from "
          "this release (central noise keeps its full std; assumes failures do not depend on records).",
          choices=("fail", "retry", "drop"), role="runtime"),
    Field("max-retries", "int", 2, "Retries of a release after a client failure (on-client-failure=retry).",
          low=0, high=100, role="runtime"),
    Field("min-clients", "int", 1, "With on-client-failure=drop: fewest clients a release may use; fewer "
          "means retry, then fail. noise-mode=distributed calibrates each client's noise share for this many.",
          low=1, high=10_000, role="runtime"),
    Field("sampling", "str", "poisson", "How records are drawn: 'poisson' (what the privacy analysis needs) "
          "or 'fixed-size' (shuffled fixed-size batches; refused unless epsilon=inf).",
          choices=("poisson", "fixed-size"), role="privacy"),
    Field("inject-fault", "str", "", "Testing only: '<partition>:<iteration>:<kind>' makes that client fail at "
          "that iteration; kind raise, raise-once (first attempt only), nan (malformed reply) or hang; kind leak "
          "makes the server keep a copy of that client's first reply of every round from that iteration on.",
          role="runtime"),
)

FIELD_BY_KEY: dict[str, Field] = {f.key: f for f in FIELDS}


def unknown_keys_message(unknown: list[str]) -> str:
    """'unknown config key ...' with the nearest known key for each (difflib), instead of every key on one line."""
    parts = []
    for key in unknown:
        near = difflib.get_close_matches(key, FIELD_BY_KEY, n=1, cutoff=0.6)
        parts.append(f"'{key}'" + (f" (did you mean '{near[0]}'?)" if near else ""))
    return (f"unknown config key{'s' if len(unknown) > 1 else ''} {', '.join(parts)}; `dpdro keys` lists every key "
            "with its default and allowed values")


def keys_with_role(*roles: str) -> tuple[str, ...]:
    """The config keys whose ``Field.role`` is one of ``roles`` (in FIELDS order); ValueError for an unknown role."""
    unknown = [r for r in roles if r not in ROLES]
    if unknown:
        raise ValueError(f"unknown role(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(ROLES)}")
    return tuple(f.key for f in FIELDS if f.role in roles)


def _make_config_class() -> type:
    fields = [(f.attr, Any, dataclasses.field(default=f.default)) for f in FIELDS]
    return dataclasses.make_dataclass("_ConfigBase", fields, frozen=True)


_ConfigBase = _make_config_class()


class Config(_ConfigBase):  # type: ignore[misc, valid-type]
    """A validated, immutable configuration.

    Attribute names are the keys with '-' replaced by '_' (``lambda`` is ``lambda_``).
    """

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None = None, *, ignore_unknown: bool = False) -> Config:
        """Build from a mapping of kebab-case keys (missing keys take defaults).

        Raises ConfigError for an unknown key (unless ``ignore_unknown``), a bad type or a value out of range,
        and for combinations that cannot work (see ``_check_combinations``).
        """
        values = dict(values or {})
        unknown = sorted(k for k in values if k not in FIELD_BY_KEY)
        if unknown and not ignore_unknown:
            raise ConfigError(unknown_keys_message(unknown))
        parsed = {f.attr: f.parse(values.get(f.key, f.default)) for f in FIELDS}
        cfg = cls(**parsed)
        cfg._check_combinations()
        return cfg

    def with_updates(self, updates: Mapping[str, Any]) -> Config:
        """A new validated config with some keys changed."""
        merged = self.to_dict()
        merged.update(updates)
        return Config.from_mapping(merged)

    def to_dict(self) -> dict[str, Any]:
        """Kebab-case mapping of every key (JSON- and TOML-friendly; inf stays a float)."""
        return {f.key: getattr(self, f.attr) for f in FIELDS}

    @property
    def private(self) -> bool:
        """Whether the run clips and adds noise (finite epsilon). See ``noise_from_saved_seed`` for the one case
        where it does and is still not private."""
        return not math.isinf(self.epsilon)

    @property
    def noise_from_saved_seed(self) -> bool:
        """Whether a run with a finite epsilon draws its noise and samples from ``seed`` (reproducible=true, allowed
        only with reproducible-for-testing=true): summary.json saves the seed, so the run is not private."""
        return self.private and self.reproducible

    def _check_combinations(self) -> None:
        if self.noise_from_saved_seed and not self.reproducible_for_testing:
            raise ConfigError(f"config key 'reproducible': got true with epsilon={self.epsilon:g}; allowed with a "
                              "finite epsilon: false only (noise and Poisson samples would derive from 'seed', which "
                              "summary.json saves, so anyone with the run folder could recompute the noise and "
                              "subtract it); for a test or an equivalence check that needs it, set "
                              "reproducible-for-testing=true as well (the run is then reported as "
                              f"'{SEEDED_NOT_PRIVATE}'), or use epsilon=inf")
        if self.sampling != "poisson" and self.private:
            raise ConfigError(f"config key 'sampling': got {self.sampling!r}; allowed with a finite epsilon: "
                              "'poisson' only (fixed-size batches break the Poisson amplification the ledger "
                              "assumes); use epsilon=inf for a non-private run")
        if self.noise_mode != "central" and not self.private:
            raise ConfigError(f"config key 'noise-mode': got {self.noise_mode!r}; allowed with epsilon=inf: "
                              "'central' only (a non-private run adds no noise anywhere)")
        if self.noise_mode == "distributed" and self.num_clients < 2:
            raise ConfigError(f"config key 'noise-mode': got 'distributed'; allowed only with num-clients >= 2 "
                              f"(got {self.num_clients}): one client's share is the whole noise")
        if self.min_clients > self.num_clients:
            raise ConfigError(f"config key 'min-clients': got {self.min_clients}; allowed: at most num-clients "
                              f"({self.num_clients})")
        if self.inject_fault:
            parse_fault(self.inject_fault)
        if not self.lambda0 <= self.lambda_init <= self.lambda_max:
            raise ConfigError(f"config keys 'lambda0', 'lambda-init', 'lambda-max': got {self.lambda0}, "
                              f"{self.lambda_init}, {self.lambda_max}; allowed: lambda0 <= lambda-init <= lambda-max")
        if self.max_train_records:  # the batches the algorithm reads, all at once (defaults follow n later)
            problem = over_n(self.to_dict(), {k: f.default for k, f in FIELD_BY_KEY.items()},
                             self.max_train_records, f"max-train-records ({self.max_train_records})")
            if problem:
                raise ConfigError(problem)
        from .data import DATASETS  # late: data.py imports this module

        try:  # an import path is imported here: its error before any work
            spec = DATASETS.get_entry(self.dataset)
        except ValueError as e:
            raise ConfigError(f"config key 'dataset': {e}") from None
        if spec.check is not None:  # the data set's own keys (their syntax; the files are read later)
            values = self.to_dict()
            try:
                spec.check({k: values[k] for k in spec.keys})
            except ValueError as e:
                raise ConfigError(str(e)) from None
        self._check_features()
        if is_entry_point(self.model):
            from .models import MODELS  # late: torch

            try:
                MODELS.get_entry(self.model)
            except ValueError as e:
                raise ConfigError(f"config key 'model': {e}") from None
        if self.partition == "node-local" and not spec.num_classes and "classes" in spec.keys \
                and not self.classes.strip():
            raise ConfigError(f"config key 'classes': got ''; allowed with partition='node-local' and dataset="
                              f"{self.dataset}: the class names in label order (each site's files may hold other "
                              "classes, so they cannot come from one site's files)")
        own_validation = spec.own_validation
        if own_validation and self.validation_fraction > 0:
            raise ConfigError(f"config key 'validation-fraction': got {self.validation_fraction}; allowed for "
                              f"{self.dataset}: 0 only (the data set has its own fixed validation split)")
        if self.eval_split == "validation" and not own_validation and self.validation_fraction == 0:
            own = ", ".join(repr(n) for n, s in DATASETS.items() if s.own_validation)
            raise ConfigError("config key 'eval-split': got 'validation'; allowed only with validation-fraction > 0 "
                              f"(got {self.validation_fraction}) or a data set with its own validation split ({own})")
        if self.class_prior == "public" and self.uses_priors:
            self.public_prior()  # raises for a malformed list
        self.chosen_on_private  # noqa: B018  (raises for an unknown item)
        if ALGORITHM_SPECS[self.algorithm].logit_adjusted and self.tau == 0:
            raise ConfigError(f"config key 'logit-adjust-tau': got 0; allowed for {self.algorithm}: > 0 or 'auto' (it "
                              "trains on the logit-adjusted loss; use algorithm=dp-sgd for plain cross-entropy)")

    def _check_features(self) -> None:
        """features=scatternet needs a model made for its features (scatter-linear, scatter-cnn, or your own by
        import path), and those models need it."""
        if self.features == "scatternet" and not (self.model in SCATTER_MODELS or is_entry_point(self.model)):
            auto = " ('auto' picks the data set's model, which reads images)" if self.model == AUTO else ""
            raise ConfigError(f"config key 'model': got {self.model!r}{auto}; allowed with features='scatternet': "
                              f"{', '.join(map(repr, SCATTER_MODELS))} or an import path 'package.module:factory' "
                              "of a model for (81 C, H/4, W/4) features")
        if self.features == "none" and self.model in SCATTER_MODELS:
            raise ConfigError(f"config key 'features': got 'none' with model={self.model!r}; allowed with that "
                              "model: 'scatternet' (it reads scattering features, not images)")

    @property
    def tau(self) -> float:
        """The logit-adjustment tau in effect ('auto': 1 for an algorithm on the logit-adjusted loss such as
        dp-sgd-la, 0 otherwise)."""
        if self.logit_adjust_tau == AUTO:
            return 1.0 if ALGORITHM_SPECS[self.algorithm].logit_adjusted else 0.0
        return float(self.logit_adjust_tau)

    def clip(self, bound: float) -> float:
        """The clipping bound in effect: ``bound`` in a private run, inf (no clipping) when epsilon = inf. The one
        place that decides that a non-private run clips nothing."""
        return bound if self.private else math.inf

    @property
    def uses_priors(self) -> bool:
        """Whether the run needs class priors pi (a logit adjustment at training or at prediction)."""
        return self.tau > 0 or self.posthoc_tau > 0 or (self.group_level and self.dro_groups == "class")

    @property
    def attribute_groups(self) -> bool:
        """Whether the run's DRO groups are the declared group attribute: dro-groups=attribute for dp-sgda, or for a
        paper method at dro-level=group (the data set must declare one: ``engine.check_groups``)."""
        spec = ALGORITHM_SPECS[self.algorithm]
        reads = "dro-groups" in spec.keys and ("dro-level" not in spec.keys or self.group_level)
        return reads and self.dro_groups == "attribute"

    @property
    def uses_group_priors(self) -> bool:
        """Whether the run needs the priors of the declared group attribute (dro-level=group, dro-groups=attribute)."""
        return self.group_level and self.dro_groups == "attribute"

    @property
    def group_level(self) -> bool:
        """Whether the run is group-level DRO (dro-level=group of an algorithm that reads it): it needs priors."""
        return self.dro_level == "group" and "dro-level" in ALGORITHM_SPECS[self.algorithm].keys

    @property
    def private_eta_init(self) -> bool:
        """Whether eta starts from the private mean-loss release. Not at dro-level=group, where eta is solved exactly
        from the released group losses at every iteration (ALGORITHMS.md 3.3): the release would be unused budget."""
        return (self.eta_init_source == "private-mean-loss" and ALGORITHM_SPECS[self.algorithm].uses_eta
                and not self.group_level)

    @property
    def chosen_on_private(self) -> tuple[str, ...]:
        """The items of chosen-on-private-data (sorted, each once; () for ''). Raises ConfigError for an item not
        in CHOSEN_ON_PRIVATE."""
        items = {s.strip() for s in self.chosen_on_private_data.split(",")} - {""}
        unknown = sorted(items - set(CHOSEN_ON_PRIVATE))
        if unknown:
            raise ConfigError(f"config key 'chosen-on-private-data': got {self.chosen_on_private_data!r} (unknown "
                              f"{', '.join(map(repr, unknown))}); allowed: '' or comma-separated items of "
                              f"{', '.join(map(repr, CHOSEN_ON_PRIVATE))}")
        return tuple(sorted(items))

    def public_prior(self) -> list[float]:
        """class-prior-values as non-negative floats; raises ConfigError if empty, malformed or all zero."""
        text = self.class_prior_values.strip()
        try:
            values = [float(v) for v in text.split(",")] if text else []
        except ValueError:
            values = []
        if not values or any(not math.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
            raise ConfigError(f"config key 'class-prior-values': got {self.class_prior_values!r}; allowed with "
                              "class-prior='public': comma-separated non-negative numbers, one per class, not all 0")
        return values


def check_device(device: str) -> None:
    """Raise ConfigError unless torch can compute on ``device`` (config key device) on this machine.

    Not part of ``Config`` validation: a server may plan a run for sites that have a GPU it lacks; each
    process that computes on the device calls this before any work (``dpdro train``/``simulate``, every
    client's ``ShardWorker``)."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("config key 'device': got 'cuda', but torch.cuda.is_available() is False on this "
                              f"machine (no usable CUDA GPU or driver, or a CPU-only torch {torch.__version__}); "
                              "allowed here: 'cpu'")


FAULT_KINDS = ("raise", "raise-once", "nan", "hang", "leak")


def parse_fault(text: str) -> tuple[int, int, str]:
    """Parse 'inject-fault' = '<partition>:<iteration>:<kind>'; raises ConfigError naming the key."""
    parts = text.split(":")
    try:
        pid, it, kind = int(parts[0]), int(parts[1]), parts[2]
        if len(parts) != 3 or pid < 0 or it < 0 or kind not in FAULT_KINDS:
            raise ValueError
    except (ValueError, IndexError):
        raise ConfigError(f"config key 'inject-fault': got {text!r}; allowed: '' or '<partition>:<iteration>:<kind>' "
                          f"with kind in {', '.join(FAULT_KINDS)}") from None
    return pid, it, kind


def load_toml_keys(path: str | os.PathLike) -> dict[str, Any]:
    """The configuration keys of a TOML file: a plain table of keys, or a pyproject-style
    ``[tool.flwr.app.config]`` table. Raises ConfigError for a missing file or invalid TOML (not yet validated:
    pass the result to ``Config.from_mapping``)."""
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML ({e})") from None
    return data.get("tool", {}).get("flwr", {}).get("app", {}).get("config", data)


def parse_set_args(items: list[str]) -> dict[str, Any]:
    """Parse CLI ``key=value`` items (values are TOML-like: 1, 0.5, true, inf, 'text' or text).

    Raises ConfigError for an item without '='.
    """
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        raw = raw.strip()
        if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
            raw = raw[1:-1]
        out[key.strip()] = raw
    return out


def toml_value(v: Any) -> str:
    """A config value as TOML text: true/false, inf, a number's repr, or a string (basic "..." with JSON escapes,
    or literal '...' when it contains a double quote: Flower's --run-config parser cannot read an escaped one).
    The one TOML writer of the project (config files, pyproject.toml's table, Flower's --run-config).
    Raises ValueError for a string holding both quote characters."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        if '"' not in v:
            return json.dumps(v)
        if "'" in v or "\n" in v:
            raise ValueError(f"cannot write {v!r} as a TOML value that Flower reads: it holds both quote characters")
        return "'" + v + "'"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return repr(v)


def toml_lines(values: Mapping[str, Any]) -> str:
    """``key = value`` lines (no trailing newline) of a flat mapping, values by ``toml_value``."""
    return "\n".join(f"{k} = {toml_value(v)}" for k, v in values.items())


def default_toml_table() -> str:
    """The ``[tool.flwr.app.config]`` body for pyproject.toml, generated from FIELDS."""
    return toml_lines({f.key: f.default for f in FIELDS})
