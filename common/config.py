"""One configuration schema for every entry point (CLI, Flower run config, checkpoints).

Keys are kebab-case and identical everywhere (docs/explanation/ARCHITECTURE.md section 7): TOML files, ``--set``,
Flower's run config, config.json. Each key is declared once, as a ``Field`` with its type, default, allowed values or
range, help text and section: the keys every run reads in ``CORE_FIELDS`` here, the keys only some algorithms read in
their ``AlgorithmSpec.params`` (common/algorithm_specs.py, or a plug-in's own file). ``FIELDS`` is all of them.

``Config.from_mapping`` validates a whole mapping before any work starts and raises one ``ConfigError`` naming every
invalid key, its value and what is allowed; a key set to a non-default value that the chosen algorithm does not read
is an ``IgnoredKeyWarning``. Inside, a Config has typed sections (``cfg.data``, ``cfg.training``, ``cfg.privacy``,
``cfg.runtime`` and the chosen algorithm's ``cfg.params``; frozen dataclasses with snake_case attributes) and keeps
flat attributes (``cfg.lr_x``) for code that reads keys of several sections.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any

from .algorithm_specs import ALGORITHM_SPECS, AlgorithmSpec, algorithm_names, algorithm_params, eta_algorithms
from .batches import over_n
from .config_schema import ROLES, SECTIONS, ConfigError, Field, section_class
from .registry import AUTO, is_entry_point  # AUTO re-exported: config.AUTO is the public name

__all__ = ["AUTO", "CORE_FIELDS", "ROLES", "SECTIONS", "Config", "ConfigError", "Field", "IgnoredKeyWarning",
           "NoisyPriorWarning",
           "check_device", "fields", "keys_with_role", "load_toml_keys", "parse_set_args", "toml_lines", "toml_value"]


class IgnoredKeyWarning(UserWarning):
    """A key set to a non-default value is not read by the chosen algorithm (e.g. q=3 with dp-sgd)."""


class NoisyPriorWarning(UserWarning):
    """At privacy-unit=node the class histogram (class-prior=private) is made by the sampled nodes only: its noise on
    each class share, prior-noise-multiplier / (p m), can exceed the shares themselves."""


# Config key ``model-fix``: common/model_fix.py's MODEL_FIXES, repeated so that validating a key imports no torch
# (tests/test_model_fix.py checks that both agree).
MODEL_FIXES = ("none", "groupnorm")

# Config key ``features``: common/scattering.py's FEATURES, repeated for the same reason (a test checks), and the
# built-in models that take its scattering features (config validation pairs them: ``_check_features``).
FEATURES = ("none", "scatternet")
SCATTER_MODELS = ("scatter-linear", "scatter-cnn")

# What every output of a run with noise_from_saved_seed says (log, summary.json, MODEL_CARD.md).
SEEDED_NOT_PRIVATE = "not private: noise derived from the saved seed"
# privacy-unit=node needs at least this many expected sampled nodes per release, node-sampling-rate x num-clients
# (server/node_sampling.py): the released mean over p m nodes of vectors of norm <= C carries noise std z C / (p m)
# per coordinate, above C / 10 at a noise multiplier of 1 with fewer nodes.
MIN_EXPECTED_NODES = 10


def _dataset_names() -> tuple[str, ...]:
    from .data import DATASETS  # late: data.py imports this module (it imports torch only where tensors are built)

    return DATASETS.names()


# The models common/models.py registers when it is imported. Its classes need torch, which `dpdro keys`, `--help`
# and config errors must not import (seconds on a loaded machine): until that module is imported nothing else can
# have registered a model (a plug-in registers through it), so these are then all the names.
# tests/test_cli_startup.py checks this tuple against a fresh import of MODELS.
BUILTIN_MODELS = ("cnn", "cnn32", "resnet20", "cnn64", "mlp", "convnet", *SCATTER_MODELS)


def _partition_names() -> tuple[str, ...]:
    from .partition import PARTITIONS  # late: numpy

    return PARTITIONS.names()


def _model_names() -> tuple[str, ...]:
    registry = getattr(sys.modules.get(f"{__package__}.models"), "MODELS", None)
    return ("auto", *(registry.names() if registry is not None else BUILTIN_MODELS))


def __getattr__(name: str) -> Any:
    """ALGORITHMS, ETA_ALGORITHMS, DATASETS, FIELDS, FIELD_BY_KEY: derived from the plug-in registries when read."""
    derived = {"ALGORITHMS": algorithm_names, "ETA_ALGORITHMS": eta_algorithms, "DATASETS": _dataset_names,
               "FIELDS": fields, "FIELD_BY_KEY": field_by_key}
    if name in derived:
        return derived[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


PSIS = ("chi2", "kl", "cvar", "smoothed-cvar")
# The items of key chosen-on-private-data: choices made on a validation split of the private training records.
CHOSEN_ON_PRIVATE = ("hyper-parameters", "model", "posthoc-tau", "posthoc-tau-noisy")
# config key checkpoint-select: the final iterate, or the best by noisy validation counts (checkpoint_selection.py)
CHECKPOINT_SELECT = ("last", "private-best")

CORE_FIELDS: tuple[Field, ...] = (
    # what to run
    Field("algorithm", "str", "dp-double-spider", "Training algorithm.", choices=algorithm_names, role="algorithm"),
    Field("dataset", "str", "mnist-st", "Training/test data set ('-st': long-tailed, "
          "docs/explanation/ALGORITHMS.md 6.2); 'csv' and 'image-folder' read your own files (docs: "
          "how-to/own-data); 'package.module:function' calls your function (split, data_root) -> (x, y[, groups]) or "
          "a Dataset; 'python-data' is recorded by dpdro.fit(data=...) (records from Python, no file).",
          choices=_dataset_names, role="data",
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
    Field("eval-data", "str", "auto", "Who evaluates: 'server' (the server's own records of eval-split, as "
          "before), 'nodes' (each node evaluates the broadcast model on its own held-out records of eval-split and "
          "returns per-class correct and total counts; the server releases their sum with Gaussian noise charged to "
          "the run's epsilon: eval-epsilon), or 'auto': 'nodes' with partition=node-local (deployment), else "
          "'server'. Docs: explanation/privacy.", choices=("auto", "server", "nodes"), role="data"),
    Field("checkpoint-select", "str", "last", "Which evaluated iterate the run returns: 'last' (the final one) or "
          "'private-best' (the one with the best noisy worst-class accuracy on the validation split of the private "
          "records: every evaluation, at the start, every eval-every iterations and at the end, is a node evaluation "
          "charged to the run's epsilon at eval-epsilon, and the choice is post-processing of its noisy counts; "
          "needs eval-split='validation', and eval-data 'auto' or 'nodes'). Docs: explanation/privacy.",
          choices=CHECKPOINT_SELECT, role="data"),
    Field("num-clients", "int", 4, "Number of clients (Flower nodes) the training records are split over.",
          low=1, high=10_000, role="data"),
    Field("partition", "str", "iid", "How records are split over clients: 'iid' or 'dirichlet' (by label) from one "
          "data set; 'node-local': each Flower node trains on its own data, read from its node config "
          "(flower-supernode --node-config \"data-root='/site/data'\"), nothing partitioned centrally, the server "
          "learning only the shard sizes (deployment only: docs/how-to/OPERATOR.md).",
          choices=_partition_names, role="data"),
    Field("dirichlet-alpha", "float", 0.5, "Concentration of the Dirichlet-by-label partition.",
          low=0.0, low_open=True, high=1e6, role="data"),
    Field("num-sites", "int", 0, "Number of sites (hospitals, regions) the nodes belong to, a public label: node j's "
          "site is floor(j * num-sites / num-clients), so nodes are numbered site by site (0: no sites). With "
          "partition='dirichlet' the label skew is drawn per site (Dirichlet over the sites) and each site's records "
          "are split at random over its nodes; dro-groups='site' makes the sites the DRO groups "
          "(docs/explanation/ALGORITHMS.md 3.3).", low=0, high=10_000, role="data"),
    Field("features", "str", "none", "Feature front-end, computed once per record on the node that holds it "
          "(cached in cache-dir): 'none' (the model reads the records) or 'scatternet' (wavelet scattering, "
          "kymatio Scattering2D(J=2) as Tramer and Boneh 2021: images (C, H, W) become (81 C, H/4, W/4) features; "
          "needs the 'features' extra and model scatter-linear or scatter-cnn). No privacy cost: a fixed "
          "function of each record.", choices=FEATURES, role="data"),
    Field("feature-norm", "str", "groupnorm", "Input normalisation of the scattering models (features=scatternet): "
          "'groupnorm' (each record by itself, GroupNorm(27, C): no privacy cost) or 'private' (per-channel mean and "
          "variance released once before training, charged: Tramer and Boneh's normalisation with DP statistics; "
          "docs/explanation/ALGORITHMS.md 5.3 item 8).", choices=("groupnorm", "private"), role="algorithm"),
    Field("feature-norm-clip", "float", 1.0, "feature-norm=private: each record's moment vector (the per-channel "
          "means of x and of x^2, 2C values) is clipped to this L2 norm, the release's sensitivity (on CIFAR10-ST's "
          "scattering features the norms' median is 0.96).", low=0.0, low_open=True, high=1e6, role="algorithm"),
    Field("feature-norm-noise-multiplier", "float", 8.0, "feature-norm=private: fixed noise multiplier of the "
          "moments' release (Tramer and Boneh's 8; calibration scales the training releases around it).",
          low=0.0, low_open=True, high=1e6, role="algorithm"),
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
    Field("psi", "str", "chi2", "psi-divergence of the DRO penalty (docs/explanation/ALGORITHMS.md 1.3).", choices=PSIS,
          role="algorithm"),
    Field("lambda", "float", 1.0, "Penalty weight lambda > 0 of the psi-divergence (public constant).",
          low=0.0, low_open=True, high=1e6, role="algorithm"),
    Field("cvar-alpha", "float", 0.1, "Level alpha of 'cvar' and 'smoothed-cvar'.",
          low=0.0, high=1.0, low_open=True, high_open=True, role="algorithm"),
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
    # optimisation
    Field("iterations", "int", 400, "Number of iterations T.", low=1, high=10_000_000, role="algorithm"),
    Field("warmup-iterations", "int", 0, "Linear warm-up of every step size (lr-x, lr-eta, lr-lambda, lr-p): "
          "iteration t < W uses (t + 1) / W of each (0: off). Post-processing of released values, no privacy cost "
          "(docs/explanation/ALGORITHMS.md 5.5).",
          low=0, high=10_000_000, role="algorithm"),
    Field("refresh-batch", "int", 1024, "Expected Poisson batch size of refresh releases (sampling rate = "
          "refresh-batch / n).", low=1, high=10**9, role="algorithm"),
    Field("lr-x", "float", 1.0, "Step size gamma_x of the model.", low=0.0, low_open=True, high=1e6, role="algorithm"),
    Field("momentum", "float", 0.0, "Heavy-ball momentum mu of the model's step: x_{t+1} = x_t + m_{t+1}, m_{t+1} = "
          "mu m_t + (the algorithm's own step). Post-processing of released values, no privacy cost "
          "(docs/explanation/ALGORITHMS.md 5.10; 0: off).", low=0.0, high=0.999, role="algorithm"),
    Field("ema-decay", "float", 0.0, "Exponential moving average of the model's iterates, the model every evaluation "
          "and the run return: a_t = b_t a_{t-1} + (1 - b_t) x_t with b_t = min(ema-decay, (t - 1) / t), the plain "
          "mean of the iterates so far until t = 1 / (1 - ema-decay) (De et al. 2022, section 3.1). Training steps "
          "from x_t, never from the average. Post-processing of released values, no privacy cost "
          "(docs/explanation/ALGORITHMS.md 5.11; 0: off).", low=0.0, high=0.9999, role="algorithm"),
    Field("local-epochs", "int", 0, "privacy-unit=node only: each sampled node runs this many epochs of local SGD "
          "on its shard from the broadcast model and sends its model update x_0 - x_K, clipped to clip-x as one "
          "vector, in place of its mean gradient (DP-FedAvg, McMahan et al. 2018; the same sensitivity and ledger; "
          "docs/explanation/ALGORITHMS.md 5.9). With lr-x 1 and momentum 0 the server step is FedAvg's. Needs q = 1 "
          "with the SPIDER methods (dp-double-spider; recursive-spider at dro-level=group). 0: off.",
          low=0, high=1000, role="algorithm"),
    Field("local-lr", "float", 0.05, "Step size of a node's local SGD (local-epochs > 0).", low=0.0, low_open=True,
          high=1e6, role="algorithm"),
    Field("local-batch", "int", 16, "Records per local SGD step of a node (local-epochs > 0; a node's last batch of an "
          "epoch may hold fewer).", low=1, high=10**9, role="algorithm"),
    Field("clip-x", "float", 1.0, "Clipping norm C_x of per-record x-gradients (refresh).",
          low=0.0, low_open=True, high=1e6, role="algorithm"),
    Field("noise-allocation", "str", "variance", "How the noise multipliers of an algorithm's mechanisms relate: "
          "'ratios' = eta-noise-ratio / s-noise-ratio; 'variance' = the rule of server/allocation.py minimising "
          "the weighted noise variance of the released estimates per unit of privacy (calibration then scales "
          "all of them to the target).", choices=("ratios", "variance"), role="privacy"),
    Field("clip-count-scale", "float", 0.1, "c: every private release carries one more coordinate "
          "c * clip * 1[record clipped], so its noisy value estimates the clipped fraction (the sensitivity becomes "
          "clip sqrt(1 + c^2): 0.5% more noise at 0.1). 0: not measured.", low=0.0, high=10.0, role="algorithm"),
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
          "against the server), 'distributed-discrete' (the distributed discrete Gaussian of Kairouz, Liu and Steinke "
          "2021: each client rounds its records to an integer grid and adds a discrete Gaussian share; the sum is "
          "taken modulo 2^ddg-bits and the ledger charges that mechanism's own epsilon). Docs: explanation/privacy.",
          choices=("central", "distributed", "local", "distributed-discrete"), role="privacy"),
    Field("ddg-bits", "int", AUTO, "noise-mode=distributed-discrete: bits per coordinate of the modular sum; 'auto': "
          "per release, the fewest for which it wraps around with probability at most ddg-wrap-probability. A set "
          "value below what a release needs is refused before any client is asked.", low=2, high=52, auto=True,
          role="privacy"),
    Field("ddg-wrap-probability", "float", 1e-9, "noise-mode=distributed-discrete: the most probability with which "
          "one release's modular sum may wrap around (a wrap costs accuracy, never privacy).", low=0.0, high=0.01,
          low_open=True, role="privacy"),
    Field("ddg-shortfall", "str", "refuse", "noise-mode=distributed-discrete, when fewer clients' shares than "
          "num-clients are in a sum (a node dropped out after the shares were fixed): 'refuse' stops the run with "
          "nothing released from that sum; 'charge' releases it and the ledger charges the smaller noise actually "
          "present.", choices=("refuse", "charge"), role="privacy"),
    Field("secagg-num-shares", "float", 1.0, "SecAgg+ (noise-mode=distributed on Flower): fraction of the nodes each "
          "node secret-shares its keys with (1: all).", low=0.0, high=1.0, low_open=True, role="privacy"),
    Field("secagg-threshold", "float", 0.5, "SecAgg+: fraction of a node's shares needed to reconstruct its masks "
          "(at least 2 shares): lower tolerates more dropouts, higher resists more colluding nodes.", low=0.0,
          high=1.0, low_open=True, role="privacy"),
    Field("chosen-on-private-data", "str", "", "What was chosen on a validation split of the private training "
          "records, comma-separated: 'hyper-parameters' (a search, e.g. dpdro tune), 'model' (the method or "
          "checkpoint kept for its validation metrics), 'posthoc-tau' (the post-hoc tau); not privacy-accounted, and "
          "the summary's not_accounted lists each; 'posthoc-tau-noisy' (the post-hoc tau chosen from noisy counts, "
          "dpdro lab tune --choose-posthoc-tau --selection-epsilon: private by itself, composed with the run's "
          "epsilon). dpdro tune writes it into the files it produces; computes nothing.", role="privacy"),
    Field("eval-epsilon", "float", 0.1, "eval-data=nodes: the epsilon (at the run's delta) of each node evaluation "
          "on its own; all of them are part of the run's epsilon, training gets the rest. Expected error of a class's "
          "accuracy: docs explanation/privacy.", low=0.0, low_open=True, high=100.0, role="privacy"),
    Field("eval-noise-multiplier", "float", 0.0, "eval-data=nodes: the noise multiplier of each node evaluation "
          "instead of eval-epsilon (0: from eval-epsilon); noise std = multiplier x sqrt(2).", low=0.0,
          role="privacy"),
    # reproducibility and outputs
    Field("seed", "int", 0, "Seed of initialisation, partition and (when reproducible) sampling and noise.",
          low=0, high=2**63 - 1, role="data"),
    Field("reproducible", "bool", False, "true: every random draw derives from seed (tests, equivalence); with a "
          "finite epsilon only together with reproducible-for-testing. false: each draw site's PCG64 generator is "
          "seeded from the OS CSPRNG and the seed is never saved.", role="privacy"),
    Field("reproducible-for-testing", "bool", False, "Testing only: true allows reproducible=true with a finite "
          "epsilon. Such a run is not private (its noise and samples derive from the seed that summary.json saves); "
          "the log, summary.json and MODEL_CARD.md say so.", role="privacy"),
    Field("secure-noise", "bool", False, "true: every Gaussian noise vector (server's and clients') is the sum of 4 "
          "draws built of OS CSPRNG bytes, as Opacus' secure_mode draws it, against floating-point attacks on the "
          "Gaussian mechanism (Mironov 2012); never reproducible, so not with reproducible=true. Costs step time "
          "(dpdro lab bench reports it). Docs: explanation/privacy.", role="privacy"),
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
    Field("tensorboard", "bool", False, "Also write every evaluation's metrics as TensorBoard scalars into "
          "<out-dir>/tensorboard (needs the 'tensorboard' extra; view with tensorboard --logdir <out-dir>).",
          role="runtime"),
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
    Field("node-sampling-rate", "float", 1.0, "Node sampling rate p: each release asks a Poisson sample of the "
          "nodes, each independently with probability p (a fresh sample per release; 1: every node). With "
          "privacy-unit=record a record is then included with probability p x its record rate; the ledger charges "
          "each release as the revealed mixture of its record-level event (ALGORITHMS.md 5.8). noise-mode=distributed "
          "needs 1.", low=0.0, low_open=True, high=1.0, role="privacy"),
    Field("privacy-unit", "str", "record", "The unit of privacy: 'record' (one record replaced with the null "
          "record) or 'node' (one node's whole data: each node's contribution, the mean of its clipped per-record "
          "vectors over its whole shard, is clipped to the clip norm as one vector; Poisson node sampling at "
          "node-sampling-rate over the nodes, delta 'auto' = 1/(10 num-clients); needs node-sampling-rate x "
          "num-clients >= 10; ALGORITHMS.md 5.9).", choices=("record", "node"), role="privacy"),
    Field("sampling", "str", "poisson", "How records are drawn: 'poisson' (what the privacy analysis needs) "
          "or 'fixed-size' (shuffled fixed-size batches; refused unless epsilon=inf).",
          choices=("poisson", "fixed-size"), role="privacy"),
)

_CORE_KEYS = frozenset(f.key for f in CORE_FIELDS)


def fields() -> tuple[Field, ...]:
    """Every configuration key, by section (``SECTIONS`` order: data, training, privacy, runtime, then the params
    algorithms declare); within a section in declaration order (``CORE_FIELDS``, then each algorithm's params).

    Read when needed, so that a plug-in algorithm declared later adds its keys. Raises ValueError when an algorithm
    declares a key of ``CORE_FIELDS``."""
    params = algorithm_params()
    clash = sorted(k for k in params if k in _CORE_KEYS)
    if clash:
        raise ValueError(f"algorithm params {', '.join(map(repr, clash))} are keys every run reads (common/config.py): "
                         "an algorithm may declare new keys only")
    return tuple(sorted(CORE_FIELDS + tuple(params.values()), key=lambda f: SECTIONS.index(f.section)))


def field_by_key() -> dict[str, Field]:
    """key -> Field of every configuration key (``fields``)."""
    return {f.key: f for f in fields()}


# Keys that configurations and run directories written by earlier versions may hold, with the value that meant
# "unset": such a key at that value is dropped when read (old config.json files and checkpoints load); any other
# value is refused with the reason. inject-fault is now the test hook common/faults.py (an environment variable).
RETIRED_KEYS: dict[str, tuple[Any, str]] = {
    "inject-fault": ("", "it is no longer a configuration key: tests inject faults with $DPDRO_INJECT_FAULT "
                         "(common/faults.py)"),
}


# The names other DP libraries give (Opacus, TensorFlow Privacy; kebab-cased) -> dpdro's keys, suggested first.
OTHER_LIBRARIES_NAMES: dict[str, str] = {
    "batch-size": "'refresh-batch' (and 'diff-batch' for a difference release)",
    "sample-rate": "'refresh-batch' (the expected batch; the sampling rate is batch / n)",
    "max-grad-norm": "'clip-x'", "l2-norm-clip": "'clip-x'",
    "noise-multiplier": "'epsilon' (the noise multiplier is calibrated from epsilon and delta)",
    "lr": "'lr-x'", "learning-rate": "'lr-x'", "epochs": "'iterations'", "target-epsilon": "'epsilon'",
    "target-delta": "'delta'",
}


def unknown_keys_message(unknown: list[str]) -> str:
    """'unknown config key ...' with the nearest known key for each: another DP library's name for it
    (OTHER_LIBRARIES_NAMES), else difflib's nearest; instead of every key on one line."""
    known = field_by_key()
    parts = []
    for key in unknown:
        alias = difflib.get_close_matches(key.lower().replace("_", "-"), OTHER_LIBRARIES_NAMES, n=1, cutoff=0.85)
        other = OTHER_LIBRARIES_NAMES[alias[0]] if alias else None
        near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f" (dpdro's name: {other})" if other else (f" (did you mean '{near[0]}'?)" if near else "")
        parts.append(f"'{key}'{hint}")
    return (f"unknown config key{'s' if len(unknown) > 1 else ''} {', '.join(parts)}; `dpdro keys` lists every key "
            "with its default and allowed values")


def keys_with_role(*roles: str) -> tuple[str, ...]:
    """The config keys whose ``Field.role`` is one of ``roles`` (in FIELDS order); ValueError for an unknown role."""
    unknown = [r for r in roles if r not in ROLES]
    if unknown:
        raise ValueError(f"unknown role(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(ROLES)}")
    return tuple(f.key for f in fields() if f.role in roles)


def _join(errors: list[str]) -> str:
    """One message of several errors (one per line after a count), or the one error itself."""
    if len(errors) == 1:
        return errors[0]
    return f"{len(errors)} configuration errors:\n" + "\n".join(f"  - {e}" for e in errors)


# The sections every Config has (typed frozen dataclasses, one attribute per key of CORE_FIELDS in that section).
DataConfig = section_class("DataConfig", [f for f in CORE_FIELDS if f.section == "data"])
TrainingConfig = section_class("TrainingConfig", [f for f in CORE_FIELDS if f.section == "training"])
PrivacyConfig = section_class("PrivacyConfig", [f for f in CORE_FIELDS if f.section == "privacy"])
RuntimeConfig = section_class("RuntimeConfig", [f for f in CORE_FIELDS if f.section == "runtime"])
_CORE_SECTIONS = {"data": DataConfig, "training": TrainingConfig, "privacy": PrivacyConfig, "runtime": RuntimeConfig}
_PARAMS_CLASSES: dict[tuple[str, int], type] = {}


def params_class(spec: AlgorithmSpec) -> type:
    """The typed dataclass of an algorithm's parameters: the keys in ``spec.keys`` that algorithms declare
    (section 'algorithm'), e.g. ``DpDoubleSpiderParams``. Cached per spec."""
    key = (spec.name, id(spec))
    if key not in _PARAMS_CLASSES:
        declared = algorithm_params()
        name = "".join(part.capitalize() for part in spec.name.replace("_", "-").split("-")) + "Params"
        _PARAMS_CLASSES[key] = section_class(name, [declared[k] for k in spec.keys if k in declared])
    return _PARAMS_CLASSES[key]


class Config:
    """A validated, immutable configuration (build it with ``from_mapping``).

    Sections (typed frozen dataclasses; attribute names are the keys with '-' replaced by '_', ``lambda`` is
    ``lambda_``): ``data``, ``training``, ``privacy``, ``runtime`` (the keys every run reads, by ``Field.section``)
    and ``params`` (the chosen algorithm's own keys, ``AlgorithmSpec.params``). Every key is also a flat attribute
    (``cfg.q``), also the keys of algorithms not chosen (their values travel with the run: config.json, Flower's run
    config).
    """

    __slots__ = ("_values", "_attrs", "data", "training", "privacy", "runtime", "params")

    def __init__(self, values: Mapping[str, Any], _validated: bool = False) -> None:
        if not _validated:
            raise TypeError("build a Config with Config.from_mapping(...)")
        known = fields()
        set_ = object.__setattr__
        set_(self, "_values", {f.key: values[f.key] for f in known})
        set_(self, "_attrs", {f.attr: values[f.key] for f in known})
        for name, cls in _CORE_SECTIONS.items():
            set_(self, name, cls(**{f.attr: values[f.key] for f in CORE_FIELDS if f.section == name}))
        spec = ALGORITHM_SPECS[values["algorithm"]]
        own = params_class(spec)
        set_(self, "params", own(**{a: self._attrs[a] for a in own.__dataclass_fields__}))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in Config.__slots__:  # not yet set (unpickling): no recursion
            raise AttributeError(name)
        try:
            return self._attrs[name]
        except KeyError:
            raise AttributeError(f"Config has no key {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Config is immutable: use with_updates({{{name.replace('_', '-')!r}: ...}})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self._values == other._values

    def __hash__(self) -> int:
        return hash(tuple(self._values.items()))

    def __repr__(self) -> str:
        return "Config(" + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"

    def __reduce__(self):
        return (_rebuild, (self._values,))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None = None, *, ignore_unknown: bool = False,
                     warn: bool = True) -> Config:
        """Build from a mapping of kebab-case keys (missing keys take defaults).

        Raises one ConfigError naming every invalid key: unknown ones (with the nearest known key; unless
        ``ignore_unknown``), bad types and values out of range, then every combination that cannot work (see
        ``_check_combinations``). With ``warn``, a key set to a non-default value that the chosen algorithm does
        not read is an ``IgnoredKeyWarning`` naming it.
        """
        values = dict(values or {})
        errors = []
        for key, (unset, why) in RETIRED_KEYS.items():
            if key in values and values.pop(key) != unset:
                errors.append(f"config key '{key}': {why}")
        known = field_by_key()
        unknown = sorted(k for k in values if k not in known)
        if unknown and not ignore_unknown:
            errors.append(unknown_keys_message(unknown))
        parsed = {}
        for f in known.values():
            try:
                parsed[f.key] = f.parse(values.get(f.key, f.default))
            except ConfigError as e:
                errors.append(str(e))
        if errors:
            raise ConfigError(_join(errors))
        cfg = cls(parsed, _validated=True)
        cfg._check_combinations()
        if warn:
            cfg._warn_ignored()
            cfg._warn_noisy_priors()
        return cfg

    def _warn_noisy_priors(self) -> None:
        """NoisyPriorWarning when a node-level run takes its class priors from a histogram whose noise std on each
        class share, z_h / (p m), is above 1 / (2 K) for K = 10 classes (0.05): the logit adjustment then follows
        noise. Public priors (class-prior=public) or more sampled nodes avoid it."""
        if not (self.privacy_unit == "node" and self.private and self.uses_priors and self.class_prior == "private"):
            return
        nodes = self.node_sampling_rate * self.num_clients
        std = self.prior_noise_multiplier / nodes
        if std > 0.05:
            warnings.warn(f"privacy-unit='node' with class-prior='private': the class histogram is released by the "
                          f"expected {nodes:.3g} sampled nodes, so its noise std on each class share is "
                          f"prior-noise-multiplier / (p m) = {std:.3g}, more than the shares can bear; use "
                          "class-prior='public' with class-prior-values, or more sampled nodes",
                          NoisyPriorWarning, stacklevel=3)

    def _warn_ignored(self) -> None:
        """IgnoredKeyWarning for each algorithm key at a non-default value that the chosen algorithm does not read."""
        spec = ALGORITHM_SPECS[self.algorithm]
        ignored = [f.key for f in algorithm_params().values()
                   if f.key not in spec.keys and self._values[f.key] != f.default]
        for key in ignored:
            warnings.warn(f"config key '{key}' = {self._values[key]!r} is ignored: algorithm {self.algorithm!r} does "
                          "not read it", IgnoredKeyWarning, stacklevel=3)

    def with_updates(self, updates: Mapping[str, Any]) -> Config:
        """A new validated config with some keys changed (no IgnoredKeyWarning: this config's were given)."""
        merged = self.to_dict()
        merged.update(updates)
        return Config.from_mapping(merged, warn=False)

    def to_dict(self) -> dict[str, Any]:
        """Kebab-case mapping of every key (JSON- and TOML-friendly; inf stays a float)."""
        return dict(self._values)

    def scaled(self, values: Mapping[str, Any]) -> Config:
        """A copy with some values changed by attribute name (``lr_x``), not validated again: for values derived
        within a run from valid ones (the warm-up's scaled step sizes, server/algorithms/base.py). KeyError for
        an unknown attribute."""
        by_attr = {f.attr: f.key for f in fields()}
        return Config({**self._values, **{by_attr[a]: v for a, v in values.items()}}, _validated=True)


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
        """Raise one ConfigError naming every combination of keys that cannot work (each check's first)."""
        errors = []
        for check in (self._check_privacy, self._check_batches, self._check_algorithm, self._check_node_groups,
                      self._check_data, self._check_features):
            try:
                check()
            except ConfigError as e:
                errors.append(str(e))
        if errors:
            raise ConfigError(_join(errors))

    def _check_privacy(self) -> None:
        if self.noise_from_saved_seed and not self.reproducible_for_testing:
            raise ConfigError(f"config key 'reproducible': got true with epsilon={self.epsilon:g}; allowed with a "
                              "finite epsilon: false only (noise and Poisson samples would derive from 'seed', which "
                              "summary.json saves, so anyone with the run folder could recompute the noise and "
                              "subtract it); for a test or an equivalence check that needs it, set "
                              "reproducible-for-testing=true as well (the run is then reported as "
                              f"'{SEEDED_NOT_PRIVATE}'), or use epsilon=inf")
        if self.secure_noise and self.reproducible:
            raise ConfigError("config key 'secure-noise': got true with reproducible=true; allowed with "
                              "reproducible=true: false only (secure noise is built of OS CSPRNG bytes and cannot be "
                              "recomputed from the seed)")
        if self.sampling != "poisson" and self.private:
            raise ConfigError(f"config key 'sampling': got {self.sampling!r}; allowed with a finite epsilon: "
                              "'poisson' only (fixed-size batches break the Poisson amplification the ledger "
                              "assumes); use epsilon=inf for a non-private run")
        if self.noise_mode != "central" and not self.private:
            raise ConfigError(f"config key 'noise-mode': got {self.noise_mode!r}; allowed with epsilon=inf: "
                              "'central' only (a non-private run adds no noise anywhere)")
        if self.noise_mode == "distributed-discrete":
            self._check_ddg()
        if self.noise_mode == "distributed" and self.num_clients < 2:
            raise ConfigError(f"config key 'noise-mode': got 'distributed'; allowed only with num-clients >= 2 "
                              f"(got {self.num_clients}): one client's share is the whole noise")
        if self.min_clients > self.num_clients:
            raise ConfigError(f"config key 'min-clients': got {self.min_clients}; allowed: at most num-clients "
                              f"({self.num_clients})")
        if self.node_sampling_rate < 1 and self.noise_mode == "distributed":
            raise ConfigError(f"config key 'node-sampling-rate': got {self.node_sampling_rate:g} with "
                              "noise-mode='distributed'; allowed there: 1 only (each node's noise share is calibrated "
                              "for a fixed number of shares, and a node sample may hold fewer); use noise-mode=central "
                              "or local")
        if self.privacy_unit == "node" and self.private:
            from .partition import is_node_local  # late: numpy

            # common.eval_counts.evaluates_on_nodes (which imports torch)
            if self.eval_data == "nodes" or (self.eval_data == "auto" and is_node_local(self.partition)):
                raise ConfigError("config key 'privacy-unit': got 'node' with evaluation on the nodes (eval-data "
                                  f"{self.eval_data!r}); allowed there: 'record' only (a node's evaluation counts are "
                                  "bounded per record, not per node); use eval-data=server or privacy-unit=record")
        if self.local_epochs > 0 and self.privacy_unit != "node":
            raise ConfigError(f"config key 'local-epochs': got {self.local_epochs} with privacy-unit="
                              f"{self.privacy_unit!r}; allowed there: 0 only (a node's update after local steps is "
                              "bounded as one vector, not per record); use privacy-unit=node or local-epochs=0")
        q = getattr(self.params, "q", 1)
        if self.local_epochs > 0 and q != 1:  # a SPIDER difference is in gradient units, a local update is not
            raise ConfigError(f"config key 'local-epochs': got {self.local_epochs} with q = {q}; allowed there: q = 1 "
                              "only (a refresh every iteration: the SPIDER differences estimate gradients, which a "
                              "node's local update is not, so the two cannot be summed)")
        expected = self.node_sampling_rate * self.num_clients
        if self.privacy_unit == "node" and expected < MIN_EXPECTED_NODES:
            raise ConfigError(
                f"config key 'privacy-unit': got 'node' with node-sampling-rate {self.node_sampling_rate:g} and "
                f"num-clients {self.num_clients}: {expected:.3g} expected sampled nodes per release; allowed: at least "
                f"{MIN_EXPECTED_NODES} (the released mean over p m nodes of vectors of norm <= C carries noise std "
                "z C / (p m) per coordinate: at z = 1 and fewer nodes, above C / 10); use more nodes (num-clients), a "
                "higher node-sampling-rate, or privacy-unit=record")

    def _check_ddg(self) -> None:
        """noise-mode=distributed-discrete: what the mode does not support (yet), refused with the key named."""
        from .partition import is_node_local  # late: numpy

        on_nodes = self.eval_data == "nodes" or (self.eval_data == "auto" and is_node_local(self.partition))
        bad = [("num-clients", self.num_clients, "at least 2 (one client's share is the whole noise)",
                self.num_clients < 2),
               ("node-sampling-rate", self.node_sampling_rate, "1 only (each share is calibrated for num-clients "
                "shares)", self.node_sampling_rate < 1),
               ("privacy-unit", self.privacy_unit, "'record' only", self.privacy_unit != "record"),
               ("eval-data", self.eval_data, "'server' or 'auto' on a partition whose test records stay on the "
                "server (node evaluation counts are not encoded as DDG shares yet)", on_nodes)]
        for key, got, allowed, wrong in bad:
            if wrong:
                raise ConfigError(f"config key {key!r}: got {got!r} with noise-mode='distributed-discrete'; "
                                  f"allowed there: {allowed}")

    def _check_batches(self) -> None:
        if self.max_train_records:  # the batches the algorithm reads, all at once (defaults follow n later)
            problem = over_n(self.to_dict(), {k: f.default for k, f in field_by_key().items()},
                             self.max_train_records, f"max-train-records ({self.max_train_records})")
            if problem:
                raise ConfigError(problem)

    def _check_algorithm(self) -> None:
        """The chosen algorithm's own check of its params (``AlgorithmSpec.check``) and the logit adjustment."""
        spec = ALGORITHM_SPECS[self.algorithm]
        if spec.check is not None:
            try:
                spec.check({f.key: self._values[f.key] for f in algorithm_params().values() if f.key in spec.keys})
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.ema_decay > 0 and "output-iterate" in spec.keys and self._values["output-iterate"] == "random":
            raise ConfigError(f"config key 'ema-decay': got {self.ema_decay:g} with output-iterate='random'; allowed "
                              "with output-iterate='last' (the run returns either the average or a random iterate)")
        if spec.logit_adjusted and self.tau == 0:
            raise ConfigError(f"config key 'logit-adjust-tau': got 0; allowed for {self.algorithm}: > 0 or 'auto' (it "
                              "trains on the logit-adjusted loss; use algorithm=dp-sgd for plain cross-entropy)")

    def _check_node_groups(self) -> None:
        """dro-groups=node or site needs an algorithm that reads dro-groups at its group level and at least two
        nodes (sites); num-sites, when set, at least 2 and at most num-clients (every site holds a node)."""
        if self.num_sites != 0 and not 2 <= self.num_sites <= self.num_clients:
            raise ConfigError(f"config key 'num-sites': got {self.num_sites}; allowed: 0 (no sites) or 2 .. "
                              f"num-clients = {self.num_clients} (every site holds at least one node)")
        if self.dro_groups not in ("node", "site"):
            return
        got = f"config key 'dro-groups': got {self.dro_groups!r}"
        spec = ALGORITHM_SPECS[self.algorithm]
        if "dro-groups" not in spec.keys:
            readers = ", ".join(n for n, s in ALGORITHM_SPECS.items() if "dro-groups" in s.keys)
            raise ConfigError(f"{got} with algorithm {self.algorithm!r}, which has no group level; allowed with "
                              f"algorithms {readers} (at dro-level=group for the paper methods)")
        if "dro-level" in spec.keys and not self.group_level:
            raise ConfigError(f"{got} with dro-level={self.dro_level!r}; allowed only with dro-level='group' (the "
                              "record level's uncertainty set is over records, not groups)")
        if self.dro_groups == "node" and self.num_clients < 2:
            raise ConfigError(f"{got} with num-clients {self.num_clients}; allowed: num-clients >= 2 (with one node "
                              "the only group is the whole population, which is ERM)")
        if self.dro_groups == "site" and self.num_sites < 2:
            raise ConfigError(f"{got} with num-sites {self.num_sites}; allowed: num-sites >= 2 (the sites are the "
                              "groups: set num-sites to their number)")

    def _check_data(self) -> None:
        from .data import DATASETS  # late: data.py imports this module
        from .partition import is_node_local

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
        if is_entry_point(self.model):
            from .models import MODELS  # late: torch

            try:
                MODELS.get_entry(self.model)
            except ValueError as e:
                raise ConfigError(f"config key 'model': {e}") from None
        if not spec.num_classes and "classes" in spec.keys and not self.classes.strip() \
                and is_node_local(self.partition):
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
        if self.checkpoint_select == "private-best":
            self._check_private_best()
        if self.class_prior == "public" and self.uses_priors:
            self.public_prior()  # raises for a malformed list
        self.chosen_on_private  # noqa: B018  (raises for an unknown item)

    def _check_private_best(self) -> None:
        """checkpoint-select=private-best selects on charged noisy counts of a validation split of the private
        records (server/checkpoint_selection.py): the evaluations must be node evaluations (eval-data 'auto' or
        'nodes') of eval-split 'validation'."""
        if self.eval_data == "server":
            raise ConfigError("config key 'checkpoint-select': got 'private-best' with eval-data='server'; allowed "
                              "with eval-data 'auto' or 'nodes' only (the selection reads the evaluations' noisy "
                              "counts, charged to the run's epsilon; the server's evaluation is exact and not "
                              "charged)")
        if self.eval_split != "validation":
            raise ConfigError(f"config key 'checkpoint-select': got 'private-best' with eval-split="
                              f"{self.eval_split!r}; allowed with eval-split='validation' only (and validation-"
                              "fraction > 0, or a data set with its own validation split): the checkpoint is "
                              "chosen on held-out private records, never on the test split whose figures it "
                              "would bias")

    def _check_features(self) -> None:
        """features=scatternet needs a model made for its features (scatter-linear, scatter-cnn, or your own by
        import path), and those models need it."""
        if self.features == "scatternet" and not (self.model in SCATTER_MODELS or is_entry_point(self.model)):
            auto = " ('auto' picks the data set's model, which reads images)" if self.model == AUTO else ""
            raise ConfigError(f"config key 'model': got {self.model!r}{auto}; allowed with features='scatternet': "
                              f"{', '.join(map(repr, SCATTER_MODELS))} or an import path 'package.module:factory' "
                              "of a model for (81 C, H/4, W/4) features")
        if self.feature_norm == "private" and self.features != "scatternet":
            raise ConfigError(f"config key 'feature-norm': got 'private' with features={self.features!r}; allowed "
                              "there: 'groupnorm' only (the private statistics normalise scattering features: set "
                              "features=scatternet with scatter-linear or scatter-cnn)")
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
        """Whether the run needs the priors of groups other than the classes: dro-level=group with
        dro-groups=attribute (the declared group attribute), node (the nodes) or site (the nodes' sites)."""
        return self.group_level and self.dro_groups in ("attribute", "node", "site")

    @property
    def node_groups(self) -> bool:
        """Whether the run's DRO groups are made of nodes (dro-groups=node or site of an algorithm that reads it at
        its group level): each record's group is its node's index in [0, num-clients) or its node's site."""
        spec = ALGORITHM_SPECS[self.algorithm]
        reads = "dro-groups" in spec.keys and ("dro-level" not in spec.keys or self.group_level)
        return reads and self.dro_groups in ("node", "site")

    def dro_group_count(self, num_classes: int, num_groups: int) -> int:
        """The number of DRO groups: num-clients (dro-groups=node), num-sites (dro-groups=site), ``num_groups`` (the
        data set's declared group attribute, dro-groups=attribute) or ``num_classes``."""
        return {"node": self.num_clients, "site": self.num_sites, "attribute": num_groups}.get(self.dro_groups,
                                                                                              num_classes)

    @property
    def group_level(self) -> bool:
        """Whether the run is group-level DRO (dro-level=group of an algorithm that reads it): it needs priors."""
        return self.dro_level == "group" and "dro-level" in ALGORITHM_SPECS[self.algorithm].keys

    @property
    def private_eta_init(self) -> bool:
        """Whether eta starts from the private mean-loss release. Not at dro-level=group, where eta is solved exactly
        from the released group losses at every iteration (docs/explanation/ALGORITHMS.md 3.3): the release would be
        unused budget."""
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


def _rebuild(values: dict[str, Any]) -> Config:
    """A pickled Config (``Config.__reduce__``): its values were validated when it was built."""
    return Config(values, _validated=True)


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
    return toml_lines({f.key: f.default for f in fields()})
