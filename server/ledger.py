"""The privacy ledger: planned releases, calibration and a guard, all on Google's dp-accounting.

Contract (ALGORITHMS.md 5.2). Every release is a Poisson-subsampled Gaussian: each record is included
independently with rate r, clipped per-record vectors (norm <= C) are summed and N(0, (z C)^2) noise is
added to the sum. Its DpEvent is PoissonSampledDpEvent(r, GaussianDpEvent(z)). The neighbouring relation
is add/remove one record of the union of all clients' data (the relation Poisson amplification is proved
for); n is public.

- A ``Mechanism`` is a named kind of release (e.g. 'x-refresh') with a sampling rate and a noise multiplier
  relative to the others. An algorithm declares its plan: how many releases of each mechanism.
- ``calibrate`` finds the common scale s (z_k = s * relative_k) at which the plan spends the target epsilon at
  delta, using dp_accounting.mechanism_calibration (Brent's method), then moves s up until epsilon lands in
  [0.99 target, target].
- ``Ledger`` records releases as they happen. Its guard allows a release when the releases so far plus this
  one are still within the calibrated plan (composition is monotone, so epsilon <= epsilon(plan) <= target);
  anything outside the plan is allowed only if the exact epsilon with it stays within the target.
- Runs of identical events are composed as SelfComposedDpEvent(event, count), so the cost of an epsilon
  evaluation grows with the number of distinct mechanisms, not with the number of iterations.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import dp_accounting
from dp_accounting import mechanism_calibration
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant


class PrivacyBudgetExceeded(RuntimeError):
    """A release would make epsilon exceed the run's target; it was refused and nothing was released."""


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
    """A fresh dp-accounting accountant ('rdp' or 'pld', add/remove adjacency)."""
    if kind == "rdp":
        return rdp_privacy_accountant.RdpAccountant()
    if kind == "pld":
        return pld_privacy_accountant.PLDAccountant()
    raise ValueError(f"unknown accountant {kind!r}; allowed: rdp, pld")


def release_event(rate: float, noise_multiplier: float) -> dp_accounting.DpEvent:
    """DpEvent of one Poisson-subsampled Gaussian release (z = 0 means no noise: infinite epsilon)."""
    return dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(noise_multiplier))


def composed_event(counts: Mapping[tuple[float, float], int]) -> dp_accounting.DpEvent:
    """One event for many releases: counts maps (rate, noise multiplier) -> number of releases."""
    events = [dp_accounting.SelfComposedDpEvent(release_event(r, z), c)
              for (r, z), c in sorted(counts.items()) if c > 0]
    return dp_accounting.ComposedDpEvent(events)


def epsilon_of(counts: Mapping[tuple[float, float], int], delta: float, accountant: str = "rdp") -> float:
    """Epsilon at ``delta`` of the composition of the releases in ``counts`` (0 for no release)."""
    if not any(counts.values()):
        return 0.0
    if any(z <= 0 for (_, z), c in counts.items() if c > 0):
        return math.inf
    acc = make_accountant(accountant)
    acc.compose(composed_event(counts))
    return float(acc.get_epsilon(delta))


def plan_counts(plan: Mapping[Mechanism, int], scale: float) -> Counter:
    """(rate, z) -> count for a plan at common noise scale ``scale``."""
    counts: Counter = Counter()
    for mech, n in plan.items():
        counts[(mech.rate, mech.noise_at(scale))] += n
    return counts


def calibrate(plan: Mapping[Mechanism, int], epsilon: float, delta: float, accountant: str = "rdp") -> float:
    """The common noise scale s at which ``plan`` spends epsilon in [0.99 epsilon, epsilon] at ``delta``.

    Raises ValueError for a non-positive or infinite target, or an empty plan.
    """
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(f"calibration needs a finite target epsilon > 0, got {epsilon}")
    if not any(n for m, n in plan.items() if m.fixed_noise is None):
        raise ValueError("calibration needs a plan with at least one release")
    fixed = {m: n for m, n in plan.items() if m.fixed_noise is not None}
    if fixed and epsilon_of(plan_counts(fixed, 1.0), delta, accountant) >= epsilon:
        raise ValueError(f"the one-off releases ({', '.join(m.name for m in fixed)}) alone spend epsilon >= "
                         f"{epsilon:g}: raise their noise multipliers or the target")

    def event_at(scale: float) -> dp_accounting.DpEvent:
        return composed_event(plan_counts(plan, max(scale, 1e-9)))

    scale = mechanism_calibration.calibrate_dp_mechanism(
        lambda: make_accountant(accountant), event_at, epsilon, delta,
        mechanism_calibration.LowerEndpointAndGuess(1e-3, 1.0), tol=1e-7)
    # Brent lands within tol of the root, possibly on the overspending side: step up until within target.
    for _ in range(200):
        if epsilon_of(plan_counts(plan, scale), delta, accountant) <= epsilon:
            break
        scale *= 1.0005
    return float(scale)


class Ledger:
    """Records the run's releases and guards the budget.

    Args:
        plan: mechanism -> planned number of releases (with calibrated noise multipliers ``noise``).
        noise: mechanism name -> noise multiplier z (0 in a non-private run).
        epsilon, delta: the target; epsilon = inf means a non-private run (nothing is refused, the
            reported epsilon is inf).
        accountant: 'rdp' or 'pld'.
    """

    def __init__(self, plan: Mapping[Mechanism, int], noise: Mapping[str, float], epsilon: float,
                 delta: float, accountant: str = "rdp") -> None:
        self.plan = dict(plan)
        self.noise = dict(noise)
        self.epsilon = epsilon
        self.delta = delta
        self.accountant = accountant
        self.by_name = {m.name: m for m in plan}
        self.spent: Counter = Counter()  # mechanism name -> releases made
        self.extra: Counter = Counter()  # (rate, z) -> releases made beyond the plan

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
        m = self.by_name.get(mechanism)
        if m is not None and m.rate == rate and self.spent[mechanism] < self.plan[m]:
            self.spent[mechanism] += record
            return
        z = self.noise.get(mechanism, 0.0)
        eps = epsilon_of(self._counts((rate, z)), self.delta, self.accountant)
        if eps > self.epsilon:
            raise PrivacyBudgetExceeded(
                f"release '{mechanism}' (rate {rate:.6g}, noise multiplier {z:.6g}) would spend epsilon "
                f"{eps:.4f} > target {self.epsilon:g} at delta {self.delta:.3g}; refused")
        self.extra[(rate, z)] += record

    def epsilon_spent(self) -> float:
        """Epsilon at the run's delta of every release recorded so far (inf in a non-private run)."""
        if not self.private:
            return math.inf
        return epsilon_of(self._counts(), self.delta, self.accountant)

    def state(self) -> dict:
        """JSON-serialisable record of what was spent (for checkpoints)."""
        return {"spent": dict(self.spent), "extra": [[r, z, n] for (r, z), n in self.extra.items()]}

    def load_state(self, state: Mapping) -> None:
        """Restore what ``state`` recorded (resuming from a checkpoint)."""
        self.spent = Counter({k: int(v) for k, v in state["spent"].items()})
        self.extra = Counter({(float(r), float(z)): int(n) for r, z, n in state["extra"]})
