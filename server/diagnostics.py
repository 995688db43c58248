"""Noise diagnostics of the releases (docs/explanation/ALGORITHMS.md 5.4, "SPIDER only helps in its regime"); every
value is computed from public quantities (noise multipliers, clip bounds, expected batch sizes) or from the
noisy releases themselves, so logging them costs no privacy.

A SPIDER difference release adds noise of std z_d C_t / N_d to the estimator, and the noise of every
difference of a phase accumulates on top of the refresh's z_r C / N_r. Per difference release the monitor
records the ratio rho_t = (z_d C_t / N_d) / (z_r C / N_r) to the latest refresh of the same block; at the end
of each phase it records sqrt(sum_t rho_t^2), the accumulated difference noise in units of the refresh noise.
A phase whose value exceeds 1 ended with more noise from its differences than from its refresh: the
differences added more noise than they saved, and the monitor counts (and the engine logs) such phases.
"""

from __future__ import annotations

import math
from collections import defaultdict

DIFF, REFRESH = "diff", "refresh"


def refresh_of(mechanism: str) -> str | None:
    """The refresh mechanism paired with a difference mechanism ('x-diff' -> 'x-refresh', 'diff' ->
    'refresh'), or None if ``mechanism`` is not a difference."""
    return mechanism.replace(DIFF, REFRESH) if DIFF in mechanism else None


def planned_phase_ratio(q: int, z_diff: float, clip_max: float, batch_diff: float, z_ref: float, clip_ref: float,
                        batch_ref: float) -> float:
    """The accumulated difference noise of a full phase of length q in units of the refresh noise when every
    difference clip sits at its cap C_max: sqrt(q - 1) (z_d C_max / N_d) / (z_r C / N_r)."""
    return math.sqrt(max(q - 1, 0)) * (z_diff * clip_max / batch_diff) / (z_ref * clip_ref / batch_ref)


class NoiseMonitor:
    """Follows the release events of a run (dicts with 'mechanism' and 'noise_std_of_mean')."""

    def __init__(self) -> None:
        self.refresh_std: dict[str, float] = {}
        self.phase_sq: dict[str, float] = defaultdict(float)
        self.phase_ratios: list[float] = []
        self.window: dict[str, list[float]] = defaultdict(list)  # values since the last ``take_window``

    def observe(self, event: dict) -> dict:
        """Record one release; returns the event with 'noise_ratio_to_refresh' added for a difference."""
        mech, std = event["mechanism"], float(event["noise_std_of_mean"])
        ref = refresh_of(mech)
        if ref is None:
            self._close_phase(mech)
            self.refresh_std[mech] = std
        elif self.refresh_std.get(ref, 0.0) > 0:
            ratio = std / self.refresh_std[ref]
            self.phase_sq[mech] += ratio**2
            self.window[f"noise_ratio_{mech}"].append(ratio)
            event = {**event, "noise_ratio_to_refresh": ratio}
        if event.get("clipped_fraction") is not None:
            self.window[f"clipped_{mech}"].append(float(event["clipped_fraction"]))
        return event

    def _close_phase(self, refresh: str) -> None:
        for mech in [k for k in self.phase_sq if refresh_of(k) == refresh]:
            self.phase_ratios.append(math.sqrt(self.phase_sq.pop(mech)))

    def close(self) -> None:
        """End the run: close every open phase."""
        for mech in list(self.phase_sq):
            self.phase_ratios.append(math.sqrt(self.phase_sq.pop(mech)))

    def state(self) -> dict:
        """Everything the monitor carries between releases, as JSON (checkpointed: a resumed run needs the
        latest refresh std of each block, the open phases, the closed ones and the metrics window)."""
        return {"refresh_std": dict(self.refresh_std), "phase_sq": dict(self.phase_sq),
                "phase_ratios": list(self.phase_ratios), "window": {k: list(v) for k, v in self.window.items()}}

    @classmethod
    def from_state(cls, state: dict) -> NoiseMonitor:
        """A monitor continuing from ``state()`` (an empty dict gives a fresh one)."""
        def num(v) -> float:  # the checkpoint's JSON holds NaN as null (rundir._jsonable), inf as "inf"
            return math.nan if v is None else float(v)

        monitor = cls()
        monitor.refresh_std = {k: num(v) for k, v in state.get("refresh_std", {}).items()}
        monitor.phase_sq.update({k: num(v) for k, v in state.get("phase_sq", {}).items()})
        monitor.phase_ratios = [num(r) for r in state.get("phase_ratios", [])]
        monitor.window.update({k: [num(x) for x in v] for k, v in state.get("window", {}).items()})
        return monitor

    def take_window(self) -> dict[str, float]:
        """Means of the per-release values since the last call (for a metrics row), then reset."""
        out = {k: sum(v) / len(v) for k, v in self.window.items() if v}
        self.window = defaultdict(list)
        return out

    def noise_dominated_phases(self) -> int:
        """Closed phases whose accumulated difference noise exceeded their refresh noise."""
        return sum(r > 1.0 for r in self.phase_ratios)

    def summary(self) -> dict:
        """Closed phases, how many ended with more difference noise than refresh noise, and the mean ratio."""
        k = len(self.phase_ratios)
        return {"phases": k, "phases_noise_dominated": self.noise_dominated_phases(),
                "mean_phase_noise_ratio": (sum(self.phase_ratios) / k) if k else None}
