"""The distributed discrete Gaussian (DDG) of Kairouz, Liu and Steinke, "The Distributed Discrete Gaussian Mechanism
for Federated Learning with Secure Aggregation" (ICML 2021, arXiv:2102.06387; "KLS" below): the core of a
noise mode whose epsilon holds for what secure aggregation actually sums, a wrapped integer vector.

One release of a sum of records' clipped vectors (each of L2 norm <= c, in units of the query's sensitivity S, so
c = 1) goes, on each client, through

1. scaling by 1 / gamma (gamma the granularity: the integer grid's step in units of S) and the *randomised Hadamard
   rotation* x -> H D x (D a diagonal of public random signs shared by every client and the server, H the
   normalised Walsh-Hadamard matrix of size d' = the next power of two >= d; KLS sec. 4.1, ``rotate``), which
   spreads every vector evenly over the coordinates so that few bits suffice;
2. *conditional randomised rounding* of each record's vector to the integer grid: unbiased randomised rounding
   repeated until the rounded vector's L2 norm is at most ``rounded_l2_bound`` (KLS Proposition 22 / their
   ``rounded_l2_norm_bound``, with retry probability at most beta), so that one record moves the integer sum by
   at most Delta_2 in L2 (and Delta_1 = min(sqrt(d') Delta_2, Delta_2^2) in L1) — a record replaced with the
   null record (the zero vector, rounded to 0) changes the integer sum by its rounded vector;
3. the sum over the client's sampled records, plus a *discrete Gaussian share* N_Z(0, sigma^2)^d' per client
   (``discrete_gaussian``: Canonne, Kamath and Steinke, "The discrete Gaussian for differential privacy",
   NeurIPS 2020, Algorithm 3, rejection from the discrete Laplace), reduced modulo 2^b.

The server sums the clients' vectors modulo 2^b (what SecAgg+ computes), maps the result to [-2^(b-1), 2^(b-1)),
undoes the rotation and multiplies by gamma (``decode``). Privacy: the sum of n discrete Gaussian shares is not a
discrete Gaussian, but KLS Theorem 1 / Proposition 14 bound its Renyi DP (``ddg_rdp``), with the inflation
tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1)) (``tau``). The modular reduction and the decoding are
post-processing of the integer sum, so a wrap-around costs accuracy, never privacy; ``modulus_bits`` chooses b
so that it happens with at most a stated probability. Poisson subsampling (rate q) of the records is amplified
with the general bound for any RDP mechanism of Zhu and Wang, "Poisson subsampled Renyi differential privacy"
(ICML 2019, Theorem 6; ``subsampled_rdp``): the subsampled-Gaussian analysis of the ledger does not apply to a
discrete mechanism. ``ddg_epsilon`` composes releases and converts with dp-accounting's RDP-to-(epsilon, delta)
conversion (``rdp_privacy_accountant.compute_epsilon``).

The noise vector's floating-point caveat (Mironov 2012) does not arise: every draw is an integer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import linalg, special

from .errors import RunFailed
from .rng import csprng_uniform

#: integer Renyi orders (Zhu and Wang's bound needs integers), as KLS' accounting code uses
RDP_ORDERS = tuple(range(2, 129)) + (256,)

Uniform = Callable[[int], np.ndarray]  # k -> (k,) float64 uniforms on (0, 1]


def uniform_from(rng: np.random.Generator | None) -> Uniform:
    """The uniform source of the samplers: ``rng``'s (1 - rng.random(k), on (0, 1]) or, with rng None, the OS
    CSPRNG's (``rng.csprng_uniform``: config key secure-noise)."""
    if rng is None:
        return csprng_uniform
    return lambda k: 1.0 - rng.random(k)


def discrete_gaussian(sigma: float, size: int, uniform: Uniform) -> np.ndarray:
    """(size,) int64 draws of the discrete Gaussian N_Z(0, sigma^2) (P(x) proportional to exp(-x^2 / (2 sigma^2))
    on the integers), by Canonne, Kamath and Steinke (2020), Algorithm 3: t = floor(sigma) + 1, Y from the discrete
    Laplace of scale t (the difference of two geometric draws, P(G >= k) = exp(-k / t)), accepted with probability
    exp(-(|Y| - sigma^2 / t)^2 / (2 sigma^2)); the expected number of tries per draw is below 2 for sigma >= 1.
    The acceptance test is computed in float64 (CKS's exact rational arithmetic is not reproduced). ValueError
    unless sigma is finite and > 0."""
    if not (math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"discrete Gaussian sigma must be finite and > 0, got {sigma}")
    t = math.floor(sigma) + 1
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        k = max(2 * (size - filled), 16)
        g1 = np.floor(-t * np.log(uniform(k)))
        g2 = np.floor(-t * np.log(uniform(k)))
        y = g1 - g2
        accept = uniform(k) <= np.exp(-((np.abs(y) - sigma**2 / t) ** 2) / (2 * sigma**2))
        got = y[accept].astype(np.int64)[: size - filled]
        out[filled:filled + len(got)] = got
        filled += len(got)
    return out


def padded_dim(d: int) -> int:
    """d', the smallest power of two >= d (the Walsh-Hadamard transform's length). ValueError for d < 1."""
    if d < 1:
        raise ValueError(f"dimension must be >= 1, got {d}")
    return 1 << (d - 1).bit_length()


def hadamard(x: np.ndarray) -> np.ndarray:
    """The normalised Walsh-Hadamard transform H x / sqrt(d') along the last axis (length d', a power of two),
    float64, O(d' log d'); orthonormal and its own inverse. ValueError for a length that is not a power of two."""
    y = np.array(x, dtype=np.float64)
    lead, n = y.shape[:-1], y.shape[-1]
    if n & (n - 1) or n == 0:
        raise ValueError(f"Hadamard transform needs a power-of-two length, got {n}")
    low = min(n, 128)  # the butterflies of the low bits at once, as one product with the dense H_128 (BLAS)
    y = (y.reshape(-1, low) @ linalg.hadamard(low).astype(np.float64)).reshape(-1, n)
    h = low
    while h < n:  # the others in place: (a, b) -> (a + b, a - b) on blocks of 2 h
        view = y.reshape(-1, n // (2 * h), 2, h)
        a, b = view[:, :, 0, :], view[:, :, 1, :]
        a += b
        b *= -2.0
        b += a
        h *= 2
    y = y.reshape(*lead, n)
    return y / math.sqrt(n)


def rotation_signs(d: int, rng: np.random.Generator) -> np.ndarray:
    """(d',) float64 of public random signs +-1 (the diagonal D), d' = ``padded_dim(d)``; every client and the
    server must use the same ``rng`` state (in a run: derived from the seed, the iteration and the mechanism —
    public, like the rotation itself)."""
    return rng.choice(np.array([-1.0, 1.0]), size=padded_dim(d))


def rotate(x: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """H D x along the last axis: ``x`` (..., d) zero-padded to d' = len(signs); float64 (..., d')."""
    d = x.shape[-1]
    padded = np.zeros((*x.shape[:-1], len(signs)), dtype=np.float64)
    padded[..., :d] = x
    return hadamard(padded * signs)


def unrotate(y: np.ndarray, signs: np.ndarray, d: int) -> np.ndarray:
    """D H y, cut to the first d coordinates: the inverse of ``rotate`` (H and D are their own inverses)."""
    return (hadamard(y) * signs)[..., :d]


def rounded_l2_bound(c: float, d: int, beta: float) -> float:
    """Delta_2, the L2 norm that conditional randomised rounding guarantees for a vector of norm <= c on the
    integer grid in d dimensions (KLS Proposition 22): min(c + sqrt(d), sqrt(c^2 + d / 4 + sqrt(2 ln(1 / beta))
    (c + sqrt(d) / 2))), the second term only for beta > 0 (beta bounds each retry's probability). ValueError
    unless c > 0, d >= 1 and 0 <= beta < 1."""
    if not (c > 0 and d >= 1 and 0 <= beta < 1):
        raise ValueError(f"rounded_l2_bound needs c > 0, d >= 1, 0 <= beta < 1; got c={c}, d={d}, beta={beta}")
    first = c + math.sqrt(d)
    if beta == 0:
        return first
    second = math.sqrt(c * c + d / 4 + math.sqrt(2 * math.log(1 / beta)) * (c + math.sqrt(d) / 2))
    return min(first, second)


def rounded_l1_bound(l2_bound: float, d: int) -> float:
    """Delta_1 <= min(sqrt(d) Delta_2, Delta_2^2) for an integer vector of L2 norm Delta_2 (each non-zero
    coordinate is at least 1 in magnitude)."""
    return l2_bound * min(math.sqrt(d), l2_bound)


def conditional_round(x: np.ndarray, bound: float, uniform: Uniform, max_tries: int = 1000) -> np.ndarray:
    """Conditional randomised rounding of the rows of ``x`` (B, d'): each coordinate rounded to floor or ceil
    with the probabilities that make it unbiased, each row redrawn until its L2 norm is <= ``bound`` (KLS sec.
    4.1). Returns int64 (B, d'). RuntimeError if a row still exceeds it after ``max_tries`` (with ``bound`` from
    ``rounded_l2_bound`` and rows of norm <= c the chance of a retry is below beta, so this never happens for
    valid input)."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float64))
    low = np.floor(x)
    frac = x - low
    out = np.empty(x.shape, dtype=np.int64)
    todo = np.arange(len(x))
    for _ in range(max_tries):
        up = uniform(todo.size * x.shape[1]).reshape(todo.size, x.shape[1]) <= frac[todo]
        rounded = low[todo] + up
        ok = np.sqrt(np.sum(rounded * rounded, axis=1)) <= bound
        out[todo[ok]] = rounded[ok].astype(np.int64)
        todo = todo[~ok]
        if todo.size == 0:
            return out
    raise RuntimeError(f"conditional rounding: {todo.size} row(s) still above the bound {bound:.6g} after "
                       f"{max_tries} tries (rows of norm above the clip?)")


def tau(sigma: float, shares: int) -> float:
    """KLS Theorem 1's inflation for the sum of ``shares`` discrete Gaussians N_Z(0, sigma^2) (sigma in grid
    units): 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1)); 0 for one share (a single discrete Gaussian)."""
    return 10.0 * sum(math.exp(-2 * math.pi**2 * sigma**2 * k / (k + 1)) for k in range(1, shares))


def ddg_rdp(order: float, l2_sens: float, l1_sens: float, sigma: float, shares: int, dim: int) -> float:
    """Renyi DP of order ``order`` (> 1) of one release of the DDG sum (no subsampling), KLS Proposition 14 (their
    eq. 17): min(a/2 l2^2 + tau d, a/2 (l2^2 + 2 l1 tau + tau^2 d), a/2 (l2 + sqrt(d) tau)^2), with l2 = Delta_2 /
    (sqrt(n) sigma), l1 = Delta_1 / (sqrt(n) sigma), tau = ``tau(sigma, n)``, d = ``dim`` (the padded dimension);
    sensitivities and sigma in grid units. With tau = 0 it is the Gaussian mechanism's a / (2 z^2), z = sqrt(n)
    sigma / Delta_2."""
    if order <= 1:
        raise ValueError(f"Renyi order must be > 1, got {order}")
    central = math.sqrt(shares) * sigma
    l2, l1, t = l2_sens / central, l1_sens / central, tau(sigma, shares)
    return min(order / 2 * l2**2 + t * dim, order / 2 * (l2**2 + 2 * l1 * t + t * t * dim),
               order / 2 * (l2 + math.sqrt(dim) * t) ** 2)


def subsampled_rdp(order: int, q: float, rdp: Callable[[int], float]) -> float:
    """Upper bound on the order-``order`` Renyi DP of a mechanism of RDP curve ``rdp`` applied to a Poisson sample
    of rate q (Zhu and Wang, ICML 2019, Theorem 6; valid for any mechanism, integer orders >= 2):
    1/(a-1) log[(1-q)^(a-1) (a q - q + 1) + C(a,2) q^2 (1-q)^(a-2) e^{rdp(2)}
    + 3 sum_{l=3}^{a} C(a,l) q^l (1-q)^(a-l) e^{(l-1) rdp(l)}], never above rdp(a). q = 1 gives rdp(a)."""
    if not (isinstance(order, int) and order >= 2):
        raise ValueError(f"the subsampled bound needs an integer order >= 2, got {order}")
    if not 0 < q <= 1:
        raise ValueError(f"sampling rate must be in (0, 1], got {q}")
    if q == 1:
        return rdp(order)
    logs = [math.log((1 - q) ** (order - 1) * (order * q - q + 1)),
            math.log(special.comb(order, 2)) + 2 * math.log(q) + (order - 2) * math.log1p(-q) + rdp(2)]
    weights = [1.0, 1.0]
    for ell in range(3, order + 1):
        logs.append((ell - 1) * rdp(ell) + math.log(special.comb(order, ell)) + ell * math.log(q)
                    + (order - ell) * math.log1p(-q))
        weights.append(3.0)
    return min(float(special.logsumexp(logs, b=weights)) / (order - 1), rdp(order))


@dataclass(frozen=True)
class DdgRelease:
    """One kind of DDG release, all in grid units (a record's vector is c / gamma long before rounding): ``q`` the
    Poisson sampling rate, ``c_over_gamma`` = clip / gamma (c = 1 in units of S), ``sigma`` each share's discrete
    Gaussian std, ``shares`` the number of shares in the released sum, ``dim`` the padded dimension d', ``beta``
    the rounding's retry bound, ``count`` how many such releases."""

    q: float
    c_over_gamma: float
    sigma: float
    shares: int
    dim: int
    beta: float = math.exp(-0.5)
    count: int = 1

    @property
    def l2_sens(self) -> float:
        """Delta_2 after conditional rounding (``rounded_l2_bound``)."""
        return rounded_l2_bound(self.c_over_gamma, self.dim, self.beta)

    def rdp(self, order: int) -> float:
        """RDP of ``count`` releases at ``order``: subsampled (``subsampled_rdp``) ``ddg_rdp``, times count."""
        l2 = self.l2_sens
        l1 = rounded_l1_bound(l2, self.dim)
        return self.count * subsampled_rdp(order, self.q, lambda a: ddg_rdp(a, l2, l1, self.sigma, self.shares,
                                                                           self.dim))


def ddg_epsilon(releases: Sequence[DdgRelease], delta: float, orders: Sequence[int] = RDP_ORDERS) -> float:
    """Epsilon at ``delta`` of the composition of ``releases`` (RDP adds up over releases), converted by
    dp-accounting's ``rdp_privacy_accountant.compute_epsilon`` (the conversion its RdpAccountant uses)."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    rdp = [sum(r.rdp(a) for r in releases) for a in orders]
    return float(compute_epsilon(list(orders), rdp, delta)[0])


def modulus_bits(dim: int, records: int, c_over_gamma: float, sigma: float, shares: int, wrap_probability: float
                 ) -> int:
    """b, the fewest bits per coordinate such that the sum modulo 2^b wraps around with probability at most
    ``wrap_probability`` (over the rotation, the rounding and the noise; the data are arbitrary).

    Each coordinate of the rotated, rounded, noised sum is sub-Gaussian with variance proxy
    V = R^2 c'^2 / d' + R / 4 + n sigma^2: the rotation of a fixed vector of norm <= R c' (R = ``records``, the
    most records in one release's sum, c' = c / gamma) has coordinates sub-Gaussian with proxy (R c')^2 / d'
    (a Rademacher sum, KLS Lemma 29 with flatness 1); each record's rounding error is in [-1, 1] with mean 0
    (proxy 1/4 per record); a discrete Gaussian of parameter sigma is sub-Gaussian with proxy sigma^2 (Canonne,
    Kamath and Steinke 2020, Corollary 9). A union bound over the d' coordinates: no coordinate reaches t =
    sqrt(2 V ln(2 d' / p)) except with probability p, and 2^b >= 2 t + 1 keeps [-t, t] apart modulo 2^b. (The
    conditioning of the rounding on its norm is ignored here, as in KLS' own choice of the modulus; it changes
    each coordinate's error only by the rare retries.) ValueError for p outside (0, 1)."""
    if not 0 < wrap_probability < 1:
        raise ValueError(f"wrap probability must be in (0, 1), got {wrap_probability}")
    v = records**2 * c_over_gamma**2 / dim + records / 4 + shares * sigma**2
    t = math.sqrt(2 * v * math.log(2 * dim / wrap_probability))
    return math.ceil(math.log2(2 * t + 1))


def encode(rows: np.ndarray, scale: float, signs: np.ndarray, bound: float, sigma: float, bits: int,
           uniform: Uniform) -> np.ndarray:
    """A client's share of one release: its sampled records' clipped vectors ``rows`` (B, d), in units of the
    sensitivity (norm <= 1), scaled by ``scale`` = 1 / gamma, rotated (``rotate``), rounded conditionally on norm
    <= ``bound`` (``conditional_round``), summed, plus N_Z(0, sigma^2)^d' (``discrete_gaussian``), modulo 2^bits:
    uint64 (d',). Nothing here depends on the number of records beyond the sum."""
    dim = len(signs)
    total = np.zeros(dim, dtype=np.int64)
    if len(rows):
        total += conditional_round(rotate(np.asarray(rows, dtype=np.float64) * scale, signs), bound,
                                   uniform).sum(axis=0)
    total += discrete_gaussian(sigma, dim, uniform)
    return np.mod(total, 1 << bits).astype(np.uint64)


def modular_sum(shares: Sequence[np.ndarray], bits: int) -> np.ndarray:
    """The sum of the clients' shares modulo 2^bits (what secure aggregation reveals), uint64 (d',)."""
    total = np.zeros_like(shares[0], dtype=np.uint64)
    for s in shares:
        total = (total + s) % np.uint64(1 << bits)
    return total


def decode(total: np.ndarray, scale: float, signs: np.ndarray, d: int, bits: int) -> np.ndarray:
    """The released sum (d,) float64 in units of the sensitivity from the modular sum ``total``: centred to
    [-2^(bits-1), 2^(bits-1)), unrotated (``unrotate``) and divided by ``scale``."""
    m = 1 << bits
    centred = total.astype(np.int64)
    centred = np.where(centred >= m // 2, centred - m, centred)
    return unrotate(centred.astype(np.float64), signs, d) / scale


def check_shares(planned: int, present: int, policy: str) -> int:
    """What a release does when only ``present`` of the ``planned`` shares are in the sum (nodes that dropped out
    after their shares were fixed): 'refuse' raises ShareShortfall (nothing is released); 'charge' returns
    ``present``, the number of shares the release is charged for (``DdgRelease.shares``: less noise, so more
    epsilon). ValueError for another policy."""
    if policy not in ("refuse", "charge"):
        raise ValueError(f"dropout policy must be 'refuse' or 'charge', got {policy!r}")
    if present >= planned:
        return present
    if policy == "refuse" or present < 1:
        raise ShareShortfall(f"only {present} of {planned} noise shares are in the sum; the release is refused "
                             "(policy 'refuse'; nothing was released)")
    return present


class ShareShortfall(RunFailed):
    """A DDG release missing noise shares under the 'refuse' dropout policy: nothing was released."""


#: how much conditional rounding may inflate the sensitivity: the granularity is chosen so that
#: Delta_2 <= (1 + ROUNDING_INFLATION) c' (``granularity``)
ROUNDING_INFLATION = 0.005
#: KLS' retry bound of conditional rounding (their default beta = e^-0.5)
BETA = math.exp(-0.5)


def granularity(dim: int, beta: float = BETA, inflation: float = ROUNDING_INFLATION) -> float:
    """c' = c / gamma, the clip in grid units, smallest such that conditional rounding in ``dim`` (padded)
    dimensions inflates the L2 sensitivity by at most ``inflation``: rounded_l2_bound(c', dim, beta) <= (1 +
    inflation) c'. Solves (a c'^2 - s c' - (d/4 + s sqrt(d)/2) >= 0, a = (1 + inflation)^2 - 1, s = sqrt(2 ln(1 /
    beta))) for the second term of KLS Proposition 22 (the first, c' + sqrt(d), needs c' >= sqrt(d) / inflation,
    far larger). Example: d' = 32,768 gives c' = 913. ValueError unless dim >= 1, 0 < beta < 1, inflation > 0."""
    if not (dim >= 1 and 0 < beta < 1 and inflation > 0):
        raise ValueError(f"granularity needs dim >= 1, 0 < beta < 1, inflation > 0; got {dim}, {beta}, {inflation}")
    a = (1 + inflation) ** 2 - 1
    s = math.sqrt(2 * math.log(1 / beta))
    c = (s + math.sqrt(s * s + 4 * a * (dim / 4 + s * math.sqrt(dim) / 2))) / (2 * a)
    c *= 1 + 1e-12  # the float solution may sit a hair below the root
    assert rounded_l2_bound(c, dim, beta) <= (1 + inflation) * c
    return c


@dataclass(frozen=True)
class DdgGeometry:
    """What a run's DDG accounting holds fixed: ``c_over_gamma`` c' (``granularity``), ``dim`` the largest padded
    dimension of a release (the model's, count coordinate included), ``shares`` m the number of client shares each
    share's noise is calibrated for, ``beta`` the rounding's retry bound.

    A release at noise multiplier z (in units of the clip, the ledger's currency) is the DDG with shares of std
    sigma = z c' / sqrt(m) (``sigma``). A release that summed only k < m shares of that sigma (dropouts, policy
    'charge') is charged at z sqrt(k / m) (``shortfall_multiplier``): read back through ``sigma`` with m shares
    it is the DDG of sigma sqrt(k / m) < sigma with m > k shares, whose Gaussian term is exactly the k shares'
    (sqrt(m) sigma sqrt(k / m) = sqrt(k) sigma) and whose inflation tau (KLS Theorem 1, increasing in the number of
    shares and decreasing in sigma) is at least theirs: an upper bound on the epsilon of what was released.
    Likewise a release of smaller dimension than ``dim`` is bounded by the one of ``dim`` (Delta_2, Delta_1 and
    the tau d term all grow with d)."""

    c_over_gamma: float
    dim: int
    shares: int
    beta: float = BETA

    def sigma(self, noise_multiplier: float) -> float:
        """Each share's discrete Gaussian std in grid units, z c' / sqrt(m)."""
        return noise_multiplier * self.c_over_gamma / math.sqrt(self.shares)

    def shortfall_multiplier(self, noise_multiplier: float, present: int) -> float:
        """The multiplier a release with ``present`` = k of the m shares is charged at: z sqrt(min(k, m) / m)."""
        return noise_multiplier * math.sqrt(min(present, self.shares) / self.shares)

    def release(self, rate: float, noise_multiplier: float, count: int = 1) -> DdgRelease:
        """``count`` releases at (rate, z) as a ``DdgRelease`` of this geometry."""
        return DdgRelease(rate, self.c_over_gamma, self.sigma(noise_multiplier), self.shares, self.dim, self.beta,
                          count)

    def epsilon(self, items: Sequence[tuple[float, float, int]], delta: float) -> float:
        """Epsilon at ``delta`` of (rate, z, count) releases (``ddg_epsilon``); inf if some z <= 0, 0 for none."""
        items = [(r, z, c) for r, z, c in items if c > 0]
        if not items:
            return 0.0
        if any(z <= 0 or not math.isfinite(z) for _, z, _ in items):
            return math.inf
        return ddg_epsilon([self.release(r, z, c) for r, z, c in items], delta)


def record_bound(n: int, rate: float, wrap_probability: float) -> int:
    """R, a public bound on the records one release sums (all clients together): with Poisson sampling at
    ``rate`` of n records the count is Binomial(n, rate), and P(count > R) <= ``wrap_probability`` (scipy's
    inverse survival function, plus one); n itself for rate 1. Depends on n and the rate only, never on the
    data."""
    from scipy import stats

    if rate >= 1:
        return n
    return min(n, int(stats.binom.isf(wrap_probability, n, rate)) + 1)


def release_bits(out_dim: int, n: int, rate: float, c_over_gamma: float, sigma: float, shares: int,
                 wrap_probability: float) -> int:
    """Bits per coordinate of one release of ``out_dim`` coordinates at ``rate`` over n records: half the wrap
    probability for more records than ``record_bound``, half for a coordinate past the range (``modulus_bits``)
    with that many records."""
    records = record_bound(n, rate, wrap_probability / 2)
    return modulus_bits(padded_dim(out_dim), records, c_over_gamma, sigma, shares, wrap_probability / 2)


def rotate_rows(x: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """``rotate`` of the rows of x (B, d) computed faster for a client's records: H_{d'} = H_a (x) H_b (a b = d',
    Kronecker product of Sylvester Hadamard matrices), so each padded row, read as an (a, b) matrix X, maps to
    H_a X H_b / sqrt(d'), two batched float32 matrix products (torch). float64 (B, d') out. The float32 error
    (relative ~1e-6 of a coordinate) touches only the rounding's unbiasedness, never privacy: conditional
    rounding bounds the norm of the integer vector itself."""
    import torch

    n = len(signs)
    k = n.bit_length() - 1
    a, b = 1 << ((k + 1) // 2), 1 << (k // 2)
    padded = np.zeros((len(x), n), dtype=np.float32)
    padded[:, :x.shape[1]] = x
    padded *= signs.astype(np.float32)
    ha = torch.from_numpy(linalg.hadamard(a).astype(np.float32))
    hb = torch.from_numpy(linalg.hadamard(b).astype(np.float32))
    y = (ha @ torch.from_numpy(padded).reshape(-1, a, b) @ hb).reshape(len(x), n)
    return y.numpy().astype(np.float64) / math.sqrt(n)


def round_rows(rows: np.ndarray, scale: float, signs: np.ndarray, bound: float, uniform: Uniform,
               max_tries: int = 1000) -> np.ndarray:
    """The integer sum (d',) int64 of rows (B, d) in units of the sensitivity (norm <= 1): scaled by ``scale``,
    rotated (``rotate_rows``) and conditionally rounded as ``conditional_round`` does (each row redrawn until its
    L2 norm is <= ``bound``; RuntimeError after ``max_tries``), summed in float64 (exact: integers below 2^53).
    ``encode``'s step 2; call it chunk by chunk and add the results."""
    if not len(rows):
        return np.zeros(len(signs), dtype=np.int64)
    x = rotate_rows(np.asarray(rows, dtype=np.float64) * scale, signs)
    low = np.floor(x)
    frac = x - low
    total = np.zeros(x.shape[1], dtype=np.float64)
    todo = np.arange(len(x))
    for _ in range(max_tries):
        rounded = low[todo] + (uniform(todo.size * x.shape[1]).reshape(todo.size, x.shape[1]) <= frac[todo])
        ok = np.einsum("ij,ij->i", rounded, rounded) <= bound * bound
        total += rounded[ok].sum(axis=0)
        todo = todo[~ok]
        if todo.size == 0:
            return total.astype(np.int64)
    raise RuntimeError(f"conditional rounding: {todo.size} row(s) still above the bound {bound:.6g} after "
                       f"{max_tries} tries (rows of norm above the clip?)")


def noised_share(total: np.ndarray, sigma: float, bits: int, uniform: Uniform) -> np.ndarray:
    """A client's share from its integer sum ``total`` (d',): plus N_Z(0, sigma^2)^d', modulo 2^bits, uint64."""
    out = np.asarray(total, dtype=np.int64) + discrete_gaussian(sigma, len(total), uniform)
    return np.mod(out, 1 << bits).astype(np.uint64)


def centred(total: np.ndarray, bits: int) -> np.ndarray:
    """Values modulo 2^bits (uint64 or integral float64) mapped to [-2^(bits-1), 2^(bits-1)), int64."""
    m = 1 << bits
    v = np.mod(np.asarray(total).astype(np.int64), m)
    return np.where(v >= m // 2, v - m, v)


@dataclass(frozen=True)
class ShareSpec:
    """What a client needs to encode its share of one DDG release (``Query.ddg`` carries it as a tuple; all
    public): ``c_over_gamma`` the scale from units of the sensitivity to grid units, ``sigma`` its discrete
    Gaussian std (grid units), ``bits`` the modulus 2^bits, ``bound`` the rounding's L2 bound Delta_2, ``rotation``
    the seed of the public rotation signs (``signs``)."""

    c_over_gamma: float
    sigma: float
    bits: int
    bound: float
    rotation: int

    def to_tuple(self) -> tuple[float, ...]:
        """(c', sigma, bits, bound, rotation) as floats (bits and rotation < 2^53: exact)."""
        return (float(self.c_over_gamma), float(self.sigma), float(self.bits), float(self.bound),
                float(self.rotation))

    @classmethod
    def from_tuple(cls, t: Sequence[float]) -> ShareSpec:
        """Inverse of ``to_tuple``; ValueError for another length."""
        if len(t) != 5:
            raise ValueError(f"a DDG share spec has 5 numbers (c', sigma, bits, bound, rotation), got {len(t)}")
        return cls(float(t[0]), float(t[1]), int(t[2]), float(t[3]), int(t[4]))

    def signs(self, out_dim: int) -> np.ndarray:
        """The public rotation signs (``rotation_signs``) of a release of ``out_dim`` coordinates."""
        return rotation_signs(out_dim, np.random.default_rng(self.rotation))

    def encode(self, chunks, uniform: Uniform, out_dim: int) -> np.ndarray:
        """A client's share (d',) uint64 from ``chunks``, an iterable of (B, out_dim) float64 row arrays in units of
        the sensitivity (norm <= 1): ``round_rows`` per chunk, summed, then ``noised_share``."""
        signs = self.signs(out_dim)
        total = np.zeros(len(signs), dtype=np.int64)
        for rows in chunks:
            total += round_rows(rows, self.c_over_gamma, signs, self.bound, uniform)
        return noised_share(total, self.sigma, self.bits, uniform)

    def decode(self, total: np.ndarray, out_dim: int) -> np.ndarray:
        """The released sum (out_dim,) float64, in units of the sensitivity, from the modular sum (``decode``)."""
        return decode(np.asarray(total).astype(np.uint64), self.c_over_gamma, self.signs(out_dim), out_dim,
                      self.bits)
