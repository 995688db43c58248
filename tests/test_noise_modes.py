"""Noise modes (issue 7): central, distributed (client shares, SecAgg+ on Flower) and local; dropouts that keep
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
from dpdro.server.ledger import Ledger, Mechanism
from dpdro.server.release import (
    client_noise_std,
    noisy_mean,
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
    cfg = Config.from_mapping({"reproducible": True, "noise-mode": mode, "num-clients": m})
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
    """One of four clients drops: the server adds N(0, (z C)^2 / 4), the released std stays z C, and only
    3/4 of the variance is unknown to the server (its guarantee there uses z sqrt(3/4))."""
    workers = _workers(M, "distributed")
    noise = _noise_of_sums(workers, client_noise_std("distributed", Z, CLIP, M), M - 1, "distributed")
    assert server_noise_std("distributed", Z, CLIP, M, M - 1) == pytest.approx(Z * CLIP / 2)
    assert noise.std() == pytest.approx(Z * CLIP, rel=0.04)
    assert server_view_multiplier("distributed", Z, M, M - 1) == pytest.approx(Z * math.sqrt(3 / 4))
    assert server_view_multiplier("central", Z, M, M) == 0.0 and server_view_multiplier("local", Z, M, 2) == Z


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
    seeded = ShardWorker(Config.from_mapping({"noise-mode": "local", "reproducible": True}), data, 0)
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
def test_dropout_mid_run_keeps_noise_std_and_ledger(small_config, tmp_path):
    """Dropout of one client at iteration 2 under distributed noise: the run completes, the released noise std
    and the ledger are those of a clean run, the server topped up the missing share, and the guarantee
    against the server is weaker for that release (reported)."""
    clean_cfg = small_config(out_dir=str(tmp_path / "clean"), noise_mode="distributed")
    clean = _run(clean_cfg).summary
    cfg = small_config(out_dir=str(tmp_path / "drop"), noise_mode="distributed", inject_fault="1:2:raise",
                       on_client_failure="drop", min_clients=2)
    dropped = _run(cfg).summary
    assert dropped["releases"] == clean["releases"]
    assert dropped["epsilon_spent"] == pytest.approx(clean["epsilon_spent"], rel=1e-12)
    ev_clean, ev_drop = _events(clean_cfg), _events(cfg)
    assert [e["noise_std_of_mean"] for e in ev_drop] == [e["noise_std_of_mean"] for e in ev_clean]
    at2 = [e for e in ev_drop if e["iteration"] == 2]
    assert at2 and all(e["clients"] == 2 for e in at2)
    f = sum_rounding_factor(dropped["n"])  # the float64 rounding of the sums, part of the sensitivity
    assert 1 + 1e-9 < f < 1 + 1e-8
    for e in at2:
        sens = e["clip"] * math.sqrt(1 + 0.1**2)
        assert e["server_topup_std"] == pytest.approx(e["noise_multiplier"] * sens * f / math.sqrt(3), rel=1e-12)
    assert dropped["epsilon_against_server"] > clean["epsilon_against_server"]


@pytest.mark.data
def test_a_round_below_the_contract_is_discarded_and_retried(small_config, tmp_path):
    """min-clients = 3 of 3: a dropout makes the round unreleasable; it is retried and released in full. The
    discarded attempt's partial sum was seen by the server, so the guarantee against the server counts it."""
    clean = _run(small_config(out_dir=str(tmp_path / "clean"), noise_mode="distributed")).summary
    cfg = small_config(out_dir=str(tmp_path / "retry"), noise_mode="distributed", inject_fault="0:1:raise-once",
                       on_client_failure="drop", min_clients=3)
    retried = _run(cfg).summary
    assert retried["releases"] == clean["releases"]
    assert retried["epsilon_spent"] == pytest.approx(clean["epsilon_spent"], rel=1e-12)
    assert all(e["clients"] == 3 for e in _events(cfg))
    assert retried["epsilon_against_server"] > clean["epsilon_against_server"]


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
    """A node fails inside SecAgg+ at iteration 1; its masks are reconstructed from the others' shares, the
    server tops up its noise share, and the run completes with the planned releases."""
    from dpdro.launch.simulate import run_simulation

    keys = {"noise_mode": "distributed", "iterations": 3, "eval_every": 3, "on_client_failure": "drop",
            "min_clients": 2}
    cfg = small_config(out_dir=str(tmp_path / "flower"), inject_fault="1:1:raise", **keys)
    summary = run_simulation(cfg, stream=False, keep_superlink=True)
    clean = _run(small_config(out_dir=str(tmp_path / "local"), **keys)).summary
    assert summary["releases"] == clean["releases"]
    assert summary["epsilon_spent"] == pytest.approx(clean["epsilon_spent"], rel=1e-12)
    at1 = [e for e in _events(cfg) if e["iteration"] == 1]
    assert at1 and all(e["clients"] == 2 and e["server_topup_std"] > 0 for e in at1)
    assert all(e["clients"] == 3 for e in _events(cfg) if e["iteration"] != 1)
