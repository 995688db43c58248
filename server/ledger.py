"""The privacy ledger: planned releases, calibration and a guard, all on Google's dp-accounting.

Contract (docs/explanation/ALGORITHMS.md 5.2). Every release is a Poisson-subsampled Gaussian: each record is included
independently with rate r, clipped per-record vectors (norm <= C) are summed and N(0, (z C f)^2) noise is
added to the sum (f the float64 rounding factor, ``release.sum_rounding_factor``). Its DpEvent is
PoissonSampledDpEvent(r, GaussianDpEvent(z)).

Neighbouring relation (``NEIGHBOURING_RELATION``): replace one record of the union of all clients' data with
the null record, n fixed (dp-accounting's ``NeighboringRelation.REPLACE_SPECIAL``; Kairouz et al. 2021,
arXiv:2103.00039, Definition 1.1). The null record stays on its client, so n and every client's shard size are
the same in neighbouring data sets and releasing them costs nothing. It is sampled like any record and
contributes the zero vector to every release: no gradient, not counted as clipped (the clipped-count
coordinate), no label or group in the histograms, 0 to the eta-init loss sum. For a Poisson-subsampled
Gaussian that is the add/remove analysis: given the other records' sum s, a record y gives
(1 - r) N(s, sigma^2) + r N(s + y, sigma^2) and the null record N(s, sigma^2) whether sampled or not, exactly the
pair of adding or removing y. Both of dp-accounting's accountants support it with that privacy loss: the PLD
(``from_gaussian_mechanism`` treats REPLACE_SPECIAL as ADD_OR_REMOVE_ONE: the remove and add PMFs of the
subsampled mixture) and the RDP accountant (``_compute_rdp_poisson_subsampled_gaussian`` for both relations; it
refuses REPLACE_ONE for Poisson sampling). Both are told the relation; tests/test_ledger.py checks the epsilon
against a direct integration of the hockey-stick divergence of that pair.

- A ``Mechanism`` is a named kind of release (e.g. 'x-refresh') with a sampling rate and a noise multiplier
  relative to the others. An algorithm declares its plan: how many releases of each mechanism.
- Two accountants: 'pld' (the default: privacy loss distributions, tight up to a discretisation that only
  ever rounds epsilon up) and 'rdp' (Renyi DP: a looser bound, about 5-10% more noise at the same target on
  our plans). Both are upper bounds on the true epsilon. The PLD's discretisation is chosen per evaluation
  from a short ladder so that no array exceeds ``PLD_MAX_POINTS`` (memory stays bounded); a plan that
  cannot be accounted within the cap raises ``AccountingCostError`` (use accountant=rdp).
- ``calibrate`` finds the common scale s (z_k = s * relative_k) at which the plan spends epsilon in
  [0.99 target, target] at delta (Brent's method on a bracket: for PLD, the RDP solution is the upper end,
  since PLD is tighter, and the search goes down from it). It raises ``CalibrationError`` rather than return
  a scale that overspends or misses the 0.99 lower end.
- ``Ledger`` records releases as they happen. Its guard allows a release when the releases so far plus this
  one are still within the calibrated plan and the plan plus any release recorded beyond it stays within the
  target (composition is monotone, so epsilon <= epsilon(plan + beyond) <= target); anything else is allowed
  only if the exact epsilon with it stays within the target. ``record_seen`` and ``check_spent`` serve a
  ledger of what someone has already seen (the server's own view, server/releaser.py).
- Runs of identical events are composed as SelfComposedDpEvent(event, count), so the cost of an epsilon
  evaluation grows with the number of distinct mechanisms, not with the number of iterations.
- Node sampling (config key node-sampling-rate p < 1; server/node_sampling.py, ALGORITHMS.md 5.8): every release of
  the run is the revealed mixture of its event with probability p (``node_rate`` of ``epsilon_of``, ``calibrate`` and
  ``Ledger``): PLD (1 - p) delta_0 + p PLD, RDP log(1 - p + p e^{(a-1) D_a}) / (a - 1). p = 1 is the event itself.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import dp_accounting
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import optimize

from ..common.config import ConfigError
from ..common.ddg import DdgGeometry
from ..common.errors import DpdroError
from .node_sampling import mixed_pld, mixed_rdp

ACCOUNTANTS = ("pld", "rdp")
DEFAULT_ACCOUNTANT = "pld"
# The unit of privacy (module docstring): one record replaced with the null record, n fixed.
NEIGHBOURING_RELATION = dp_accounting.NeighboringRelation.REPLACE_SPECIAL

# PLD discretisation (value_discretization_interval, in nats of privacy loss), finest first. The estimate is
# pessimistic (rounds the privacy loss up), so a coarser grid only loosens epsilon: on the main job's plan
# 1e-3 is 2e-4 above 1e-4 and costs a tenth of the time and memory; 1e-2 is used only for plans whose PMF
# would not fit the cap at 1e-3 (small noise multipliers, i.e. large epsilons).
PLD_DISCRETISATIONS = (1e-3, 1e-2)
# Most points one PLD PMF (one mechanism self-composed, or the composition of all) may have. Peak memory
# measured with dp-accounting 0.6: about 110 bytes per point (FFT buffers), so 2**21 points ~ 0.25 GiB.
PLD_MAX_POINTS = 2**21
PLD_BYTES_PER_POINT = 110
# log of the probability mass dp-accounting truncates from a Gaussian PLD (its default), its tail quantile
# (sqrt(2 * 50) bounds the standard normal's e^-50 quantile) and the tail mass a self-composition drops.
_PLD_LOG_MASS_TRUNCATION = -50.0
_PLD_TAIL_QUANTILE = 10.0
_PLD_TAIL_MASS = 1e-15


class PrivacyBudgetExceeded(RuntimeError, DpdroError):
    """A release would make epsilon exceed the run's target; it was refused and nothing was released."""


class CalibrationError(ConfigError):
    """No noise scale makes the plan spend epsilon in [0.99 target, target]; the message says what to change."""


class AccountingCostError(ConfigError):
    """The PLD of a plan would need more than ``PLD_MAX_POINTS`` points (memory) even at the coarsest
    discretisation; the message names the releases and what to change (accountant=rdp, more noise)."""


@dataclass(frozen=True)
class Mechanism:
    """A kind of release: ``rate`` = Poisson sampling rate in (0, 1] (1: every record, no sampling);
    ``relative_noise`` > 0 = its noise multiplier relative to the plan's common scale; ``fixed_noise`` > 0,
    when set, is its noise multiplier itself, untouched by calibration (one-off statistics such as the class
    histogram)."""

    name: str
    rate: float
    relative_noise: float = 1.0
    fixed_noise: float | None = None

    def noise_at(self, scale: float) -> float:
        """The noise multiplier of this mechanism at common scale ``scale``."""
        return self.fixed_noise if self.fixed_noise is not None else self.relative_noise * scale


def make_accountant(kind: str) -> dp_accounting.PrivacyAccountant:
    """A fresh dp-accounting accountant ('rdp' or 'pld') for ``NEIGHBOURING_RELATION``. The ledger's own PLD
    evaluation (``epsilon_of``) builds its PLDs directly to bound their size; this accountant is for callers
    that compose events one by one. ValueError for another kind."""
    if kind == "rdp":
        return rdp_privacy_accountant.RdpAccountant(neighboring_relation=NEIGHBOURING_RELATION)
    if kind == "pld":
        return pld_privacy_accountant.PLDAccountant(neighboring_relation=NEIGHBOURING_RELATION,
                                                    value_discretization_interval=PLD_DISCRETISATIONS[0])
    raise ValueError(f"unknown accountant {kind!r}; allowed: {', '.join(ACCOUNTANTS)}")


def release_event(rate: float, noise_multiplier: float) -> dp_accounting.DpEvent:
    """DpEvent of one Poisson-subsampled Gaussian release (z = 0 means no noise: infinite epsilon)."""
    return dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(noise_multiplier))


def composed_event(counts: Mapping[tuple[float, float], int]) -> dp_accounting.DpEvent:
    """One event for many releases: counts maps (rate, noise multiplier) -> number of releases."""
    events = [dp_accounting.SelfComposedDpEvent(release_event(r, z), c)
              for (r, z), c in sorted(counts.items()) if c > 0]
    return dp_accounting.ComposedDpEvent(events)


def epsilon_of(counts: Mapping[tuple[float, float], int], delta: float,
               accountant: str = DEFAULT_ACCOUNTANT, node_rate: float = 1.0, ddg: DdgGeometry | None = None) -> float:
    """Epsilon at ``delta`` of the composition of the releases in ``counts`` (0 for no release).

    counts maps (sampling rate, noise multiplier) -> number of releases; ``node_rate`` p < 1 makes every release
    the revealed mixture of its event (node sampling, module docstring). ``ddg``: the releases are the
    distributed discrete Gaussian of that geometry (noise-mode=distributed-discrete; ``common.ddg.DdgGeometry.
    epsilon``, its own RDP analysis: ``accountant`` is not used, node sampling not supported). Results are cached
    (the same counts are evaluated again by calibration and the guard). Raises ValueError for an unknown accountant
    and AccountingCostError when accountant='pld' cannot fit the plan's PLD in ``PLD_MAX_POINTS``.
    """
    if ddg is not None:
        if node_rate != 1:
            raise ValueError("the distributed discrete Gaussian's accounting does not support node sampling")
        items = tuple(sorted((float(r), float(z), int(c)) for (r, z), c in counts.items() if c > 0))
        return _ddg_epsilon_cached(items, float(delta), ddg)
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {accountant!r}; allowed: {', '.join(ACCOUNTANTS)}")
    items = tuple(sorted((float(r), float(z), int(c)) for (r, z), c in counts.items() if c > 0))
    if not items:
        return 0.0
    if any(z <= 0 for _, z, _ in items):
        return math.inf
    if node_rate != 1:
        return _epsilon_cached(items, float(delta), accountant, float(node_rate))
    return _epsilon_cached(items, float(delta), accountant)


@functools.lru_cache(maxsize=512)
def _ddg_epsilon_cached(items: tuple[tuple[float, float, int], ...], delta: float, ddg: DdgGeometry) -> float:
    return ddg.epsilon(items, delta)


@functools.lru_cache(maxsize=512)
def _epsilon_cached(items: tuple[tuple[float, float, int], ...], delta: float, accountant: str,
                    node_rate: float = 1.0) -> float:
    if accountant == "rdp" and node_rate != 1:
        orders = make_accountant("rdp")._orders  # noqa: SLF001 - the accountant's default orders
        total = sum(c * mixed_rdp(_poisson_gaussian_rdp(r, z, orders), orders, node_rate) for r, z, c in items)
        return float(rdp_privacy_accountant.compute_epsilon(orders, total, delta)[0])
    if accountant == "rdp":
        acc = make_accountant("rdp")
        acc.compose(composed_event({(r, z): c for r, z, c in items}))
        return float(acc.get_epsilon(delta))
    return float(_pld(items, node_rate).get_epsilon_for_delta(delta))


def _poisson_gaussian_rdp(rate: float, z: float, orders) -> list[float]:
    """RDP of PoissonSampledDpEvent(rate, GaussianDpEvent(z)) at each order, as dp-accounting's RdpAccountant
    computes it for ``NEIGHBOURING_RELATION``."""
    return rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(rate, z, orders)  # noqa: SLF001


def _pld(items: tuple[tuple[float, float, int], ...], node_rate: float = 1.0) -> pld_lib.PrivacyLossDistribution:
    """The composed PLD of (rate, z, count) releases at the finest discretisation that fits the cap (each release
    the revealed mixture of its event at node rate ``node_rate`` when below 1)."""
    needed = {}
    for vdi in PLD_DISCRETISATIONS:
        try:
            return _pld_at(items, vdi, node_rate)
        except _TooLarge as e:
            needed[vdi] = e.points
    what = ", ".join(f"{c} x (rate {r:.4g}, noise multiplier {z:.4g})" for r, z, c in items)
    points = needed[PLD_DISCRETISATIONS[-1]]
    raise AccountingCostError(
        f"config key 'accountant': got 'pld'; its privacy loss distribution of the releases [{what}] needs "
        f"about {points:.3g} points (~{points * PLD_BYTES_PER_POINT / 2**30:.2g} GiB) even at discretisation "
        f"{PLD_DISCRETISATIONS[-1]:g}, over the cap of {PLD_MAX_POINTS} points: noise multipliers this small "
        "mean a very large epsilon; use accountant=rdp, or a smaller epsilon / fewer iterations (more noise)")


class _TooLarge(Exception):
    def __init__(self, points: float) -> None:
        super().__init__(points)
        self.points = points


def _pld_at(items: tuple[tuple[float, float, int], ...], vdi: float,
            node_rate: float = 1.0) -> pld_lib.PrivacyLossDistribution:
    """Composed PLD at discretisation ``vdi``; raises _TooLarge before allocating more than the cap."""
    total = 0
    composed = None
    for rate, z, count in items:
        # Width of the Gaussian's truncated privacy-loss range, 2T/z + 1/z^2 (sensitivity 1); subsampling only
        # narrows it. Checked before dp-accounting builds the array (at z = 1e-3 it would be TiB).
        base_points = (2 * _PLD_TAIL_QUANTILE / z + 1 / z**2) / vdi
        if base_points > PLD_MAX_POINTS:
            raise _TooLarge(base_points)
        base = pld_lib.from_gaussian_mechanism(
            standard_deviation=z, sampling_prob=rate, value_discretization_interval=vdi,
            log_mass_truncation_bound=_PLD_LOG_MASS_TRUNCATION, neighboring_relation=NEIGHBOURING_RELATION)
        base = mixed_pld(base, node_rate)
        points = max(_self_composed_points(pmf, count) for pmf in _pmfs(base))
        total += points
        if points > PLD_MAX_POINTS or total > PLD_MAX_POINTS:
            raise _TooLarge(max(points, total))
        part = base.self_compose(count, tail_mass_truncation=_PLD_TAIL_MASS) if count > 1 else base
        composed = part if composed is None else composed.compose(part, tail_mass_truncation=_PLD_TAIL_MASS)
    return composed


def _pmfs(pld: pld_lib.PrivacyLossDistribution) -> list:
    # dp-accounting 0.6 (pinned <0.7) keeps the remove/add PMFs in these attributes; sizing them before the
    # FFT is what bounds memory.
    return [pld._pmf_remove, pld._pmf_add]  # noqa: SLF001


def _self_composed_points(pmf, count: int) -> int:
    """Length of the FFT array dp-accounting's self-composition of ``pmf`` ``count`` times allocates."""
    probs = pmf.to_dense_pmf()._probs  # noqa: SLF001
    if count <= 1:
        return len(probs)
    lower, upper = pld_common.compute_self_convolve_bounds(probs, count, _PLD_TAIL_MASS)
    return max(upper - lower + 1, len(probs))


# What delta = 'auto' means, in words. Results tables carry it in each run's configuration fingerprint
# (simulations/sweep.py: config_fingerprint), so change it together with auto_delta: runs made under another
# meaning are other experiments (before 2026-12-02 it was "n^-1.1").
AUTO_DELTA_RULE = "1/(10 n)"


def auto_delta(n: int) -> float:
    """The delta of ``delta = 'auto'``: 1/(10 n) for n training records (n public, >= 1).

    The smallest delta the product does not warn about (check_delta): n^-1.1, the seed paper's choice, exceeds
    1/(10 n) for every n below 10^10, so it would make every default run print a weak-guarantee warning.
    Raises ValueError for n < 1.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1 training record, got {n}")
    return 0.1 / n


def check_delta(delta: float, n: int, given: object) -> str | None:
    """Check delta against the number n of training records (public); return a warning text or None.

    A delta of 1/n or more allows a mechanism that publishes a random record outright, so it is refused
    (ConfigError naming config key 'delta', ``given`` as the user wrote it, the resolved value, n and what is
    allowed); above 1/(10 n) the guarantee is weak and a warning text is returned. Call before any work.
    """
    if not (n >= 1 and 0 < delta < 1 / n):
        resolved = f" (= {delta:.3g})" if str(given) != f"{delta}" else ""
        raise ConfigError(
            f"config key 'delta': got {given!r}{resolved} for n = {n} training records; allowed: 0 < delta < 1/n = "
            f"{1 / max(n, 1):.3g} (a delta of 1/n or more lets a mechanism publish a record outright), better "
            f"<= 1/(10 n) = {0.1 / max(n, 1):.3g}: give a smaller delta or use more training records "
            "(max-train-records)")
    if delta > 0.1 / n:
        return (f"delta = {delta:.3g} (config key 'delta' = {given!r}) exceeds 1/(10 n) = {0.1 / n:.3g} for n = {n} "
                f"training records: (epsilon, delta)-DP with delta this close to 1/n = {1 / n:.3g} is a weak "
                "guarantee (publishing each record outright with probability delta meets it and exposes n x delta = "
                f"{n * delta:.2g} records on average); prefer delta <= 1/(10 n)")
    return None


def plan_counts(plan: Mapping[Mechanism, int], scale: float) -> Counter:
    """(rate, z) -> count for a plan at common noise scale ``scale``."""
    counts: Counter = Counter()
    for mech, n in plan.items():
        counts[(mech.rate, mech.noise_at(scale))] += n
    return counts


def calibrate(plan: Mapping[Mechanism, int], epsilon: float, delta: float,
              accountant: str = DEFAULT_ACCOUNTANT, node_rate: float = 1.0, ddg: DdgGeometry | None = None) -> float:
    """The common noise scale s at which ``plan`` spends epsilon in [0.99 epsilon, epsilon] at ``delta``.

    The RDP solution is found first (cheap at any scale); for 'pld' it is the upper end of the bracket (PLD
    is the tighter bound: it needs 0.90-0.95x the RDP noise on our plans) and the lower end is searched
    downwards from 0.85x it, so the PLD is never evaluated at tiny noise multipliers. The returned scale is
    checked with ``epsilon_of`` itself (what the ledger reports). ``node_rate``: node sampling (``epsilon_of``).
    ``ddg``: the distributed discrete Gaussian's accounting (``epsilon_of``), solved directly (one bound only).

    Raises ValueError for a non-positive or infinite target, an empty plan or one-off releases that alone
    spend the target; CalibrationError if no scale lands in [0.99 target, target] (it never returns an
    overspending scale); AccountingCostError if the PLD of the plan near the solution exceeds the memory cap.
    """
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(f"calibration needs a finite target epsilon > 0, got {epsilon}")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {accountant!r}; allowed: {', '.join(ACCOUNTANTS)}")
    if not any(n for m, n in plan.items() if m.fixed_noise is None):
        raise ValueError("calibration needs a plan with at least one release")
    fixed = {m: n for m, n in plan.items() if m.fixed_noise is not None}
    def eps_of(counts: Counter, kind: str) -> float:  # node_rate passed only when node sampling is on
        if ddg is not None:
            return epsilon_of(counts, delta, kind, node_rate, ddg)
        return epsilon_of(counts, delta, kind) if node_rate == 1 else epsilon_of(counts, delta, kind, node_rate)

    if fixed and eps_of(plan_counts(fixed, 1.0), accountant) >= epsilon:
        raise ValueError(f"the one-off releases ({', '.join(m.name for m in fixed)}) alone spend epsilon >= "
                         f"{epsilon:g}: raise their noise multipliers or the target")

    def describe() -> str:
        return ", ".join(f"{n} x {m.name} (rate {m.rate:.4g}, "
                         + (f"fixed noise {m.fixed_noise:g})" if m.fixed_noise is not None
                            else f"relative noise {m.relative_noise:.4g})") for m, n in plan.items())

    def eps_with(kind: str) -> Callable[[float], float]:
        return lambda scale: eps_of(plan_counts(plan, scale), kind)

    rdp_scale = _solve(eps_with("rdp"), epsilon, 1.0, describe)
    if accountant == "rdp" or ddg is not None:
        return rdp_scale
    try:
        return _solve(eps_with("pld"), epsilon, rdp_scale, describe, below=True)
    except AccountingCostError as e:
        raise AccountingCostError(f"calibrating the plan [{describe()}] to epsilon {epsilon:g}: {e}") from None


def _solve(eps_at: Callable[[float], float], target: float, guess: float, describe: Callable[[], str],
           below: bool = False) -> float:
    """Smallest scale s (within 1e-5 relative) with eps_at(s) <= target, checked to be >= 0.99 target.

    eps_at must be non-increasing in s (more noise, less epsilon). ``guess``: a starting point; with
    ``below`` it is known (or expected) to be an upper end and the search for the lower end goes down from
    0.85 x guess in steps of 0.85 (no PLD at tiny scales). Raises CalibrationError.
    """
    seen: dict[float, float] = {}

    def f(s: float) -> float:
        if s not in seen:
            seen[s] = eps_at(s)
        return seen[s] - target

    hi = guess
    for _ in range(64):  # upper end: doubles until the plan is within target (exists: the fixed part < target)
        if f(hi) <= 0:
            break
        hi *= 1.02 if below else 2.0
    else:
        raise CalibrationError(f"calibration found no noise scale up to {hi:.3g} within epsilon {target:g} for the "
                               f"plan [{describe()}]")
    lo = hi * (0.85 if below else 0.5)
    for _ in range(64):  # lower end: overspends (exists: epsilon -> inf as the noise -> 0)
        if f(lo) > 0:
            break
        hi, lo = lo, lo * (0.85 if below else 0.5)
    else:
        raise CalibrationError(f"calibration found no noise scale down to {lo:.3g} that overspends epsilon "
                               f"{target:g} for the plan [{describe()}]")
    optimize.brentq(f, lo, hi, xtol=1e-5 * lo, rtol=1e-6, maxiter=200)
    for _ in range(60):
        # Brent may end on either side of the root: take the smallest evaluated scale within target and
        # bisect towards the largest overspending one until epsilon lands in [0.99 target, target].
        ok = min(s for s, e in seen.items() if e <= target)
        over = max((s for s, e in seen.items() if e > target and s < ok), default=None)
        if seen[ok] >= 0.99 * target or over is None or ok - over <= 1e-12 * ok:
            break
        f(math.sqrt(over * ok))
    if not 0.99 * target <= seen[ok] <= target:
        near = f"; at scale {over:.9g} it spends {seen[over]:.6g}" if over is not None else ""
        raise CalibrationError(
            f"calibration could not land epsilon in [{0.99 * target:.6g}, {target:g}] for the plan "
            f"[{describe()}]: at scale {ok:.9g} it spends {seen[ok]:.6g}{near} (the accountant's epsilon jumps "
            "there); try the other accountant (accountant=rdp or pld) or a slightly different epsilon")
    return float(ok)


class Ledger:
    """Records the run's releases and guards the budget.

    Args:
        plan: mechanism -> planned number of releases (with calibrated noise multipliers ``noise``).
        noise: mechanism name -> noise multiplier z (0 in a non-private run).
        epsilon, delta: the target; epsilon = inf means a non-private run (nothing is refused, the
            reported epsilon is inf).
        accountant: 'pld' (default) or 'rdp'.
        node_rate: the node-sampling rate p of every release (1: none; ``epsilon_of``).
        ddg: noise-mode=distributed-discrete: every release is the distributed discrete Gaussian of this geometry
            (``epsilon_of``); None: the subsampled Gaussian.
    """

    def __init__(self, plan: Mapping[Mechanism, int], noise: Mapping[str, float], epsilon: float,
                 delta: float, accountant: str = DEFAULT_ACCOUNTANT, node_rate: float = 1.0,
                 ddg: DdgGeometry | None = None) -> None:
        self.plan = dict(plan)
        self.noise = dict(noise)
        self.epsilon = epsilon
        self.delta = delta
        self.accountant = accountant
        self.node_rate = node_rate
        self.ddg = ddg
        self.by_name = {m.name: m for m in plan}
        self.spent: Counter = Counter()  # mechanism name -> releases made
        self.extra: Counter = Counter()  # (rate, z) -> releases made beyond the plan
        # the extra releases with which the rest of the plan was last shown to fit the target (calibration shows it
        # for none): while ``extra`` equals it, a planned release needs no new epsilon evaluation
        self._fits_with: Counter = Counter()

    @property
    def private(self) -> bool:
        """False in a non-private run (epsilon = inf)."""
        return math.isfinite(self.epsilon)

    def noise_multiplier(self, mechanism: str) -> float:
        """The calibrated noise multiplier z of ``mechanism`` (noise std = z x its L2 sensitivity)."""
        return self.noise[mechanism]

    def _counts(self, extra_release: tuple[float, float] | None = None) -> Counter:
        counts: Counter = Counter(self.extra)
        for name, n in self.spent.items():
            m = self.by_name[name]
            counts[(m.rate, self.noise[name])] += n
        if extra_release is not None:
            counts[extra_release] += 1
        return counts

    def _epsilon(self, counts: Mapping[tuple[float, float], int]) -> float:
        """``epsilon_of`` the counts with this ledger's delta, accountant, node rate and DDG geometry."""
        if self.ddg is not None:
            return epsilon_of(counts, self.delta, self.accountant, self.node_rate, self.ddg)
        return epsilon_of(counts, self.delta, self.accountant, self.node_rate)

    def charge_at(self, mechanism: str, rate: float, noise_multiplier: float) -> None:
        """Record one release of ``mechanism`` at ``rate`` that carried only ``noise_multiplier`` (at most the
        planned one: a DDG release missing shares, ddg-shortfall=charge), or raise PrivacyBudgetExceeded
        (recording nothing) if the exact epsilon with it exceeds the target. At the planned multiplier it is
        ``charge``. Call before the value is released."""
        planned = self.noise.get(mechanism, 0.0)
        if noise_multiplier >= planned or not self.private:
            self.charge(mechanism, rate)
            return
        eps = self._epsilon(self._counts((rate, noise_multiplier)))
        if eps > self.epsilon:
            raise PrivacyBudgetExceeded(
                f"release '{mechanism}' (rate {rate:.6g}) with the noise of the shares present only (noise "
                f"multiplier {noise_multiplier:.6g} of the planned {planned:.6g}) would spend epsilon {eps:.4f} > "
                f"target {self.epsilon:g} at delta {self.delta:.3g}; refused")
        self.extra[(rate, noise_multiplier)] += 1

    def check(self, mechanism: str, rate: float) -> None:
        """Raise PrivacyBudgetExceeded if one more release of ``mechanism`` at ``rate`` would take epsilon
        beyond the target; record nothing. Call before a client is asked to compute (in distributed and local
        noise modes the clients' noised replies are already releases to the server)."""
        self._admit(mechanism, rate, record=False)

    def charge(self, mechanism: str, rate: float) -> None:
        """Record one release of ``mechanism`` at ``rate``, or raise PrivacyBudgetExceeded (recording
        nothing) if it would take epsilon beyond the target. Call before the noised value is released."""
        self._admit(mechanism, rate, record=True)

    def _admit(self, mechanism: str, rate: float, record: bool) -> None:
        if not self.private:
            self.spent[mechanism] += record
            return
        in_plan = self._in_plan(mechanism, rate)
        if in_plan and self._plan_fits():
            self.spent[mechanism] += record
            return
        z = self.noise.get(mechanism, 0.0)
        eps = self._epsilon(self._counts((rate, z)))
        if eps > self.epsilon:
            raise PrivacyBudgetExceeded(
                f"release '{mechanism}' (rate {rate:.6g}, noise multiplier {z:.6g}) would spend epsilon "
                f"{eps:.4f} > target {self.epsilon:g} at delta {self.delta:.3g}; refused")
        if in_plan:
            self.spent[mechanism] += record
        else:
            self.extra[(rate, z)] += record

    def _in_plan(self, mechanism: str, rate: float) -> bool:
        """Whether the plan has room for one more release of ``mechanism`` at ``rate``."""
        m = self.by_name.get(mechanism)
        return m is not None and m.rate == rate and self.spent[mechanism] < self.plan[m]

    def _plan_fits(self) -> bool:
        """True when the releases so far plus the rest of the plan stay within the target, so that a planned
        release is within budget without evaluating epsilon (composition is monotone). Calibration shows it for
        the plan alone; after releases beyond the plan (or lost ones charged on resume) it is evaluated once per
        change of ``extra``."""
        if self.extra == self._fits_with:
            return True
        if self.epsilon_if_completed() > self.epsilon:
            return False
        self._fits_with = Counter(self.extra)
        return True

    def epsilon_spent(self) -> float:
        """Epsilon at the run's delta of every release recorded so far (inf in a non-private run)."""
        if not self.private:
            return math.inf
        return self._epsilon(self._counts())

    def epsilon_if_completed(self) -> float:
        """Epsilon at the run's delta of every release recorded so far plus the rest of the plan (each mechanism's
        planned count minus its releases so far): what finishing the run would spend (inf if not private). A
        resumed run whose lost releases (``record``) push this above the target cannot finish within budget."""
        if not self.private:
            return math.inf
        counts = self._counts()
        for m, planned in self.plan.items():
            counts[(m.rate, self.noise[m.name])] += max(planned - self.spent[m.name], 0)
        return self._epsilon(counts)

    def record(self, rate: float, noise_multiplier: float) -> None:
        """Record one release at (rate, noise multiplier) without any guard: for a ledger that counts what someone
        has already seen (the server's own view in distributed and local noise modes, where z may be 0), and for
        releases already made that a resumed run's checkpoint does not include (``RunDir.journal_since``)."""
        self.extra[(rate, noise_multiplier)] += 1

    def record_seen(self, mechanism: str, rate: float, noise_multiplier: float) -> None:
        """Record, without any guard, one release that someone has already seen (what was seen counts whatever
        the budget says), protected from them by ``noise_multiplier``. It counts as a planned release of
        ``mechanism`` when the plan has room for one more at ``rate`` and ``noise_multiplier`` is at least the
        planned one (more noise only lowers epsilon, so the planned event bounds it), else as a release beyond the
        plan at its own multiplier."""
        if self._in_plan(mechanism, rate) and noise_multiplier >= self.noise[mechanism]:
            self.spent[mechanism] += 1
        else:
            self.extra[(rate, noise_multiplier)] += 1

    def check_spent(self, what: str) -> None:
        """Raise PrivacyBudgetExceeded (naming ``what``, e.g. "against the server") if the releases recorded
        so far spend more than the target; cheap while they stay within the plan (``_plan_fits``), else one
        accountant evaluation. A finite target only; nothing is recorded."""
        if not self.private or self._plan_fits():  # spent never passes the plan (_admit, record_seen)
            return
        eps = self.epsilon_spent()
        if eps > self.epsilon:
            raise PrivacyBudgetExceeded(f"the releases {what} spend epsilon {eps:.4f} > target {self.epsilon:g} at "
                                        f"delta {self.delta:.3g}; refused")

    def state(self) -> dict:
        """JSON-serialisable record of what was spent (for checkpoints)."""
        return {"spent": dict(self.spent), "extra": counts_to_json(self.extra)}

    def load_state(self, state: Mapping) -> None:
        """Restore what ``state`` recorded (resuming from a checkpoint)."""
        self.spent = Counter({k: int(v) for k, v in state["spent"].items()})
        self.extra = counts_from_json(state["extra"])


def counts_to_json(counts: Mapping[tuple[float, float], int]) -> list:
    """(rate, noise multiplier) -> releases as JSON: [[rate, z, count], ...], a non-finite z as the string "inf"
    (JSON has no infinity). Inverse: ``counts_from_json``."""
    return [[r, z if math.isfinite(z) else "inf", n] for (r, z), n in counts.items()]


def counts_from_json(items: list) -> Counter:
    """The Counter that ``counts_to_json`` wrote."""
    return Counter({(float(r), float(z)): int(n) for r, z, n in items})
