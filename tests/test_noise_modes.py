"""Noise modes: central, distributed (client shares, SecAgg+ on Flower) and local; dropouts that keep
the released noise std and the ledger; the guarantee against the server; cryptographically seeded noise."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy import stats

from dpdro.client.local_transport import LocalTransport
from dpdro.client.worker import ShardWorker
from dpdro.common.config import Config, ConfigError
from dpdro.common.data import ArrayDataset, load_from_config
from dpdro.common.messages import Point, Query, Reply
from dpdro.common.transport import RoundResult
from dpdro.server.engine import train
from dpdro.server.ledger import Ledger, Mechanism, PrivacyBudgetExceeded, epsilon_of
from dpdro.server.release import (
    check_distributed,
    check_secagg_grid,
    client_noise_std,
    min_shares,
    noisy_mean,
    released_noise_std,
    secagg_grid,
    server_noise_std,
    server_view_multiplier,
    sum_rounding_factor,
)
from dpdro.server.releaser import Releaser
from dpdro.server.rundir import RunDir

Z, CLIP, M = 1.3, 1.0, 4
DRAWS = 600


def _workers(m: int, mode: str) -> list[ShardWorker]:
    gen = torch.Generator().manual_seed(1)
    cfg = Config.from_mapping({"reproducible": True, "reproducible-for-testing": True,
                               "noise-mode": mode, "num-clients": m})
    return [ShardWorker(cfg, ArrayDataset(torch.zeros(25, 1, 28, 28), torch.randint(0, 10, (25,), generator=gen),
                                          10, "t"), pid) for pid in range(m)]


def _histogram_query(t: int, noise_std: float) -> Query:
    return Query(t, "h", "class-onehot", (Point(0, 0.0),), 1.0, CLIP, 10, extra=(0.0,) * 10, noise_std=noise_std)


def _noise_of_sums(workers, noise_std: float, replied: int, mode: str) -> np.ndarray:
    """Released-sum noise over DRAWS draws: the clients' replies (rate 1: exact sample) plus the server's part,
    minus the exact clipped sum."""
    exact = sum(w.answer(_histogram_query(0, 0.0), {0: np.zeros(1)}).total for w in workers[:replied])
    out = []
    for t in range(DRAWS):
        total = sum(w.answer(_histogram_query(t, noise_std), {0: np.zeros(1)}).total for w in workers[:replied])
        std = server_noise_std(mode, Z, CLIP, len(workers), replied)
        rng = np.random.default_rng([7, t])
        out.append(noisy_mean(_histogram_query(t, 0.0), total, std, 1, rng) - exact)
    return np.concatenate(out)


def test_distributed_noise_has_the_declared_variance_and_equals_central_in_distribution():
    workers = _workers(M, "distributed")
    share = client_noise_std("distributed", Z, CLIP, M)
    assert share == pytest.approx(Z * CLIP / 2) and server_noise_std("distributed", Z, CLIP, M, M) == 0.0
    dist = _noise_of_sums(workers, share, M, "distributed")
    central = _noise_of_sums(workers, 0.0, M, "central")
    for noise in (dist, central):
        assert noise.std() == pytest.approx(Z * CLIP, rel=0.04)
        assert abs(noise.mean()) < 4 * Z * CLIP / math.sqrt(noise.size)
    assert stats.ks_2samp(dist, central).pvalue > 1e-3
    assert stats.kstest(dist / (Z * CLIP), "norm").pvalue > 1e-3


def test_a_dropped_share_is_topped_up_by_the_server():
    """Below m_min (here m_min = m = 4, one share missing): the server adds N(0, (z C)^2 / 4), the released std
    stays z C, and only 3/4 of the variance is unknown to the server (its guarantee there uses z sqrt(3/4))."""
    workers = _workers(M, "distributed")
    noise = _noise_of_sums(workers, client_noise_std("distributed", Z, CLIP, M), M - 1, "distributed")
    assert server_noise_std("distributed", Z, CLIP, M, M - 1) == pytest.approx(Z * CLIP / 2)
    assert noise.std() == pytest.approx(Z * CLIP, rel=0.04)
    assert server_view_multiplier("distributed", Z, M, M - 1) == pytest.approx(Z * math.sqrt(3 / 4))
    assert server_view_multiplier("central", Z, M, M) == 0.0 and server_view_multiplier("local", Z, M, 2) == Z


class _Clients:
    """A transport stub for the releaser's calibration: only the number of clients."""

    num_clients = M


def _decorated_share(tmp_path, **keys) -> float:
    cfg = Config.from_mapping({"noise-mode": "distributed", "num-clients": M, **keys})
    ledger = Ledger({Mechanism("h", 1.0): 10}, {"h": Z}, 4.0, 1e-5)
    releaser = Releaser(cfg, _Clients(), ledger, 100, RunDir(tmp_path))
    return releaser.decorate(_histogram_query(0, 0.0), diagnostics=False).noise_std


def test_distributed_shares_are_calibrated_for_the_declared_minimum(tmp_path):
    """With on-client-failure=drop and min-clients = m_min = 2 of 4, each client adds N(0, (z S)^2 / 2) (measured
    on the clients' replies), so a release of any 2 shares carries the planned noise, against the server too;
    all 4 shares carry twice the planned variance. Without 'drop' every client must answer: m_min = 4."""
    f = sum_rounding_factor(100)  # the float64 rounding of a sum of the releaser's n = 100 records
    share = _decorated_share(tmp_path, **{"on-client-failure": "drop", "min-clients": 2})
    assert share == pytest.approx(Z * CLIP * f / math.sqrt(2), rel=1e-12)
    assert _decorated_share(tmp_path, **{"min-clients": 2}) == pytest.approx(Z * CLIP * f / 2, rel=1e-12)
    workers = _workers(M, "distributed")[:2]
    exact = [w.answer(_histogram_query(0, 0.0), {0: np.zeros(1)}).total for w in workers]
    noise = np.array([[w.answer(_histogram_query(t, share), {0: np.zeros(1)}).total - x
                       for w, x in zip(workers, exact, strict=True)] for t in range(DRAWS)])  # (draws, 2, 10)
    assert noise[:, 0].std() == pytest.approx(Z * CLIP / math.sqrt(2), rel=0.04)
    assert noise.sum(axis=1).std() == pytest.approx(Z * CLIP, rel=0.04)  # 2 shares: the planned std
    assert server_view_multiplier("distributed", Z, 2, 2) == pytest.approx(Z)
    assert server_view_multiplier("distributed", Z, 2, 4) == pytest.approx(Z * math.sqrt(2))
    assert server_noise_std("distributed", Z, CLIP, 2, 3) == 0.0
    assert released_noise_std("distributed", Z, CLIP, 2, 4) == pytest.approx(Z * CLIP * math.sqrt(2))
    assert released_noise_std("distributed", Z, CLIP, 2, 1) == pytest.approx(Z * CLIP)  # topped up to the plan


def test_the_declared_minimum_is_validated():
    assert min_shares("drop", 3, 4) == 3 and min_shares("retry", 3, 4) == 4 and min_shares("fail", 1, 4) == 4
    for bad in (0, 5):
        with pytest.raises(ConfigError, match=f"'min-clients': got {bad}; allowed: 1 to num-clients \\(4\\)"):
            min_shares("drop", bad, 4)
    with pytest.raises(ConfigError, match="'min-clients': got 5; allowed: at most num-clients \\(4\\)"):
        Config.from_mapping({"min-clients": 5, "num-clients": 4})


def test_the_secagg_grid_must_be_fine_against_a_share():
    """The grid step 2 R / Q must be at most 0.1 x the smallest share std z_min / sqrt(m_min), so that stochastic
    rounding (variance <= step^2 / 4) stays below 1/400 of a share's variance. The main job's figures (`dpdro
    plan` with noise-mode=distributed: largest shard 7505, 4 clients, z 1.9403 and 10 for the class histogram)
    pass with a wide margin (2.9e-5); a million records on each of 1000 clients at z 0.5 (share std 0.016, step
    0.95) is refused, naming the floor, the figures and what to change."""
    r, q = secagg_grid(7505, 10.0 / 2, 4)
    assert (r, q) == (7506 + 50.0, 2**29)
    ratio = check_secagg_grid({"grad": 1.9403, "class-histogram": 10.0}, 4, 4, 7505)
    assert ratio == pytest.approx(2 * (7506 + 50.0) / 2**29 / (1.9403 / 2), rel=1e-12)
    assert ratio == pytest.approx(2.9e-5, rel=0.01)
    with pytest.raises(ConfigError) as err:
        check_secagg_grid({"grad": 0.5}, 1000, 1000, 1_000_000)
    text = str(err.value)
    step = 2 * (1_000_001 + 10 * 0.5 / math.sqrt(1000)) / 2**21
    assert f"grid step 2 R / Q = {step:.3g}" in text and "Q = 2097152 for num-clients 1000" in text
    assert f"{step / (0.5 / math.sqrt(1000)):.3g} x the smallest client noise share" in text
    assert "allowed: at most 0.1 x" in text and "1/400 of a share's noise variance" in text
    assert "config key 'noise-mode': got 'distributed'" in text and "min-clients" in text
    # the run-level check calibrates the shares for m_min and warns when m_min < m
    cfg = Config.from_mapping({"noise-mode": "distributed", "num-clients": 4, "on-client-failure": "drop",
                               "min-clients": 2})
    [warning] = check_distributed(cfg, {"grad": 1.84}, 15_000)
    assert "min-clients=2 of num-clients=4" in warning and "2 x the planned variance" in warning
    assert check_distributed(Config.from_mapping({"noise-mode": "distributed"}), {"grad": 1.84}, 15_000) == []


def test_local_mode_replies_carry_the_full_noise():
    workers = _workers(M, "local")
    std = client_noise_std("local", Z, CLIP, M)
    assert std == Z * CLIP and server_noise_std("local", Z, CLIP, M, M) == 0.0
    exact = workers[0].answer(_histogram_query(0, 0.0), {0: np.zeros(1)}).total
    replies = [workers[0].answer(_histogram_query(t, std), {0: np.zeros(1)}) for t in range(DRAWS)]
    noise = np.concatenate([r.total - exact for r in replies])
    assert noise.std() == pytest.approx(Z * CLIP, rel=0.04)
    assert all(r.count == -1 for r in replies)  # a noised reply does not disclose its count
    # and the aggregate of M local replies carries M times the variance
    total = _noise_of_sums(workers, std, M, "local")
    assert total.std() == pytest.approx(Z * CLIP * math.sqrt(M), rel=0.04)


def test_client_noise_is_seeded_from_the_os_csprng_unless_reproducible(monkeypatch):
    import secrets

    calls = []
    real = secrets.randbits
    monkeypatch.setattr(secrets, "randbits", lambda k: calls.append(k) or real(k))
    gen = torch.Generator().manual_seed(1)
    data = ArrayDataset(torch.zeros(5, 1, 28, 28), torch.randint(0, 10, (5,), generator=gen), 10, "t")
    secret = ShardWorker(Config.from_mapping({"noise-mode": "local"}), data, 0)
    a = secret.answer(_histogram_query(3, 1.0), {0: np.zeros(1)}).total
    b = secret.answer(_histogram_query(3, 1.0), {0: np.zeros(1)}).total
    assert calls and all(k == 128 for k in calls) and not np.array_equal(a, b)
    calls.clear()
    seeded = ShardWorker(Config.from_mapping({"noise-mode": "local", "reproducible": True,
                                              "reproducible-for-testing": True}), data, 0)
    c = seeded.answer(_histogram_query(3, 1.0), {0: np.zeros(1)}).total
    d = seeded.answer(_histogram_query(3, 1.0), {0: np.zeros(1)}).total
    assert np.array_equal(c, d) and not calls


class _ZeroTransport:
    """m clients that reply with zero sums."""

    def __init__(self, m: int, n: int) -> None:
        self.num_clients, self.num_records = m, n

    def run(self, queries, versions):
        count = -1 if queries[0].noise_std > 0 else 0  # a noised reply does not disclose its count
        return RoundResult({q.qid: [Reply(q.qid, pid, np.zeros(q.out_dim), count) for pid in range(self.num_clients)]
                            for q in queries})


@pytest.mark.parametrize("mode", ["distributed", "local", "central"])
def test_noise_std_includes_the_float64_rounding_factor(tmp_path, mode):
    """Every noise std is z S f(n), f(n) = sum_rounding_factor(n) = 1 + 2.2e-4 for n = 10^6 records: the clients'
    shares (distributed, local) and the released std (the event's noise_std_of_mean)."""
    n = 10**6
    cfg = Config.from_mapping({"algorithm": "dp-sgd", "noise-mode": mode, "num-clients": M, "epsilon": 4.0,
                               "out-dir": str(tmp_path)})
    rd = RunDir(tmp_path)
    rd.create()
    releaser = Releaser(cfg, _ZeroTransport(M, n), Ledger({Mechanism("grad", 0.01): 3}, {"grad": Z}, 4.0, 1e-7),
                        n, rd)
    q = Query(0, "grad", "class-onehot", (Point(0, 0.0),), 0.01, CLIP, 10, extra=(0.0,) * 10)
    sent = releaser.decorate(q)
    f = sum_rounding_factor(n)
    assert f - 1 == pytest.approx(2.22e-4, rel=1e-2)
    share = {"distributed": Z * sent.sensitivity * f / math.sqrt(M), "local": Z * sent.sensitivity * f, "central": 0}
    assert sent.noise_std == pytest.approx(share[mode], rel=1e-12)
    releaser.run([q], {0: np.zeros(1)})
    [event] = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert event["noise_std_of_mean"] == pytest.approx(Z * sent.sensitivity * f / (0.01 * n), rel=1e-12)


def test_noise_modes_refuse_what_cannot_be_private():
    with pytest.raises(ConfigError, match="noise-mode"):
        Config.from_mapping({"noise-mode": "distributed", "epsilon": "inf"})
    with pytest.raises(ConfigError, match="num-clients >= 2"):
        Config.from_mapping({"noise-mode": "distributed", "num-clients": 1, "min-clients": 1})


# ---- end to end on a real MNIST-ST subset ----

def _run(cfg):
    return train(cfg, LocalTransport(cfg, load_from_config(cfg, True)), load_from_config(cfg, False))


def _events(cfg) -> list[dict]:
    return [json.loads(line) for line in open(f"{cfg.out_dir}/events.jsonl")]


@pytest.mark.data
@pytest.mark.parametrize("mode", ["central", "distributed", "local"])
def test_every_mode_runs_on_real_data_with_the_same_ledger(small_config, tmp_path, mode):
    cfg = small_config(out_dir=str(tmp_path / mode), noise_mode=mode, algorithm="dp-sgd")
    s = _run(cfg).summary
    assert 0.99 * 4 <= s["epsilon_spent"] <= 4 and s["noise_mode"] == mode
    events = _events(cfg)
    assert all(e["noise_mode"] == mode for e in events)
    if mode == "central":
        assert s["epsilon_against_server"] == math.inf
    else:  # every share present (distributed) or full noise per reply (local): the same epsilon against the server
        assert s["epsilon_against_server"] == pytest.approx(s["epsilon_spent"], rel=1e-9)
        assert all(e["server_topup_std"] == 0.0 for e in events)


@pytest.mark.data
def test_dropout_mid_run_keeps_the_planned_noise_against_the_server(small_config, tmp_path):
    """Dropout of one client of 3 at iteration 2 with min-clients = 2: the shares were calibrated for 2, so
    the release of the 2 survivors carries the planned std without a top-up and the epsilon against the server
    stays the ledger's (within the target); the releases of all 3 carry sqrt(3/2) x the planned std."""
    cfg = small_config(noise_mode="distributed", inject_fault="1:2:raise", on_client_failure="drop", min_clients=2)
    s = _run(cfg).summary
    assert s["releases"] == {"eta-refresh": 2, "eta-diff": 4, "x-refresh": 2, "x-diff": 4}
    assert 0.99 * 4 <= s["epsilon_spent"] <= 4
    assert s["epsilon_against_server"] == pytest.approx(s["epsilon_spent"], rel=1e-9)
    events = _events(cfg)
    at2 = [e for e in events if e["iteration"] == 2]
    assert at2 and all(e["clients"] == 2 and e["server_topup_std"] == 0.0 for e in at2)
    for e in events:
        more = 1.0 if e["iteration"] == 2 else math.sqrt(3 / 2)
        assert e["released_noise_std_of_mean"] == pytest.approx(e["noise_std_of_mean"] * more, rel=1e-12)


@pytest.mark.data
def test_a_release_past_the_target_against_the_server_is_refused(small_config, tmp_path):
    """min-clients = 3 of 3: a dropout at iteration 1 makes both of its rounds unreleasable; they are retried and
    released in full, but the server saw the two discarded partial sums (2 shares: z sqrt(2/3)). They count
    against the server, and the release that would take that epsilon past the target is refused before any
    client is asked: the run stops with nothing more released, and what was released stays within it."""
    cfg = small_config(noise_mode="distributed", inject_fault="0:1:raise-once", on_client_failure="drop",
                       min_clients=3)
    with pytest.raises(PrivacyBudgetExceeded, match=r"against the server \(noise-mode=distributed\)") as err:
        _run(cfg)
    journal = _events(cfg)
    events = [e for e in journal if not e.get("discarded")]
    assert all(e["clients"] == 3 for e in events) and events[-1]["iteration"] < cfg.iterations - 1
    seen = {}
    for e in events:
        key = (e["rate"], e["noise_multiplier"])
        seen[key] = seen.get(key, 0) + 1
    z = {e["mechanism"]: e["noise_multiplier"] for e in events}
    discarded = [e for e in journal if e.get("discarded")]  # journalled at once (resume charges them)
    assert [(e["iteration"], e["clients"]) for e in discarded] == [(1, 2), (1, 2)]
    for e in events:
        if e["iteration"] == 1:  # the discarded attempt of each round at iteration 1
            key = (e["rate"], e["noise_multiplier"] * math.sqrt(2 / 3))
            seen[key] = seen.get(key, 0) + 1
    for e in discarded:
        assert e["server_view_multiplier"] == pytest.approx(z[e["mechanism"]] * math.sqrt(2 / 3), rel=1e-12)
    delta = json.load(open(f"{cfg.out_dir}/config.json"))["delta_resolved"]
    assert epsilon_of(seen, delta) <= 4
    refused = str(err.value).split("release '")[1].split("'")[0]
    [nxt] = {(e["rate"], e["noise_multiplier"]) for e in events if e["mechanism"] == refused}
    assert epsilon_of({**seen, nxt: seen[nxt] + 1}, delta) > 4


@pytest.mark.data
def test_the_secagg_grid_floor_is_checked_before_any_work(small_config, tmp_path, monkeypatch):
    """A single-node distributed run is refused before the run directory exists when its grid step would
    exceed the floor (here the floor is lowered to make MNIST-ST's tiny step too coarse)."""
    import dpdro.common.noise_modes as noise_modes

    monkeypatch.setattr(noise_modes, "SECAGG_STEP_OVER_SHARE_STD", 1e-9)
    cfg = small_config(noise_mode="distributed")
    with pytest.raises(ConfigError, match="SecAgg\\+ grid step .* allowed: at most 1e-09 x"):
        _run(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.flower
@pytest.mark.data
def test_secagg_sum_is_within_the_quantisation_bound_on_flower(small_config, tmp_path, flower_superlink):
    """One DP-SGD step with distributed noise through Flower's SecAgg+ against the same step summed exactly
    in-process (reproducible: the same records and client noise): the parameters differ by at most
    lr * (quantisation bound) / (expected batch), and by more than nothing (the sum really went through the
    fixed-point protocol)."""
    from dpdro.launch.simulate import run_simulation

    keys = {"algorithm": "dp-sgd", "noise_mode": "distributed", "iterations": 1, "eval_every": 1}
    local = _run(small_config(out_dir=str(tmp_path / "local"), **keys))
    cfg = small_config(out_dir=str(tmp_path / "flower"), **keys)
    summary = run_simulation(cfg, stream=False, keep_superlink=True)
    assert summary["noise_mode"] == "distributed" and summary["transport"] == "flower"
    [event] = [e for e in _events(cfg) if e["mechanism"] == "grad"]
    bound = cfg.lr_x * event["quantisation_bound"] / event["expected_batch"]
    diff = np.max(np.abs(np.load(tmp_path / "flower" / "final_params.npy") - local.params))
    assert 0 < diff <= bound
    assert event["quantisation_bound"] < 1e-3 * event["noise_multiplier"] * event["clip"]


@pytest.mark.flower
@pytest.mark.data
def test_secagg_dropout_on_flower_keeps_noise_and_ledger(small_config, tmp_path, flower_superlink):
    """A node fails inside SecAgg+ at iteration 1; its masks are reconstructed from the others' shares, the two
    survivors' shares (calibrated for min-clients = 2) carry the planned noise without a top-up, and the run
    completes with the planned releases and the ledger's epsilon against the server."""
    from dpdro.launch.simulate import run_simulation

    keys = {"noise_mode": "distributed", "iterations": 3, "eval_every": 3, "on_client_failure": "drop",
            "min_clients": 2}
    cfg = small_config(out_dir=str(tmp_path / "flower"), inject_fault="1:1:raise", **keys)
    summary = run_simulation(cfg, stream=False, keep_superlink=True)
    clean = _run(small_config(out_dir=str(tmp_path / "local"), **keys)).summary
    assert summary["releases"] == clean["releases"]
    assert summary["epsilon_spent"] == pytest.approx(clean["epsilon_spent"], rel=1e-12)
    at1 = [e for e in _events(cfg) if e["iteration"] == 1]
    assert at1 and all(e["clients"] == 2 and e["server_topup_std"] == 0.0 for e in at1)
    assert all(e["released_noise_std_of_mean"] == pytest.approx(e["noise_std_of_mean"], rel=1e-12) for e in at1)
    assert all(e["clients"] == 3 for e in _events(cfg) if e["iteration"] != 1)
    assert summary["epsilon_against_server"] == pytest.approx(summary["epsilon_spent"], rel=1e-9)
