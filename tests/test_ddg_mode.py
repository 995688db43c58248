"""noise-mode=distributed-discrete (common/ddg.py wired as a noise mode; Kairouz, Liu and Steinke, ICML 2021):
the clients' shares decode to the plain sum within the rounding bound, the ledger calibrates and charges the DDG's
own epsilon (against common/ddg.py computed directly), the two dropout policies, bad input refused before any
work, the share's reply check and wire form, and a run on real MNIST-ST data."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from dpdro.client.worker import ShardWorker
from dpdro.common import ddg
from dpdro.common.codec import query_from_dict, query_to_dict
from dpdro.common.config import Config, ConfigError
from dpdro.common.data import ArrayDataset
from dpdro.common.messages import Point, Query, Reply
from dpdro.common.noise_modes import NOISE_MODES
from dpdro.common.transport import RoundResult
from dpdro.server.ledger import Ledger, Mechanism, PrivacyBudgetExceeded, calibrate
from dpdro.server.release import ReplyError, check_reply
from dpdro.server.releaser import Releaser
from dpdro.server.rundir import RunDir

M, K, DELTA = 3, 10, 1e-5
N_PER = 40  # records per client
RATE = 0.5


def _cfg(**keys) -> Config:
    return Config.from_mapping({"reproducible": True, "reproducible-for-testing": True,
                                "noise-mode": "distributed-discrete", "num-clients": M,
                                "on-client-failure": "drop", "min-clients": 2, **keys})


class _Workers:
    """M clients with N_PER records each (zero images, seeded labels) answering in process; ``failing``: the
    partitions that fail (dropouts after the shares were fixed)."""

    def __init__(self, cfg: Config, failing: tuple[int, ...] = ()) -> None:
        gen = torch.Generator().manual_seed(3)
        self.workers = [ShardWorker(cfg, ArrayDataset(torch.zeros(N_PER, 1, 28, 28),
                                                      torch.randint(0, K, (N_PER,), generator=gen), K, "t"), pid)
                        for pid in range(M)]
        self.failing = failing
        self.num_clients, self.num_records = M, M * N_PER

    def run(self, queries, versions):
        out = RoundResult({q.qid: [] for q in queries})
        for w in self.workers:
            if w.partition in self.failing:
                out.failures[w.partition] = "dropped out"
                continue
            for q in queries:
                out.replies[q.qid].append(w.answer(q, versions))
        return out

    def quantisation_bound(self, query, clients):
        return None


def _query(t: int) -> Query:
    return Query(t, "h", "class-onehot", (Point(0, 0.0),), RATE, 1.0, K, extra=(0.0,) * K)


def _geometry() -> ddg.DdgGeometry:
    dim = ddg.padded_dim(K)
    return ddg.DdgGeometry(ddg.granularity(dim), dim, M)


def _releaser(tmp_path, cfg: Config, z: float, count: int = 20, transport=None) -> Releaser:
    ledger = Ledger({Mechanism("h", RATE): count}, {"h": z}, 50.0, DELTA, ddg=_geometry())
    rd = RunDir(tmp_path)
    rd.create()
    return Releaser(cfg, transport or _Workers(cfg), ledger, M * N_PER, rd)


def _exact_sum(transport: _Workers, q: Query, present=range(M)) -> np.ndarray:
    """The plain sum of the clipped vectors of the same Poisson samples (reproducible: seeded by the query)."""
    return sum(transport.workers[p].answer(q, {0: np.zeros(1)}).total for p in present)


def test_decoded_sum_equals_the_plain_sum_within_the_rounding_bound(tmp_path):
    """The server's modular sum of three clients' shares decodes to the plain sum of their clipped vectors up to the
    rounding (at most one grid step per record and coordinate: <= R sqrt(d') / c' in L2, units of the clip) and the
    shares' discrete Gaussian noise (sqrt(m d') sigma / c' in expected L2 norm; allowed 3 x). With a tiny noise
    multiplier the rounding dominates, and the error is really there (the sum went through the integer grid)."""
    cfg = _cfg()
    transport = _Workers(cfg)
    releaser = _releaser(tmp_path, cfg, z=0.02, transport=transport)
    g = releaser.ledger.ddg
    for t in range(5):
        q = _query(t)
        released = releaser.run([q], {0: np.zeros(1)})["h"] * RATE * M * N_PER  # back from the mean to the sum
        exact = _exact_sum(transport, q)
        records = int(exact.sum())  # class one-hots: each sampled record adds 1 in total
        spec = ddg.ShareSpec.from_tuple(releaser.decorate(q).ddg)
        assert spec.sigma == pytest.approx(0.02 * g.c_over_gamma / math.sqrt(M), rel=1e-12)
        bound = (records * math.sqrt(g.dim) + 3 * math.sqrt(M * g.dim) * spec.sigma) / g.c_over_gamma
        err = np.linalg.norm(released - exact)
        assert 0 < err <= bound
    [event] = [e for e in RunDir(tmp_path).read_events() if e["iteration"] == 0]
    assert event["ddg_bits"] == spec.bits and event["ddg_shares"] == M and event["noise_mode"] == "distributed-discrete"


def test_shares_carry_the_planned_noise(tmp_path):
    """At a noise multiplier where the noise dominates, the decoded sum's error per coordinate has std
    sqrt(m) sigma / c' = z (units of the clip) within 12 % (600 draws), and mean 0."""
    z = 1.5
    cfg = _cfg()
    transport = _Workers(cfg)
    releaser = _releaser(tmp_path, cfg, z=z, count=200, transport=transport)
    errors = []
    for t in range(60):
        q = _query(t)
        errors.append(releaser.run([q], {0: np.zeros(1)})["h"] * RATE * M * N_PER - _exact_sum(transport, q))
    err = np.concatenate(errors)
    assert err.std() == pytest.approx(z, rel=0.12)
    assert abs(err.mean()) < 4 * z / math.sqrt(err.size)


def test_ledger_charges_the_ddg_epsilon(tmp_path):
    """The ledger's epsilon after 4 releases equals common/ddg.py's ddg_epsilon for 4 releases of the discrete
    Gaussian with shares of sigma = z c' / sqrt(m) (m = 3), computed directly; it exceeds the subsampled Gaussian's
    at the same z (the DDG's analysis pays for the general subsampling bound); and calibration lands the DDG's
    epsilon, computed directly, in [0.99, 1] x the target."""
    z = 2.0
    releaser = _releaser(tmp_path, _cfg(), z=z)
    for t in range(4):
        releaser.run([_query(t)], {0: np.zeros(1)})
    g = releaser.ledger.ddg
    direct = ddg.ddg_epsilon([ddg.DdgRelease(RATE, g.c_over_gamma, z * g.c_over_gamma / math.sqrt(M), M, g.dim,
                                             count=4)], DELTA)
    assert releaser.ledger.epsilon_spent() == pytest.approx(direct, rel=1e-12)
    assert releaser.epsilon_against_server() == pytest.approx(direct, rel=1e-12)
    gaussian = Ledger({Mechanism("h", RATE): 20}, {"h": z}, 50.0, DELTA, "rdp")
    for _ in range(4):
        gaussian.charge("h", RATE)
    assert gaussian.epsilon_spent() < direct
    plan = {Mechanism("grad", 0.05): 50}
    scale = calibrate(plan, 2.0, DELTA, ddg=g)
    eps = ddg.ddg_epsilon([ddg.DdgRelease(0.05, g.c_over_gamma, scale * g.c_over_gamma / math.sqrt(M), M, g.dim,
                                          count=50)], DELTA)
    assert 0.99 * 2.0 <= eps <= 2.0
    assert scale > calibrate(plan, 2.0, DELTA, "rdp")  # more noise than the Gaussian at the same target


def test_dropout_policy_refuse(tmp_path):
    """Policy 'refuse': a sum of 2 of the 3 shares is not released (ShareShortfall), the public ledger charges
    nothing, and what the server saw (2 shares: z sqrt(2/3)) is counted against it and journalled."""
    z = 2.0
    cfg = _cfg(**{"ddg-shortfall": "refuse"})
    releaser = _releaser(tmp_path, cfg, z=z, transport=_Workers(cfg, failing=(1,)))
    with pytest.raises(ddg.ShareShortfall, match="only 2 of 3 noise shares"):
        releaser.run([_query(0)], {0: np.zeros(1)})
    spent = releaser.ledger
    assert spent.epsilon_spent() == 0.0 and not sum(spent.spent.values()) and not spent.extra
    g = releaser.ledger.ddg
    seen = ddg.ddg_epsilon([ddg.DdgRelease(RATE, g.c_over_gamma, g.sigma(z) * math.sqrt(2 / 3), M, g.dim)], DELTA)
    assert releaser.epsilon_against_server() == pytest.approx(seen, rel=1e-12)
    [event] = RunDir(tmp_path).read_events()
    assert event["discarded"] and event["clients"] == 2
    assert event["server_view_multiplier"] == pytest.approx(z * math.sqrt(2 / 3), rel=1e-12)


def test_dropout_policy_charge(tmp_path):
    """Policy 'charge': the sum of 2 of 3 shares is released and charged at z sqrt(2/3) (the noise actually
    present): the ledger's epsilon is common/ddg.py's for shares of sigma sqrt(2/3) among 3 (an upper bound on 2
    shares of sigma, ``DdgGeometry``), above the full release's; the released sum is the 2 clients' plain sum plus
    their noise. When the smaller noise would overspend the target the release is refused."""
    z = 2.0
    cfg = _cfg(**{"ddg-shortfall": "charge"})
    transport = _Workers(cfg, failing=(1,))
    releaser = _releaser(tmp_path, cfg, z=z, transport=transport)
    q = _query(0)
    released = releaser.run([q], {0: np.zeros(1)})["h"] * RATE * M * N_PER
    g = releaser.ledger.ddg
    charged = ddg.ddg_epsilon([ddg.DdgRelease(RATE, g.c_over_gamma, g.sigma(z) * math.sqrt(2 / 3), M, g.dim)], DELTA)
    full = ddg.ddg_epsilon([ddg.DdgRelease(RATE, g.c_over_gamma, g.sigma(z), M, g.dim)], DELTA)
    assert releaser.ledger.epsilon_spent() == pytest.approx(charged, rel=1e-12) and charged > full
    [((rate, mult), n)] = releaser.ledger.extra.items()
    assert (rate, n) == (RATE, 1) and mult == pytest.approx(z * math.sqrt(2 / 3), rel=1e-12)
    [event] = RunDir(tmp_path).read_events()
    assert event["ddg_shares"] == 2 and event["charged_noise_multiplier"] == pytest.approx(z * math.sqrt(2 / 3))
    assert np.linalg.norm(released - _exact_sum(transport, q, (0, 2))) < 6 * z * math.sqrt(K)
    # a target the shortfall would pass: refused before anything is released
    tight = Ledger({Mechanism("h", RATE): 1}, {"h": z}, full * 1.0001, DELTA, ddg=g)
    with pytest.raises(PrivacyBudgetExceeded, match="noise of the shares present only"):
        tight.charge_at("h", RATE, z * math.sqrt(2 / 3))
    assert not tight.extra and not sum(tight.spent.values())


def test_bad_input_is_refused_before_work(tmp_path):
    """ddg-bits below what a release needs for its wrap probability: ConfigError naming the key, the need and
    what is allowed, before any client is asked (the decorated query raises). Unsupported combinations are refused
    by the config."""
    cfg = _cfg(**{"ddg-bits": 8})
    releaser = _releaser(tmp_path, cfg, z=2.0)
    g = releaser.ledger.ddg
    need = ddg.release_bits(K, M * N_PER, RATE, g.c_over_gamma, g.sigma(2.0), M, 1e-9)
    assert need > 8
    with pytest.raises(ConfigError, match=f"'ddg-bits': got 8; release 'h' needs at least {need} bits per "
                                          f"coordinate .* allowed: {need} to 52, or 'auto'"):
        releaser.run([_query(0)], {0: np.zeros(1)})
    assert not (tmp_path / "events.jsonl").exists()
    ok = _releaser(tmp_path / "ok", _cfg(**{"ddg-bits": need}), z=2.0)
    assert ddg.ShareSpec.from_tuple(ok.decorate(_query(0)).ddg).bits == need
    # a smaller wrap probability needs more bits
    assert ddg.release_bits(K, M * N_PER, RATE, g.c_over_gamma, g.sigma(2.0), M, 1e-100) > need
    for keys, match in (({"num-clients": 1, "min-clients": 1}, "'num-clients': got 1"),
                        ({"node-sampling-rate": 0.5}, "'node-sampling-rate': got 0.5"),
                        ({"eval-data": "nodes"}, "'eval-data': got 'nodes'"),
                        ({"ddg-shortfall": "ignore"}, "ddg-shortfall"),
                        ({"ddg-bits": 60}, "ddg-bits"), ({"ddg-wrap-probability": 0.0}, "ddg-wrap-probability")):
        with pytest.raises(ConfigError, match=match):
            _cfg(**keys)


def test_share_reply_check_and_wire_form():
    spec = ddg.ShareSpec(960.0, 700.5, 20, 965.0, 12345)
    q = Query(3, "h", "class-onehot", (Point(0, 0.0),), RATE, 1.0, K, extra=(0.0,) * K, ddg=spec.to_tuple())
    assert query_from_dict(json.loads(json.dumps(query_to_dict(q)))) == q
    assert ddg.ShareSpec.from_tuple(q.ddg) == spec
    good = np.arange(16, dtype=np.float64) * 1000
    check_reply(q, Reply(q.qid, 0, good, -1), "float64")
    for bad, why in ((good[:10], "expected a float64 share of shape \\(16,\\)"),
                     (good + 0.5, "not a share modulo 2\\^20"), (good + 2.0**20, "not a share modulo 2\\^20"),
                     (-good - 1, "not a share")):
        with pytest.raises(ReplyError, match=why):
            check_reply(q, Reply(q.qid, 0, bad, -1), "float64")


def test_mode_flags():
    m = NOISE_MODES["distributed-discrete"]
    assert m.discrete and m.secure_aggregation and not m.trusts_server
    assert m.client_noise_std(2.0, 1.0, 3) == m.server_noise_std(2.0, 1.0, 3, 2) == 0.0
    assert m.server_view_multiplier(2.0, 3, 2) == pytest.approx(2.0 * math.sqrt(2 / 3))
    assert m.released_noise_std(2.0, 1.5, 3, 3) == pytest.approx(3.0)
    assert "float64" in m.not_accounted()[0]


@pytest.mark.data
def test_distributed_discrete_runs_on_real_data(small_config, tmp_path):
    """DP-SGD on an MNIST-ST subset in the new mode: the ledger's epsilon is within [0.99, 1] x the target and
    equals common/ddg.py's computation from the events; summary.json and the model card state the mode, the bits
    per coordinate and the wrap probability; `dpdro plan`'s description states them before the run."""
    from dpdro.client.local_transport import LocalTransport
    from dpdro.common.data import load_from_config
    from dpdro.server.engine import train
    from dpdro.server.run_plan import describe_plan, plan_training

    cfg = small_config(noise_mode="distributed-discrete", algorithm="dp-sgd", iterations=3, eval_every=3)
    train_set = load_from_config(cfg, True)
    s = train(cfg, LocalTransport(cfg, train_set), load_from_config(cfg, False)).summary
    assert s["noise_mode"] == "distributed-discrete" and 0.99 * 4 <= s["epsilon_spent"] <= 4
    assert s["epsilon_against_server"] == pytest.approx(s["epsilon_spent"], rel=1e-12)
    d = s["ddg"]
    events = [json.loads(line) for line in open(f"{cfg.out_dir}/events.jsonl")]
    assert d["bits_per_coordinate"] == {e["mechanism"]: e["ddg_bits"] for e in events}
    assert d["wrap_probability"] == 1e-9 and d["shares"] == 3 and d["shortfall_policy"] == "refuse"
    g = ddg.DdgGeometry(d["clip_in_grid_steps"], d["padded_dimension"], d["shares"])
    delta = json.load(open(f"{cfg.out_dir}/config.json"))["delta_resolved"]
    direct = g.epsilon([(e["rate"], e["noise_multiplier"], 1) for e in events], delta)
    assert s["epsilon_spent"] == pytest.approx(direct, rel=1e-9)
    card = open(f"{cfg.out_dir}/MODEL_CARD.md").read()
    assert "Distributed discrete Gaussian: bits per coordinate" in card and "at most 1e-09 per release" in card
    plan = describe_plan(plan_training(cfg, len(train_set), train_set.num_classes, train_set.num_groups,
                                       tuple(train_set.x.shape[1:])))
    assert plan["ddg"]["bits_per_coordinate"]["grad"] == d["bits_per_coordinate"]["grad"]
    assert plan["planned_epsilon"]["ddg"] == pytest.approx(direct, rel=1e-6)


def test_secagg_grid_carries_shares_exactly():
    """The SecAgg+ grid of a DDG round (R = 2^(b-1), Q = 2^b, modulus 2^(b + ceil(log2 m) + 1)) quantises each
    shifted share to itself, and the workflow's dequantised mean maps back to the modular sum exactly (Flower's own
    quantize/dequantize and the workflow's offset and weight formula, reproduced here without the masks, which
    cancel); a round needing more than Flower's 32-bit modulus allows is refused before any node is asked."""
    from flwr.common.secure_aggregation.quantization import dequantize, quantize

    from dpdro.common.codec import ddg_share_sum, to_units
    from dpdro.server.flower.secagg import SecAggRange

    bits, nodes = 20, 4
    qs = [Query(0, "a", "class-onehot", (Point(0, 0.0),), RATE, 1.0, K, ddg=(100.0, 5.0, bits, 101.0, 1)),
          Query(0, "b", "class-onehot", (Point(0, 0.0),), RATE, 1.0, K, ddg=(100.0, 5.0, 17, 101.0, 2))]
    ranges = SecAggRange.for_round(qs, 1000, nodes)
    assert (ranges.clipping_range, ranges.quantization_range, ranges.modulus) == (2.0**19, 2**20, 2**23)
    rng = np.random.default_rng(5)
    shares = [[rng.integers(0, 2**bits, 16).astype(np.float64), rng.integers(0, 2**17, 16).astype(np.float64)]
              for _ in range(nodes)]
    quantised = [quantize(to_units(qs, [Reply(q.qid, 0, s, -1) for q, s in zip(qs, node, strict=True)]),
                          ranges.clipping_range, ranges.quantization_range) for node in shares]
    for node, qz in zip(shares, quantised, strict=True):
        for s, arr in zip(node, qz, strict=True):
            np.testing.assert_array_equal(arr, s)  # step 1: exact
    total = [np.mod(sum(n[j] for n in quantised), ranges.modulus) for j in range(2)]
    means = [(v + -(nodes - 1) * ranges.clipping_range) / nodes
             for v in dequantize(total, ranges.clipping_range, ranges.quantization_range)]
    for j, (q, mean) in enumerate(zip(qs, means, strict=True)):
        want = np.mod(sum(n[j] for n in shares), 2.0 ** q.ddg[2])
        np.testing.assert_array_equal(ddg_share_sum(mean, nodes, bits, int(q.ddg[2])), want)
    big = [Query(0, "a", "class-onehot", (Point(0, 0.0),), RATE, 1.0, K, ddg=(100.0, 5.0, 30, 101.0, 1))]
    with pytest.raises(ConfigError, match="'ddg-bits': a release needs 30 bits .* at most 29 bits on Flower"):
        SecAggRange.for_round(big, 1000, nodes)


@pytest.mark.flower
@pytest.mark.data
def test_flower_secagg_equals_single_node(small_config, tmp_path, flower_superlink):
    """A tiny seeded DP-SGD run in the new mode through Flower's SecAgg+ equals the same run in process: the
    shares are seeded (reproducible) and SecAgg+ carries their modular sum exactly, so the final parameters agree to
    float rounding and the ledgers are identical."""
    from dpdro.client.local_transport import LocalTransport
    from dpdro.common.data import load_from_config
    from dpdro.launch.simulate import run_simulation
    from dpdro.server.engine import train

    keys = {"algorithm": "dp-sgd", "noise_mode": "distributed-discrete", "iterations": 2, "eval_every": 2}
    lcfg = small_config(out_dir=str(tmp_path / "local"), **keys)
    local = train(lcfg, LocalTransport(lcfg, load_from_config(lcfg, True)), load_from_config(lcfg, False))
    cfg = small_config(out_dir=str(tmp_path / "flower"), **keys)
    summary = run_simulation(cfg, stream=False, keep_superlink=True)
    assert summary["transport"] == "flower" and summary["noise_mode"] == "distributed-discrete"
    assert summary["epsilon_spent"] == pytest.approx(local.summary["epsilon_spent"], rel=1e-12)
    assert summary["ddg"]["bits_per_coordinate"] == local.summary["ddg"]["bits_per_coordinate"]
    flower = np.load(tmp_path / "flower" / "final_params.npy")
    np.testing.assert_allclose(flower, local.params, rtol=0, atol=1e-9)
    assert NOISE_MODES["distributed-discrete"].trust_statement("flower").startswith(
        "distributed-discrete: the server saw only the modular sums")  # a seeded run's trust_model says it is seeded


def test_a_resumed_run_charges_a_lost_shortfall_release_at_its_smaller_noise(small_config, tmp_path):
    """A release made after the checkpoint with ddg-shortfall=charge (2 of 3 shares) is charged on resume at the
    multiplier it was charged at, z sqrt(2/3), not the planned z (``engine.charge_lost_releases``)."""
    from dpdro.server.engine import charge_lost_releases

    z, g = 2.0, _geometry()
    book, seen = (Ledger({Mechanism("grad", 0.1): 10}, {"grad": z}, 50.0, DELTA, ddg=g) for _ in range(2))
    lost = [{"iteration": 4, "mechanism": "grad", "rate": 0.1, "noise_multiplier": z,
             "charged_noise_multiplier": z * math.sqrt(2 / 3), "server_view_multiplier": z * math.sqrt(2 / 3)}]
    charge_lost_releases(lost, book, seen, small_config(noise_mode="distributed-discrete").privacy, 3)
    want = g.epsilon([(0.1, z * math.sqrt(2 / 3), 1)], DELTA)
    assert book.epsilon_spent() == pytest.approx(want, rel=1e-12) == seen.epsilon_spent()
