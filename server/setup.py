"""Private statistics released once before training (docs/explanation/ALGORITHMS.md 5.3 item 7, 5.4), charged to the
run's ledger like every other release.

- 'class-histogram' (when a logit adjustment is configured with class-prior='private'): every record
  contributes its one-hot label e_y (norm 1, the null record 0, so the sensitivity is 1); the sum gets
  N(0, z_h^2 I_K) with z_h = prior-noise-multiplier. The priors are post-processing of the noisy counts:
  pi_k = max(c_k, 1) / sum_j max(c_j, 1), a valid distribution with no zero (log pi is finite).
- 'group-histogram' (dro-level=group with dro-groups=attribute or node): the same for the declared group attribute
  or for the nodes (g the record's node index, G = num-clients: the node sizes), e_g per record, N(0, z_h^2 I_G);
  the group priors follow by the same post-processing. A record belongs to one node, so the sensitivity stays 1; at
  privacy-unit=node a node's contribution is the mean of its records' e_g = its own e_g (norm 1, clipped to 1), and
  the priors come out near 1/m (every node weighs alike, as every node-level release does). So at privacy-unit=node
  with dro-groups=node or site the histogram is not released at all: what it would estimate is public, 1/m per
  node and (nodes of the site) / m per site (``public_group_priors``), where a noisy release (fixed multiplier 10,
  made by the sampled nodes only and scaled by 1 / node-sampling-rate) gave priors of pure noise (measured at 1,000
  nodes: counts of -10,000 to +25,000 around a true 3,000 a site).
- 'eta-init' (eta-init-source='private-mean-loss', algorithms with a dual variable): every record
  contributes min(l(x_0; xi), B) in [0, B] at the public initial model x_0 (with the logit offset when the
  loss is logit-adjusted); the sum gets N(0, (z_e B)^2), z_e = eta-init-noise-multiplier, and
  eta_0 = (noisy sum / n) / eta-scale. For chi2 this is the optimal eta whenever every DRO weight is positive.

- 'feature-moments' (feature-norm=private): every record contributes its per-channel means of x and x^2 (2C,),
  clipped to feature-norm-clip (the sensitivity); the sum gets N(0, (z_f C_f)^2 I_2C), z_f =
  feature-norm-noise-multiplier; the channel means and inverse standard deviations of the scattering models' input
  normalisation follow by post-processing (``common.feature_norm``).

All are unsampled (rate 1) Gaussian releases with fixed multipliers: calibration leaves them as they are
and scales the training mechanisms so that the whole run still lands on the target epsilon. They run in two
stages (the loss of eta-init needs the priors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ..common import feature_norm
from ..common.messages import Point, Query
from ..common.partition import site_of
from .ledger import Mechanism

HISTOGRAM = "class-histogram"
GROUP_HISTOGRAM = "group-histogram"
ETA_INIT = "eta-init"


@dataclass(frozen=True)
class SetupResult:
    """What the setup releases gave: ``priors`` (K,) pi (None if no adjustment is configured), where they came
    from ('private', 'public' or 'none'), ``eta0`` (None: the configured eta-init is used), ``group_priors``
    (G,) of the declared group attribute or of the nodes (None unless dro-groups=attribute or node), and
    ``counts`` (K,) and ``group_counts`` (G,): the released noisy class and group counts (sum of one-hot labels
    plus the Gaussian noise; exact without privacy), None when no histogram was released; ``feature_stats`` (2C,):
    the channel means and inverse standard deviations of feature-norm=private (None otherwise). Reporting them is
    post-processing of the release the ledger charged."""

    priors: tuple[float, ...] | None = None
    prior_source: str = "none"
    eta0: float | None = None
    group_priors: tuple[float, ...] | None = None
    counts: tuple[float, ...] | None = None
    group_counts: tuple[float, ...] | None = None
    feature_stats: tuple[float, ...] | None = None

    def dro_priors(self, cfg) -> tuple[float, ...] | None:
        """The priors of dro-level=group's groups: the group attribute's or the classes'."""
        return self.group_priors if cfg.uses_group_priors else self.priors

    def offset(self, tau: float) -> tuple[float, ...]:
        """tau log(pi) (K,), the logit offset of the adjusted loss; () for tau = 0 or no priors."""
        if tau == 0 or self.priors is None:
            return ()
        return tuple(float(tau * math.log(p)) for p in self.priors)

    def to_json(self) -> dict:
        """JSON-friendly form (for checkpoints)."""
        def listed(v):
            return list(v) if v is not None else None

        return {"priors": listed(self.priors), "prior_source": self.prior_source, "eta0": self.eta0,
                "group_priors": listed(self.group_priors), "counts": listed(self.counts),
                "group_counts": listed(self.group_counts), "feature_stats": listed(self.feature_stats)}

    @classmethod
    def from_json(cls, d: dict) -> SetupResult:
        """Inverse of ``to_json``."""
        def tupled(key):
            return tuple(d[key]) if d.get(key) is not None else None

        return cls(tupled("priors"), d.get("prior_source", "none"), d.get("eta0"), tupled("group_priors"),
                   tupled("counts"), tupled("group_counts"), tupled("feature_stats"))


def mechanisms(cfg) -> dict[Mechanism, int]:
    """The one-off releases this configuration needs (each released once)."""
    out = {}
    if cfg.uses_priors and cfg.class_prior == "private":  # also without privacy: stages() takes it (noise 0)
        out[Mechanism(HISTOGRAM, 1.0, fixed_noise=cfg.prior_noise_multiplier)] = 1
    if cfg.uses_group_priors and public_group_priors(cfg) is None:
        out[Mechanism(GROUP_HISTOGRAM, 1.0, fixed_noise=cfg.prior_noise_multiplier)] = 1
    if cfg.private_eta_init:
        out[Mechanism(ETA_INIT, 1.0, fixed_noise=cfg.eta_init_noise_multiplier)] = 1
    if cfg.feature_norm == "private":
        out[Mechanism(feature_norm.MOMENTS, 1.0, fixed_noise=cfg.feature_norm_noise_multiplier)] = 1
    return out


def stages(cfg, num_classes: int, num_groups: int = 0, channels: int = 0) -> list[list[Query]]:
    """The setup queries in order: [histograms, feature moments], then [eta-init]; each at model version 0 (x_0).
    Without privacy (epsilon=inf) the histograms and moments are still taken (exact, nothing to protect).
    ``num_groups``: G of the declared group attribute (used with dro-groups=attribute); ``channels``: C of the
    model's input normalisation (``feature_norm.channels``; used with feature-norm=private)."""
    out, histograms = [], []
    clip = cfg.clip(1.0)
    if cfg.uses_priors and cfg.class_prior == "private":
        histograms.append(Query(0, HISTOGRAM, "class-onehot", (Point(0, 0.0),), 1.0, clip, num_classes,
                                extra=(0.0,) * num_classes))
    if cfg.uses_group_priors and public_group_priors(cfg) is None:
        g = cfg.dro_group_count(num_classes, num_groups)  # the attribute's G, or num-clients (dro-groups=node)
        histograms.append(Query(0, GROUP_HISTOGRAM, "group-onehot", (Point(0, 0.0),), 1.0, clip, g,
                                extra=(0.0,) * g))
    if cfg.feature_norm == "private":  # before eta-init, whose loss reads the normalised features
        histograms.append(Query(0, feature_norm.MOMENTS, feature_norm.QUANTITY, (Point(0, 0.0),), 1.0,
                                cfg.clip(cfg.feature_norm_clip), 2 * channels))
    if histograms:
        out.append(histograms)
    if cfg.private_eta_init:
        clip = cfg.clip(cfg.loss_bound)
        out.append([Query(0, ETA_INIT, "bounded-loss", (Point(0, cfg.eta_init),), 1.0, clip, 1)])
    return out


def priors_from_counts(counts: np.ndarray) -> tuple[float, ...]:
    """pi from (noisy) class counts: max(c_k, 1) / sum_j max(c_j, 1) (post-processing; every pi_k > 0)."""
    c = np.maximum(np.asarray(counts, dtype=np.float64), 1.0)
    return tuple(float(v) for v in c / c.sum())


def public_group_priors(cfg) -> tuple[float, ...] | None:
    """The group priors that need no release: at privacy-unit=node every node's contribution weighs alike, so with
    dro-groups=node they are 1/m each and with dro-groups=site (nodes of the site) / m (``common.partition.site_of``,
    a public label): constants of the configuration, not of any record. None for every other configuration (the
    'group-histogram' release estimates them)."""
    if not (cfg.uses_group_priors and cfg.privacy_unit == "node" and cfg.dro_groups in ("node", "site")):
        return None
    m = cfg.num_clients
    if cfg.dro_groups == "node":
        return (1.0 / m,) * m
    sizes = np.bincount(site_of(np.arange(m), m, cfg.num_sites), minlength=cfg.num_sites)
    return tuple(float(c) / m for c in sizes)


def initial(cfg, num_classes: int) -> SetupResult:
    """The result before any release: public priors if declared, else none; the public group priors of
    ``public_group_priors``; eta0 not set."""
    public_groups = public_group_priors(cfg)
    if public_groups is not None:
        return replace(_initial_classes(cfg, num_classes), group_priors=public_groups)
    return _initial_classes(cfg, num_classes)


def _initial_classes(cfg, num_classes: int) -> SetupResult:
    if cfg.uses_priors and cfg.class_prior == "public":
        values = cfg.public_prior()
        if len(values) != num_classes:
            from ..common.config import ConfigError

            raise ConfigError(f"config key 'class-prior-values': got {len(values)} values; allowed: exactly "
                              f"{num_classes} (one per class of {cfg.dataset})")
        return SetupResult(priors_from_counts(np.asarray(values) / sum(values) * 1e12), "public")
    return SetupResult()


def absorb(result: SetupResult, released: dict[str, np.ndarray], n: int, cfg) -> SetupResult:
    """Fold one stage's released means (sums / n) into the result."""
    if HISTOGRAM in released:
        counts = np.asarray(released[HISTOGRAM], dtype=np.float64) * n
        result = replace(result, priors=priors_from_counts(counts), prior_source="private",
                         counts=tuple(float(c) for c in counts))
    if GROUP_HISTOGRAM in released:
        counts = np.asarray(released[GROUP_HISTOGRAM], dtype=np.float64) * n
        result = replace(result, group_priors=priors_from_counts(counts), group_counts=tuple(float(c) for c in counts))
    if feature_norm.MOMENTS in released:
        result = replace(result, feature_stats=feature_norm.stats_from_moments(released[feature_norm.MOMENTS]))
    if ETA_INIT in released:
        mean_loss = float(released[ETA_INIT][0])
        result = replace(result, eta0=mean_loss / cfg.eta_scale)
    return result


def release_all(releaser, cfg, x0: np.ndarray, n: int, num_classes: int, num_groups: int = 0,
                channels: int = 0) -> SetupResult:
    """Run every setup stage through ``releaser`` (server/releaser.py's Releaser: its ``offset``, ``feature_norm``
    and ``run``) at the initial parameters x0 (d,) float64, each stage with the prediction offset and feature
    statistics of the result so far, and fold the released means into one SetupResult (n: training records,
    public; channels: C of the model's input normalisation, ``feature_norm.channels``). Each stage is a charged
    release."""
    setup = initial(cfg, num_classes)
    for stage in stages(cfg, num_classes, num_groups, channels):
        releaser.offset = setup.offset(cfg.tau)
        releaser.feature_norm = setup.feature_stats or ()
        setup = absorb(setup, releaser.run(stage, {0: x0}, setup=True), n, cfg)
    return setup
