"""What the distributed discrete Gaussian (``common.ddg``) costs against the central Gaussian at equal epsilon, on a
plan printed by ``dpdro plan`` (defaults: simulations/configs/mnist-st-eps4-best.toml: n = 30,018, 500 releases of
the gradient at rate 0.06823, GroupNorm CNN d = 26,106, 4 clients, epsilon 4, delta 3.33e-6):
``python -m dpdro.simulations.ddg_cost``.

Prints, for the gradient releases alone: the central noise multiplier z (dp-accounting, PLD and RDP) that spends
epsilon; the DDG's central noise multiplier at the same epsilon (``ddg.ddg_epsilon``: KLS Proposition 14 with
Zhu and Wang's subsampling bound) and that of a Gaussian analysed with the same bound, the granularity chosen so
that rounding inflates the sensitivity by at most 0.5 %; the std of the DDG's released noise (shares plus
rounding) over the central std; and the bits per coordinate for a wrap-around probability of 1e-9 per release,
with the records of one release bounded by the largest shard (worst case, public) and by a Binomial tail bound of
the Poisson sample (public: it depends on the shard size and the rate only).

``--grid`` prints instead a Markdown table over plans (expected batch x releases, the rate = batch / n): both
multipliers, their ratio and the noise std of the mean gradient (z / batch), so that a user of the distributed
mode can pick the plan where Zhu and Wang's general bound costs least (it is nearly tight at small rates)."""

from __future__ import annotations

import argparse
import math

from scipy import optimize, stats

from ..common import ddg
from ..server.ledger import epsilon_of


def central_z(q: float, steps: int, epsilon: float, delta: float, accountant: str) -> float:
    """The Gaussian noise multiplier at which ``steps`` Poisson-subsampled releases spend ``epsilon``."""
    return optimize.brentq(lambda z: epsilon_of({(q, z): steps}, delta, accountant) - epsilon, 0.3, 50, rtol=1e-6)


def ddg_z(q: float, steps: int, epsilon: float, delta: float, c_over_gamma: float, shares: int, dim: int) -> float:
    """The DDG's central noise multiplier sqrt(n) sigma / c' at which the releases spend ``epsilon``."""
    def eps(z: float) -> float:
        sigma = z * c_over_gamma / math.sqrt(shares)
        return ddg.ddg_epsilon([ddg.DdgRelease(q, c_over_gamma, sigma, shares, dim, count=steps)], delta) - epsilon
    return optimize.brentq(eps, 0.3, 50, rtol=1e-5)


def plan_grid(n: int, batches: list[int], steps: list[int], epsilon: float, delta: float, dim: int, clients: int
              ) -> list[str]:
    """Markdown rows, one per (batch, steps): rate, central z (PLD), DDG z, their ratio, z / batch of each."""
    padded = ddg.padded_dim(dim)
    c = ddg.granularity(padded)
    out = ["| releases | expected batch | rate | central z (PLD) | DDG z | DDG / central | central z / batch | "
           "DDG z / batch |", "|---|---|---|---|---|---|---|---|"]
    for t in steps:
        for b in batches:
            q = b / n
            zp, zd = central_z(q, t, epsilon, delta, "pld"), ddg_z(q, t, epsilon, delta, c, clients, padded)
            out.append(f"| {t} | {b} | {q:.4f} | {zp:.3f} | {zd:.3f} | {zd / zp:.2f} | {zp / b:.5f} | "
                       f"{zd / b:.5f} |")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=30018)
    p.add_argument("--rate", type=float, default=0.06822573122792991)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--dim", type=int, default=26106)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--epsilon", type=float, default=4.0)
    p.add_argument("--delta", type=float, default=3.3313345326137653e-06)
    p.add_argument("--wrap", type=float, default=1e-9)
    p.add_argument("--grid", action="store_true", help="a table over plans (--batches x --grid-steps) instead")
    p.add_argument("--batches", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--grid-steps", type=int, nargs="+", default=[100, 200, 500])
    a = p.parse_args(argv)
    if a.grid:
        print("\n".join(plan_grid(a.n, a.batches, a.grid_steps, a.epsilon, a.delta, a.dim, a.clients)))
        return
    dim = ddg.padded_dim(a.dim)
    c = 1.0
    while ddg.rounded_l2_bound(c, dim, math.exp(-0.5)) > 1.005 * c:
        c *= 1.25
    zp, zr = (central_z(a.rate, a.steps, a.epsilon, a.delta, acc) for acc in ("pld", "rdp"))
    zd = ddg_z(a.rate, a.steps, a.epsilon, a.delta, c, a.clients, dim)
    shard = math.ceil(a.n / a.clients)
    tail = int(stats.binom.isf(a.wrap, shard, a.rate)) + 1  # P(sample > tail) < wrap
    sigma = zd * c / math.sqrt(a.clients)
    records = a.rate * a.n  # expected records of one release (all clients): rounding variance R / 4 per coordinate
    released = math.sqrt(a.clients * sigma**2 + records / 4) / c
    print(f"plan: {a.steps} releases at rate {a.rate:.5g}, n {a.n}, d {a.dim} (padded {dim}), {a.clients} clients, "
          f"epsilon {a.epsilon:g}, delta {a.delta:.3g}")
    print(f"central Gaussian z at equal epsilon: PLD {zp:.4f}, RDP {zr:.4f}")
    print(f"DDG: granularity 1/{c:.0f} (rounded sensitivity {ddg.rounded_l2_bound(c, dim, math.exp(-0.5)) / c:.4f} x "
          f"the clip), share sigma {sigma:.1f} grid steps, tau {ddg.tau(sigma, a.clients):.3g}, central z {zd:.4f}")
    zg = ddg_z(a.rate, a.steps, a.epsilon, a.delta, 1e9, 1, 1)  # a Gaussian (tau = 0, no rounding), same bound
    print(f"Gaussian analysed with the DDG's subsampling bound (Zhu and Wang, Theorem 6): z {zg:.4f}")
    print(f"DDG released noise std / central (PLD) std: {released / zp:.4f}; / central (RDP) std: "
          f"{released / zr:.4f}")
    for label, r, p in (("largest shard (worst case)", shard * a.clients, a.wrap),
                        ("Binomial tail bound of each client's sample", tail * a.clients, (1 + a.clients) * a.wrap)):
        bits = ddg.modulus_bits(dim, r, c, sigma, a.clients, a.wrap)
        print(f"bits per coordinate, records bounded by the {label} ({r}): {bits} (wrap-around probability per "
              f"release <= {p:.2g})")


if __name__ == "__main__":
    main()
