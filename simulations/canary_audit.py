"""White-box canary audit of every release mechanism: an empirical epsilon lower bound per release.

    dpdro lab audit --mode canary [--algorithms ...] [--trials 100000] [--max-releases 20000] [--noise-modes ...]

Threat model: the strongest adversary of the literature for one Gaussian release, the white-box "Dirac
canary" of Nasr et al. 2021 ("Adversary instantiation", sec. 4) and 2023 ("Tight auditing of differentially
private machine learning"): the auditor chooses every record's per-record vector and the public state at which
the release is made. Per audited release:

- the training set holds ``n`` slots; slot i < k (k = min(D, n), D the release's length) is a canary whose
  per-record vector is a huge multiple of e_i (a fixed direction, coordinate i), so the product's own clip
  brings it exactly to the clip bound C of that mechanism, in that mechanism's quantity (x-gradient, gradient
  difference at the two points, eta-gradient, STORM term, class count, bounded loss); every other slot's
  vector is 0. An independent fair coin per canary and release decides presence (its vector) or absence (0,
  which releases exactly what a data set without the record releases, so n stays fixed);
- the release runs through the product's path: the algorithm's own ``Query`` (mechanism, sampling rate, clip,
  points, coefficients) from a public state, ``Releaser.run`` over a ``LocalTransport`` of real
  ``ShardWorker``s (Poisson sampling, per-record clip with the clipped-count coordinate, client noise shares in
  distributed mode, server noise, normalisation) and a ``Ledger`` holding the calibrated plan of the audited
  configuration. Only the function that computes the rows is the registered test quantity ``audit-canary``
  (``canary_rows``); the points the clients receive are tokens whose first coordinate is version + 1, so that
  the row differs between the two points of a difference (M (t + 1) - M t = M) and the clip is always reached;
- test statistic of canary i: coordinate i of the released sum, in units of the claimed noise std z S. The
  canaries sit on orthogonal coordinates of isotropic noise and are sampled independently (Poisson), so their
  statistics are independent trials: one release of a D-long mechanism gives k trials.

Lower bound: an (epsilon, delta)-DP release satisfies TPR <= e^epsilon FPR + delta for every test (Kairouz et
al. 2015), so epsilon >= log((TPR - delta) / FPR). Each threshold of a fixed grid (in units of the claimed
noise std, ``THRESHOLDS``) gives Clopper-Pearson bounds (TPR from below, FPR from above, each at level
alpha / (2 G), G thresholds: Bonferroni over the grid and the two rates), as in Jagielski et al. 2020 and
Nasr et al. 2021; the largest bound over the grid holds with confidence 1 - alpha. The point estimate and its
interval are those of the threshold that gave the bound.

Claimed epsilon: per release, epsilon(delta) of the one Poisson-subsampled Gaussian event (rate, z) that the
ledger charges for this release (dp-accounting, the run's accountant), at the audited configuration's delta.
The configurations are short runs (few iterations), so that each release spends an epsilon of order 1-8,
where a finite number of trials can come near it; the runs' own composed epsilon is the target the ledger was
calibrated to (reported beside).

Negative controls (``BREAKS``): the same audit of a deliberately broken mechanism that the ledger is not told
about: 'noise-half' (the releaser and the clients add half the calibrated noise) and 'clip-double' (the clients
clip at twice the query's clip while the noise is that of the declared clip). Their lower bound must exceed
the claim: that is what shows the audit has power.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from scipy import stats

from ..common.config import Config
from ..common.data import ArrayDataset
from ..common.messages import Query
from ..common.quantities import register_quantity
from ..common.rng import secret_rng

CANARY_QUANTITY = "audit-canary"
# The canary's raw magnitude: far above any clip of an audited mechanism, so the product's clip sets its norm.
CANARY_MAGNITUDE = 1e6
# Thresholds of the distinguishing test, in units of the claimed noise std of the released sum.
THRESHOLDS = tuple(float(t) for t in np.arange(0.0, 7.01, 0.25))
BREAKS = ("noise-half", "clip-double")
ALPHA = 0.05  # the lower bound holds with confidence 1 - ALPHA


@register_quantity(CANARY_QUANTITY)
def canary_rows(model, flat, scalar, x, y, problem, extra=()) -> torch.Tensor:
    """Audit-only per-record quantity: rows (B, D), D = int(extra[0]). A record (B, ...) carries its slot i in its
    first feature and its presence flag in the second (``canary_dataset``); a present slot i < D gets
    CANARY_MAGNITUDE * flat[0] * e_i, every other row is 0. The points are tokens (``_tokens``) with
    flat[0] = version + 1 > 0, so every combination the product forms (refresh, difference (1, -1), STORM
    (1, -(1 - beta))) is a large positive multiple of e_i. Touches no model: registered only when this module is
    imported (the audit, in-process)."""
    dim = int(extra[0])
    features = x.reshape(x.shape[0], -1)
    slot = features[:, 0].long()
    out = torch.zeros(x.shape[0], dim, dtype=flat.dtype, device=flat.device)
    live = torch.nonzero(slot < dim)[:, 0]
    out[live, slot[live]] = CANARY_MAGNITUDE * flat[0] * features[live, 1].to(flat.dtype)
    return out


# ---------------------------------------------------------------------------------------------- statistics


def clopper_pearson(successes: int, trials: int, alpha: float) -> tuple[float, float]:
    """Exact two-sided (1 - alpha) binomial interval (Clopper & Pearson 1934) as (lower, upper), each side at
    level alpha / 2, from the beta quantiles (scipy.stats.beta). ValueError for counts out of range."""
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"clopper_pearson: need 0 <= successes <= trials and trials >= 1, got {successes}/{trials}")
    lo = 0.0 if successes == 0 else float(stats.beta.ppf(alpha / 2, successes, trials - successes + 1))
    hi = 1.0 if successes == trials else float(stats.beta.ppf(1 - alpha / 2, successes + 1, trials - successes))
    return lo, hi


def _log_ratio(tpr: float, fpr: float, delta: float) -> float:
    if tpr - delta <= 0:
        return 0.0
    return math.inf if fpr <= 0 else max(0.0, math.log((tpr - delta) / fpr))


@dataclass(frozen=True)
class EpsilonBound:
    """The empirical epsilon of one audit: ``lower`` holds with confidence 1 - alpha (over the threshold grid);
    ``estimate`` and ``upper`` are log((TPR - delta) / FPR) at the threshold that gave it (raw rates, and the
    rates' other Clopper-Pearson ends); ``threshold`` in units of the claimed noise std; ``tpr`` and ``fpr``
    the raw rates there; ``present``/``absent`` the trial counts."""

    lower: float
    estimate: float
    upper: float
    threshold: float
    tpr: float
    fpr: float
    present: int
    absent: int


def epsilon_lower_bound(present: np.ndarray, absent: np.ndarray, delta: float, alpha: float = ALPHA,
                        thresholds: Sequence[float] = THRESHOLDS) -> EpsilonBound:
    """Empirical epsilon lower bound from test statistics of canaries present (present (P,)) and absent
    (absent (A,)), both float arrays of independent trials: max over thresholds t of
    log((TPR_lo(t) - delta) / FPR_hi(t)), TPR = P(stat > t | present), FPR = P(stat > t | absent), each
    Clopper-Pearson end at level alpha / (2 G) for G thresholds (Bonferroni), so the maximum is a valid
    lower bound with confidence 1 - alpha. ValueError for empty arrays or delta outside [0, 1)."""
    if present.size == 0 or absent.size == 0:
        raise ValueError(f"epsilon_lower_bound: need trials of both kinds, got {present.size} present and "
                         f"{absent.size} absent")
    if not 0 <= delta < 1:
        raise ValueError(f"epsilon_lower_bound: delta must be in [0, 1), got {delta}")
    level = alpha / len(thresholds)  # two-sided at alpha / G = one side at alpha / (2 G) per rate
    best = None
    for t in thresholds:
        tp, fp = int(np.sum(present > t)), int(np.sum(absent > t))
        tpr_lo, tpr_hi = clopper_pearson(tp, present.size, level)
        fpr_lo, fpr_hi = clopper_pearson(fp, absent.size, level)
        lower = _log_ratio(tpr_lo, fpr_hi, delta)
        if best is None or lower > best.lower:
            tpr, fpr = tp / present.size, fp / absent.size
            best = EpsilonBound(lower, _log_ratio(tpr, fpr, delta), _log_ratio(tpr_hi, fpr_lo, delta), t, tpr, fpr,
                                present.size, absent.size)
    return best


def claimed_epsilon(rate: float, noise_multiplier: float, delta: float, accountant: str = "pld") -> float:
    """epsilon(delta) of one Poisson-subsampled Gaussian release (rate, z), as the ledger charges it."""
    from ..server.ledger import epsilon_of

    return float(epsilon_of({(rate, noise_multiplier): 1}, delta, accountant))


# ---------------------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class AuditSpec:
    """One audited configuration: config ``keys`` of a short run on ``slots`` records and the release labels
    to audit (empty: all)."""

    keys: dict
    mechanisms: tuple[str, ...] = ()


def audit_specs(slots: int) -> dict[str, AuditSpec]:
    """Name -> audited configuration on ``slots`` records. Refresh releases at rate 1 (SPIDER), differences,
    dp-sgd, dp-sgda and s at rate 1/2 (Poisson sampling at work); few iterations and noise-allocation=ratios
    with every ratio 1, so that each release spends an epsilon of order 4-7 (where a finite audit can come
    near it). 'dp-double-spider' also makes both setup releases (the class histogram of a post-hoc logit
    adjustment, the private eta initialisation); 'dp-double-spider:weight-after-clip' audits the refreshes
    whose clip is a public weight bound (x-refresh at C_x W, eta-refresh at G max(1, W - 1))."""
    half = slots // 2
    spider = {"algorithm": "dp-double-spider", "iterations": 2, "q": 2, "epsilon": 16.0, "refresh-batch": slots,
              "diff-batch": half, "eta-noise-ratio": 1.0}
    return {
        "dp-double-spider": AuditSpec({**spider, "eta-init-source": "private-mean-loss", "posthoc-tau": 1.0,
                                       "class-prior": "private", "prior-noise-multiplier": 1.0,
                                       "eta-init-noise-multiplier": 1.0}),
        "dp-double-spider:weight-after-clip": AuditSpec(
            {**spider, "epsilon": 12.0, "dro-clip": "weight-after-clip", "eta-clip-rule": "weight-bound",
             "weight-cap": 2.0}, ("eta-refresh", "x-refresh")),
        "recursive-spider": AuditSpec({"algorithm": "recursive-spider", "iterations": 2, "q": 2, "epsilon": 12.0,
                                       "refresh-batch": slots, "diff-batch": half, "s-batch": half,
                                       "s-noise-ratio": 1.0}),
        # group level (docs/explanation/ALGORITHMS.md 3.3, 4.3): the K-vector group-loss releases (clip B), the weighted
        # x releases (weight-after-clip: clip C_x max_k w_k) and the class histogram the group priors come from
        "dp-double-spider:group": AuditSpec({**spider, "epsilon": 12.0, "dro-level": "group", "psi": "kl",
                                             "dro-clip": "weight-after-clip", "weight-cap": 2.0}),
        "recursive-spider:group": AuditSpec({"algorithm": "recursive-spider", "dro-level": "group", "iterations": 2,
                                             "q": 2, "epsilon": 12.0, "refresh-batch": slots, "diff-batch": half,
                                             "s-batch": half, "s-noise-ratio": 1.0}),
        "dp-sgd": AuditSpec({"algorithm": "dp-sgd", "iterations": 1, "epsilon": 4.0, "refresh-batch": half}),
        "dp-sgda": AuditSpec({"algorithm": "dp-sgda", "iterations": 1, "epsilon": 8.0, "refresh-batch": half}),
    }


def _base_keys(out: Path) -> dict:
    # delta stays 'auto' = 1/(10 n), the product's default rule
    return {"dataset": "mnist-st", "num-clients": 2, "threads": 1, "reproducible": False,
            "noise-allocation": "ratios", "eval-every": 1, "checkpoint-every": 0, "out-dir": str(out),
            "overwrite": True}


# ------------------------------------------------------------------------------------------- the harness


@dataclass
class Target:
    """One release to audit: ``query`` as the algorithm (or the setup stage) makes it at a public state,
    ``setup`` whether it is a setup release, ``label`` e.g. 'x-diff' or 's (STORM)'."""

    label: str
    query: Query
    setup: bool = False


def release_targets(cfg: Config, n: int, dim: int, num_classes: int) -> list[Target]:
    """Every kind of release of ``cfg``'s run: the setup queries, then each training mechanism's first query
    (and the two-point form of a mechanism whose first query has one point, e.g. the STORM s release), from the
    algorithm's own ``queries`` along a public trajectory that the auditor drives with released values of 0.01
    everywhere (any public state is a state a release must be private at)."""
    from ..server import setup as setup_releases
    from ..server.algorithms import make_algorithm

    out = [Target(q.mechanism, q, True) for stage in setup_releases.stages(cfg, num_classes) for q in stage]
    algo = make_algorithm(cfg, n, dim, num_classes)
    state = algo.start_state(np.zeros(dim), None, (1.0 / num_classes,) * num_classes)  # public uniform priors
    seen: dict[tuple[str, int], Query] = {}
    for _ in range(4 * max(cfg.q, 2)):
        queries = algo.queries(state)
        for q in queries:
            seen.setdefault((q.mechanism, len(q.points)), q)
        if state.t >= cfg.iterations:
            break
        state = algo.apply(state, {q.mechanism: np.full(q.dim, 0.01) for q in queries})
    names = {m for m, _ in seen}
    for (mech, points), q in seen.items():
        label = mech if (mech, 3 - points) not in seen else f"{mech} ({'STORM' if points == 2 else 'first'})"
        out.append(Target(label, q))
    missing = {m.name for m in algo.mechanisms()} - names
    if missing:
        raise RuntimeError(f"the public trajectory never queried {sorted(missing)}")
    return out


def canary_dataset(slots: int, num_classes: int, shape: tuple[int, ...] = (1, 28, 28)) -> ArrayDataset:
    """``slots`` records of the data set's shape (the model is built and probed on it) whose first feature is
    the slot index and second the presence flag (0 here, set per trial by ``_set_presence``); the rest is 0."""
    x = torch.zeros(slots, *shape)
    features = x.view(slots, -1)
    features[:, 0] = torch.arange(slots, dtype=torch.float32)
    return ArrayDataset(x, torch.zeros(slots, dtype=torch.int64), num_classes, "audit-canary")


def _set_presence(transport, present: np.ndarray) -> None:
    """Write each canary's presence flag into the shard that holds it (the auditor owns the data)."""
    for w in transport.workers:
        features = w.x.view(w.x.shape[0], -1)  # a view: writes go to the worker's records
        slots = features[:, 0].long().cpu().numpy()
        features[:, 1] = torch.as_tensor(present[slots], dtype=w.x.dtype, device=w.x.device)


def _tokens(query: Query) -> dict[int, np.ndarray]:
    """The points the clients receive: version v -> [v + 1] (read by ``canary_rows`` only)."""
    return {v: np.array([float(v) + 1.0]) for v in query.versions}


class _DoubledClipTransport:
    """Negative control 'clip-double': the clients clip the audited mechanism at twice the query's clip; the
    server (noise, ledger, reply check) keeps the declared clip."""

    def __init__(self, inner, mechanism: str) -> None:
        self.inner, self.mechanism = inner, mechanism

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, queries, versions):
        return self.inner.run([dataclasses.replace(q, clip=2 * q.clip) if q.mechanism == self.mechanism else q
                               for q in queries], versions)


def _ledger_class(broken: str | None):
    from ..server.ledger import Ledger

    if broken != "noise-half":
        return Ledger

    class HalfNoiseLedger(Ledger):
        """Negative control 'noise-half': the releaser and the clients draw half the calibrated noise, while the
        plan (and so the claimed epsilon) is the calibrated one."""

        def noise_multiplier(self, mechanism: str) -> float:
            return 0.5 * super().noise_multiplier(mechanism)

    return HalfNoiseLedger


@dataclass(frozen=True)
class AuditRow:
    """One audited release: configuration name, mechanism label, noise mode, broken (None or a ``BREAKS`` entry), rate,
    noise multiplier z, clip, claimed epsilon per release, the run's target epsilon, delta, the bound, the number
    of releases run, and the measured std of absent canaries' statistics in units of the claimed noise std."""

    config: str
    mechanism: str
    noise_mode: str
    broken: str | None
    rate: float
    noise_multiplier: float
    clip: float
    claimed: float
    run_epsilon: float
    delta: float
    bound: EpsilonBound
    releases: int
    noise_ratio: float

    @property
    def flagged(self) -> bool:
        """Whether the audit shows a violation: the lower bound exceeds the claimed epsilon."""
        return self.bound.lower > self.claimed


def audit_config(name: str, *, slots: int = 1000, trials: int = 200_000, max_releases: int = 20_000,
                 noise_mode: str = "central", mechanisms: Sequence[str] = (), broken: str | None = None,
                 seed: int | None = None, root: Path | None = None) -> list[AuditRow]:
    """Audit the releases of the configuration ``name`` (``audit_specs``) with ``slots`` records: per release
    about ``trials`` trials (half present), i.e. ceil(trials / k) releases with k = min(D, slots) canaries each,
    at most ``max_releases``. ``mechanisms`` restricts the release labels (default: the spec's, else all);
    ``broken`` runs a negative control (``BREAKS``); ``noise_mode`` is config noise-mode. ``seed`` seeds the
    auditor's coins only (the product's sampling and noise stay secret-seeded). ``root``: where the releases'
    event log goes (a temporary directory by default). Returns one AuditRow per audited release. ValueError
    for an unknown name, break or mechanism, or slots, trials or max_releases out of range."""
    from ..client.local_transport import LocalTransport
    from ..common.models import make_model, resolve_model
    from ..server.algorithms import make_algorithm
    from ..server.engine import plan_run, resolve_delta
    from ..server.releaser import Releaser
    from ..server.rundir import RunDir

    specs = audit_specs(slots)
    if name not in specs:
        raise ValueError(f"audit: configuration {name!r} unknown; allowed: {', '.join(specs)}")
    if broken is not None and broken not in BREAKS:
        raise ValueError(f"audit: break {broken!r} unknown; allowed: {', '.join(BREAKS)}")
    if slots < 20 or trials < 2 or max_releases < 1:
        raise ValueError(f"audit: need slots >= 20, trials >= 2 and max-releases >= 1; got {slots}, {trials} and "
                         f"{max_releases}")
    spec = specs[name]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(root or tmp) / name.replace(":", "-") / noise_mode / (broken or "correct")
        cfg = Config.from_mapping({**_base_keys(out), **spec.keys, "noise-mode": noise_mode})
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        num_classes = 10
        model = make_model(resolve_model(cfg.model, cfg.dataset), num_classes, cfg.seed, fix=cfg.model_fix)
        dim = sum(p.numel() for p in model.parameters())
        delta = resolve_delta(cfg, slots)
        plan, noise, _ = plan_run(cfg, make_algorithm(cfg, slots, dim, num_classes), slots, delta)
        targets = release_targets(cfg, slots, dim, num_classes)
        wanted = tuple(mechanisms) or spec.mechanisms
        if wanted:
            unknown = set(wanted) - {t.label for t in targets}
            if unknown:
                raise ValueError(f"audit: release(s) {sorted(unknown)} not made by {name}; allowed: "
                                 f"{', '.join(t.label for t in targets)}")
            targets = [t for t in targets if t.label in wanted]
        transport = LocalTransport(cfg, canary_dataset(slots, num_classes))
        rd = RunDir(out)
        rd.create()
        ledger_cls = _ledger_class(broken)
        coins = np.random.default_rng(seed) if seed is not None else secret_rng()
        rows = []
        for target in targets:
            q = target.query
            k = min(q.dim, slots)
            query = dataclasses.replace(q, quantity=CANARY_QUANTITY, extra=(float(q.dim),))
            channel = _DoubledClipTransport(transport, q.mechanism) if broken == "clip-double" else transport
            releases = min(max_releases, math.ceil(trials / k))
            z = noise[q.mechanism]
            present, absent = [], []
            for _ in range(releases):
                flags = coins.random(slots) < 0.5
                flags[k:] = False
                _set_presence(transport, flags)
                # a fresh ledger per release: each trial is the first release of its plan (never refused)
                releaser = Releaser(cfg, channel, ledger_cls(plan, noise, cfg.epsilon, delta, cfg.accountant),
                                    slots, rd)
                sensitivity = releaser.decorate(query, diagnostics=not target.setup).sensitivity
                mean = releaser.run([query], _tokens(query), setup=target.setup)[q.mechanism]
                stat = mean[:k] * (q.rate * slots) / (z * sensitivity)  # the noisy sum, in claimed noise stds
                present.append(stat[flags[:k]])
                absent.append(stat[~flags[:k]])
            present_all, absent_all = np.concatenate(present), np.concatenate(absent)
            rows.append(AuditRow(name, target.label, noise_mode, broken, q.rate, z, q.clip,
                                 claimed_epsilon(q.rate, z, delta, cfg.accountant), cfg.epsilon, delta,
                                 epsilon_lower_bound(present_all, absent_all, delta), releases,
                                 float(np.std(absent_all))))
    return rows


# ------------------------------------------------------------------------------------------------ the report

# (configuration, noise mode, releases (empty: the spec's), break) of the documented audit
DEFAULT_PLAN: tuple[tuple[str, str, tuple[str, ...], str | None], ...] = (
    ("dp-double-spider", "central", (), None),
    ("dp-double-spider:weight-after-clip", "central", (), None),
    ("recursive-spider", "central", (), None),
    ("dp-sgd", "central", (), None),
    ("dp-sgda", "central", (), None),
    ("dp-double-spider:group", "central", (), None),
    ("recursive-spider:group", "central", (), None),
    ("dp-double-spider", "distributed", ("x-refresh", "x-diff", "eta-diff"), None),
    ("dp-sgd", "distributed", (), None),
    ("dp-sgd", "local", (), None),
    ("dp-sgd", "central", (), "noise-half"),
    ("dp-sgd", "distributed", (), "noise-half"),
    ("dp-double-spider", "central", ("x-diff",), "clip-double"),
    ("recursive-spider", "central", ("vu-diff",), "clip-double"),
)


def _fmt(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:.2f}"


def report_lines(rows: Sequence[AuditRow], command: str, slots: int) -> list[str]:
    """The canary section of docs/research/AUDIT.md for ``rows`` (Markdown lines)."""
    lines = [
        f"Generated by `{command}` ({slots} records per audited run). White-box Dirac canaries (Nasr et al. 2021, "
        "2023) through the product's release path: the algorithm's own query at a public state, `Releaser.run` "
        "over real `ShardWorker`s (Poisson sampling, per-record clip with the clipped-count coordinate, client "
        "noise shares in distributed mode, server noise) and the calibrated ledger; only the per-record rows come "
        "from the audit's test quantity, each canary a huge vector on its own coordinate that the product's "
        "clip brings exactly to the clip bound of that release. Per release, k = min(D, n) canaries, each present "
        "by a fair coin; test: canary's coordinate of the released sum above a threshold (grid 0-7 claimed "
        "noise stds). Lower bound: max over the grid of log((TPR_lo - delta) / FPR_hi), Clopper-Pearson with "
        "Bonferroni over the grid, 95% confidence (Jagielski et al. 2020, Nasr et al. 2021). "
        "Code: simulations/canary_audit.py.", "",
        "Claimed epsilon is **per release**: epsilon(delta) of the one Poisson-subsampled Gaussian (rate, z) the "
        "ledger charges for it, at the run's delta = 1/(10 n). The audited runs are short (1-2 iterations, "
        "noise-allocation=ratios with ratio 1) so that a single release spends an epsilon of about 4-7; the run's "
        "composed "
        "target (calibrated by the ledger) is in the 'run eps' column. 'estimate [interval]': log((TPR - delta) / "
        "FPR) at the threshold of the bound, with the rates' raw values and their other Clopper-Pearson ends "
        "(inf: no false positive there). 'noise': std of the absent canaries' statistic over the claimed noise "
        "std (1 when the noise is what the ledger was told). A release of D coordinates carries min(D, n) canaries, "
        "so one release gives up to n trials; the one-coordinate releases (eta-refresh, eta-diff, eta-init, s) give "
        "one trial per release and are capped by --max-releases, hence their looser bounds at the same cost. "
        "Negative controls ('break'): noise-half draws half the calibrated noise (server and client shares), "
        "clip-double has the clients clip at twice the declared clip; the ledger is told neither, so their bound "
        "must exceed the claim.", "",
        "| configuration | release | noise mode | break | rate | z | clip | run eps | claimed eps / release | "
        "empirical eps lower bound (95%) | estimate [interval] | claim / bound | trials (releases) | noise | "
        "verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r.bound
        ratio = r.claimed / b.lower if b.lower > 0 else math.inf
        if r.broken:
            verdict = "caught (bound > claim)" if r.flagged else "NOT caught"
        else:
            verdict = "VIOLATION (bound > claim)" if r.flagged else "ok"
        lines.append(f"| {r.config} | {r.mechanism} | {r.noise_mode} | {r.broken or '-'} | {r.rate:.2g} | "
                     f"{r.noise_multiplier:.3f} | {r.clip:.4g} | {r.run_epsilon:g} | {r.claimed:.2f} | "
                     f"{b.lower:.2f} | {_fmt(b.estimate)} [{b.lower:.2f}, {_fmt(b.upper)}] | {_fmt(ratio)} | "
                     f"{b.present + b.absent} ({r.releases}) | {r.noise_ratio:.3f} | {verdict} |")
    return lines


def run_canary_audit(docs: Path, *, slots: int = 1000, trials: int = 200_000, max_releases: int = 20_000,
                     plan: Sequence[tuple[str, str, tuple[str, ...], str | None]] = DEFAULT_PLAN,
                     command: str = "dpdro lab audit --mode canary", progress=None) -> tuple[Path, list[AuditRow]]:
    """Run every audit of ``plan`` and write the canary section of ``docs``/AUDIT.md (the other sections are kept;
    an empty plan writes nothing); returns (its path, the rows). ``progress(rows)`` is called with each audited
    configuration's rows. The node evaluation's audit has its own section (simulations/eval_audit.py)."""
    rows: list[AuditRow] = []
    for name, mode, mechanisms, broken in plan:
        new = audit_config(name, slots=slots, trials=trials, max_releases=max_releases, noise_mode=mode,
                           mechanisms=mechanisms, broken=broken)
        rows += new
        if progress is not None:
            progress(new)
    path = docs / "AUDIT.md"
    if rows:
        write_section(path, "canary", report_lines(rows, command, slots))
    return path, rows


SECTION_TITLES = {"canary": "## White-box canary audit of every release (`--mode canary`)",
                  "mia": "## Membership inference against trained models (`--mode mia`)",
                  "node-evaluation": "## White-box canary audit of the node evaluation (`--mode canary`, "
                                     "eval-data=nodes)"}
DOC_TITLE = "# Empirical privacy audit"


def write_section(path: Path, mode: str, lines: Sequence[str]) -> Path:
    """Replace (or add) the section of ``mode`` ('canary', 'mia' or 'node-evaluation') in the audit document
    ``path``, between its HTML comment markers, keeping the other sections; the file is replaced atomically."""
    from ..common.atomic import atomic_write_bytes

    begin, end = f"<!-- audit:{mode} -->", f"<!-- /audit:{mode} -->"
    block = "\n".join([begin, SECTION_TITLES[mode], "", *lines, end])
    text = path.read_text() if path.exists() else ""
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = (text.rstrip("\n") + "\n\n" if text else DOC_TITLE + "\n\n") + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, text.encode("utf-8"))
    return path
