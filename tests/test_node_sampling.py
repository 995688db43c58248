"""Node sampling (config key node-sampling-rate) and privacy-unit=node (server/node_sampling.py, ALGORITHMS.md
5.8-5.9): the ledger's accounting of a node-sampled release against independent computations, why it is not
Poisson sampling at rate p r, the seeded sample, the releaser's divisor and the checks made before any work."""

from __future__ import annotations

import json
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import integrate, optimize, stats

from dpdro.common.config import Config, ConfigError
from dpdro.common.messages import Point, Query, Reply
from dpdro.common.transport import RoundResult
from dpdro.server.ledger import NEIGHBOURING_RELATION, Ledger, Mechanism, calibrate, epsilon_of
from dpdro.server.node_sampling import mixed_rdp, sample_partitions


def _pld_accountant(event=None):
    acc = pld_privacy_accountant.PLDAccountant(neighboring_relation=NEIGHBOURING_RELATION,
                                               value_discretization_interval=1e-3)
    if event is not None:
        acc.compose(event)
    return acc


def _event(rate, z, count):
    sampled = dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(z))
    return dp_accounting.SelfComposedDpEvent(sampled, count)


@pytest.mark.parametrize(("p", "r", "z", "t"), [(0.3, 0.1, 1.0, 5), (0.05, 0.5, 2.0, 12)])
def test_ledger_equals_a_binomial_mixture_of_dp_accountings_compositions(p, r, z, t):
    """T node-sampled releases: the node is in k of them with probability Binom(T, p)(k), so the privacy profile is
    sum_k Binom(T, p)(k) delta_k(eps), delta_k that of k record-level releases, each composed by dp-accounting's own
    PLDAccountant. The ledger's epsilon at delta equals the root of that profile to 1e-6."""
    delta = 1e-5
    accs = [_pld_accountant(_event(r, z, k)) if k else None for k in range(t + 1)]

    def profile(eps):
        return sum(stats.binom.pmf(k, t, p) * accs[k].get_delta(eps) for k in range(1, t + 1))

    independent = optimize.brentq(lambda e: profile(e) - delta, 1e-6, 60, xtol=1e-12)
    assert epsilon_of({(r, z): t}, delta, "pld", p) == pytest.approx(independent, abs=1e-6)


def test_one_release_spends_the_record_level_epsilon_at_delta_over_p():
    """One release: its profile is p delta_r(eps), so its epsilon at delta is the record-level one at delta / p."""
    p, r, z, delta = 0.1, 0.2, 0.8, 1e-6
    record_level = _pld_accountant(_event(r, z, 1)).get_epsilon(delta / p)
    assert epsilon_of({(r, z): 1}, delta, "pld", p) == pytest.approx(record_level, abs=1e-6)


def test_rdp_of_the_mixture_is_the_log_moment_of_the_node_coin():
    """Renyi DP of the mixture at order a: log(1 - p + p e^{(a-1) D_a}) / (a - 1), checked against the direct moment
    E_Q[(P/Q)^a] of the two-point coin times dp-accounting's own RDP; p = 1 gives dp-accounting's epsilon."""
    p, r, z, t, delta = 0.2, 0.3, 1.5, 50, 1e-5
    orders = np.array([2.0, 4.0, 8.0, 16.0, 32.0])
    base = rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(r, z, orders)  # noqa: SLF001
    direct = [math.log((1 - p) * 1.0 + p * math.exp((a - 1) * d)) / (a - 1) for a, d in zip(orders, base, strict=True)]
    assert np.allclose(mixed_rdp(base, orders, p), direct, rtol=1e-12)
    acc = rdp_privacy_accountant.RdpAccountant(neighboring_relation=NEIGHBOURING_RELATION)
    acc.compose(_event(r, z, t))
    assert epsilon_of({(r, z): t}, delta, "rdp", 1.0) == pytest.approx(acc.get_epsilon(delta), rel=1e-12)
    assert epsilon_of({(p * r, z): t}, delta, "rdp") < epsilon_of({(r, z): t}, delta, "rdp", p) \
        < epsilon_of({(r, z): t}, delta, "rdp")


def _hockey_stick(mu, mu_prime, eps, lo=-40.0, hi=80.0):
    return integrate.quad(lambda x: max(mu(x) - math.exp(eps) * mu_prime(x), 0.0), lo, hi, limit=400,
                          points=[0.0, 30.0, 31.0])[0]


def test_a_node_whose_other_records_stand_apart_breaks_poisson_sampling_at_p_times_r():
    """Why the ledger does not charge Poisson sampling at rate p r (ALGORITHMS.md 5.8): a record y (norm 1) whose
    node's other sampled records sum to t = 30 noise stds, replaced with the null record. Output densities (sigma 1,
    the rest of the data at 0): (1 - p) N(0) + p [(1 - r) N(t) + r N(t + 1)] against (1 - p) N(0) + p N(t). By direct
    integration its delta at epsilon 1 is p times the record-level one (the revealed mixture's), far above what
    dp-accounting gives Poisson sampling at rate p r; the ledger's epsilon covers it."""
    p, r, t, eps = 0.05, 0.5, 30.0, 1.0
    n = stats.norm.pdf

    def mu(x):
        return (1 - p) * n(x) + p * ((1 - r) * n(x - t) + r * n(x - t - 1))

    def mu_prime(x):
        return (1 - p) * n(x) + p * n(x - t)

    actual = max(_hockey_stick(mu, mu_prime, eps), _hockey_stick(mu_prime, mu, eps))
    record_level = _pld_accountant(_event(r, 1.0, 1)).get_delta(eps)
    assert actual == pytest.approx(p * record_level, rel=1e-3)
    assert actual > 10 * _pld_accountant(_event(p * r, 1.0, 1)).get_delta(eps)  # p r would under-charge
    assert epsilon_of({(r, 1.0): 1}, actual, "pld", p) >= eps - 1e-3  # the ledger does not


def test_node_rate_one_is_the_record_level_ledger_and_calibration():
    plan = {Mechanism("grad", 0.01): 100}
    assert epsilon_of({(0.01, 1.0): 100}, 1e-5, "pld", 1.0) == epsilon_of({(0.01, 1.0): 100}, 1e-5, "pld")
    assert calibrate(plan, 2.0, 1e-5, "pld", 1.0) == calibrate(plan, 2.0, 1e-5, "pld")
    # node sampling needs less noise for the same target, never less than charging rate p r would
    s = calibrate(plan, 2.0, 1e-5, "pld", 0.5)
    assert calibrate({Mechanism("grad", 0.005): 100}, 2.0, 1e-5, "pld") < s < calibrate(plan, 2.0, 1e-5, "pld")
    ledger = Ledger(plan, {"grad": s}, 2.0, 1e-5, "pld", node_rate=0.5)
    for _ in range(100):
        ledger.charge("grad", 0.01)
    assert 0.99 * 2.0 <= ledger.epsilon_spent() <= 2.0


def test_node_sample_is_seeded_by_partition_and_fresh_per_release():
    a = sample_partitions(True, 7, 3, "grad", 0.3, range(1000), 1000)
    assert a == sample_partitions(True, 7, 3, "grad", 0.3, range(1000), 1000)
    assert a != sample_partitions(True, 7, 4, "grad", 0.3, range(1000), 1000)
    assert a != sample_partitions(True, 7, 3, "eta", 0.3, range(1000), 1000)
    assert 240 <= len(a) <= 360  # Binom(1000, 0.3): mean 300, std 14.5
    # a partition's draw does not depend on which others take part (a dropped Flower node)
    assert sample_partitions(True, 7, 3, "grad", 0.3, range(0, 1000, 2), 1000) == {k for k in a if k % 2 == 0}
    assert sample_partitions(True, 7, 3, "grad", 1.0, range(10), 10) is None  # p = 1: every node, nothing drawn
    with pytest.raises(ValueError, match="node-sampling rate"):
        sample_partitions(True, 7, 3, "grad", 0.0, range(10), 10)


class _Nodes:
    """m nodes with one record each, every one replying the vector (1, 0) and count 1; records the partitions
    asked per mechanism."""

    def __init__(self, m: int) -> None:
        self.num_clients = self.num_records = m
        self.partitions = list(range(m))
        self.asked: list[set[int]] = []

    def run(self, queries, versions, sampled=None):
        out = RoundResult({q.qid: [] for q in queries})
        for q in queries:
            pids = self.partitions if sampled is None else sorted(sampled[q.mechanism])
            self.asked.append(set(pids))
            out.replies[q.qid] = [Reply(q.qid, pid, np.array([1.0, 0.0]), 1) for pid in pids]
        return out


def test_releaser_asks_the_sample_and_divides_by_the_expected_count(tmp_path):
    """A release asks only the sampled nodes and divides the sum by the expected count p r n (not by the realised
    one); the ledger is charged at the record rate with the node mixture."""
    from dpdro.server.releaser import Releaser
    from dpdro.server.rundir import RunDir

    m, p = 200, 0.25
    cfg = Config.from_mapping({"algorithm": "dp-sgd", "num-clients": m, "epsilon": "inf", "node-sampling-rate": p,
                               "reproducible": True, "out-dir": str(tmp_path)})
    rd = RunDir(tmp_path)
    rd.create()
    nodes = _Nodes(m)
    ledger = Ledger({Mechanism("grad", 1.0): 2}, {"grad": 0.0}, math.inf, 1e-5, node_rate=p)
    releaser = Releaser(cfg, nodes, ledger, m, rd)
    q = Query(0, "grad", "class-onehot", (Point(0, 0.0),), 1.0, math.inf, 2)
    mean = releaser.run([q], {0: np.zeros(1)})["grad"]
    asked = nodes.asked[-1]
    assert asked == sample_partitions(True, cfg.seed, 0, "grad", p, range(m), m) and 0 < len(asked) < m
    assert mean[0] == pytest.approx(len(asked) / (p * m), rel=1e-12)
    [event] = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert event["expected_batch"] == pytest.approx(p * m) and event["clients"] == len(asked)


def test_bad_values_are_refused_before_any_work():
    with pytest.raises(ConfigError, match="'node-sampling-rate'.*allowed: a number in \\(0, 1\\]"):
        Config.from_mapping({"node-sampling-rate": 0})
    with pytest.raises(ConfigError, match="'node-sampling-rate'"):
        Config.from_mapping({"node-sampling-rate": 1.01})
    with pytest.raises(ConfigError, match="'privacy-unit'.*one of 'record', 'node'"):
        Config.from_mapping({"privacy-unit": "person"})
    with pytest.raises(ConfigError, match="'privacy-unit'.*3 expected sampled nodes.*at least 10"):
        Config.from_mapping({"privacy-unit": "node", "num-clients": 30, "node-sampling-rate": 0.1})
    with pytest.raises(ConfigError, match="'node-sampling-rate'.*noise-mode='distributed'"):
        Config.from_mapping({"node-sampling-rate": 0.5, "noise-mode": "distributed"})
    Config.from_mapping({"privacy-unit": "node", "num-clients": 1000, "node-sampling-rate": 0.03})  # 30 expected


def test_node_level_noise_above_the_expected_nodes_is_refused():
    from dpdro.server.node_sampling import check_node_noise

    check_node_noise({"grad": 2.9}, 0.03, 100)
    with pytest.raises(ConfigError, match="grad \\(z = 3.5\\).*p m = 3"):
        check_node_noise({"grad": 3.5}, 0.03, 100)


def test_a_node_contribution_is_its_mean_clipped_as_one_vector():
    import torch

    from dpdro.client.worker import node_contribution

    total = torch.tensor([30.0, 40.0], dtype=torch.float64)  # 10 records
    assert torch.allclose(node_contribution(total, 10, 10.0), torch.tensor([3.0, 4.0], dtype=torch.float64))
    clipped = node_contribution(total, 10, 1.0)
    assert float(torch.linalg.vector_norm(clipped)) <= 1.0 and float(clipped[0]) == pytest.approx(0.6)
    assert torch.equal(node_contribution(total * 0, 0, 1.0), torch.zeros(2, dtype=torch.float64))
    diverged = torch.tensor([float("nan"), 1.0], dtype=torch.float64)  # e.g. local steps that blew up
    assert torch.equal(node_contribution(diverged, 1, 1.0), torch.zeros(2, dtype=torch.float64))



@pytest.mark.data
def test_node_sampled_and_node_level_runs_on_real_data(small_config, tmp_path):
    """Single-node runs: with node sampling each release sums a Poisson sample of the nodes and the run spends its
    target; with privacy-unit=node delta is 1/(10 m), each release is charged at rate p over the nodes and the
    summary and model card state the unit."""
    from dpdro.client.local_transport import LocalTransport
    from dpdro.common.data import load_from_config
    from dpdro.server.engine import train

    def run(cfg):
        return train(cfg, LocalTransport(cfg, load_from_config(cfg, True)), load_from_config(cfg, False))

    cfg = small_config(out_dir=str(tmp_path / "rec"), algorithm="dp-sgd", num_clients=6, node_sampling_rate=0.5,
                       epsilon=2.0)
    out = run(cfg).summary
    assert 0.99 * 2.0 <= out["epsilon_spent"] <= 2.0 and out["node_sampling_rate"] == 0.5
    events = [json.loads(line) for line in open(tmp_path / "rec" / "events.jsonl")]
    grads = [e for e in events if e["mechanism"] == "grad"]
    assert {e["expected_batch"] for e in grads} == {0.5 * 300} and len({e["clients"] for e in grads}) > 1

    cfg = small_config(out_dir=str(tmp_path / "node"), algorithm="dp-sgd", num_clients=12, privacy_unit="node",
                       max_train_records=600, epsilon=8.0)
    out = run(cfg).summary
    assert out["privacy_unit"] == "node" and out["delta"] == pytest.approx(1 / 120)
    assert set(out["sampling_rates"].values()) == {1.0} and 0.99 * 8 <= out["epsilon_spent"] <= 8
    assert any("n and the shard sizes" in s for s in out["not_accounted"])
    assert "node-level (one node's whole data" in open(tmp_path / "node" / "MODEL_CARD.md").read()


class _FailingNodes(_Nodes):
    """_Nodes in which partition ``bad`` fails ``failures`` times when asked."""

    def __init__(self, m: int, bad: int, failures: int) -> None:
        super().__init__(m)
        self.bad, self.failures = bad, failures

    def run(self, queries, versions, sampled=None):
        out = super().run(queries, versions, sampled)
        if self.bad in self.asked[-1] and self.failures > 0:
            self.failures -= 1
            out.failures[self.bad] = "RuntimeError: injected"
            for q in queries:
                out.replies[q.qid] = [r for r in out.replies[q.qid] if r.partition != self.bad]
        return out


@pytest.mark.parametrize("policy", ["drop", "retry"])
def test_a_sampled_node_that_fails_follows_the_failure_policy(policy):
    """A sampled node that fails: 'drop' releases the other sampled nodes' replies (min(min-clients, asked) of them
    remain); 'retry' asks the same sample again, and it answers."""
    from dpdro.server.releaser import collect_round

    m, p = 40, 0.5
    cfg = Config.from_mapping({"algorithm": "dp-sgd", "num-clients": m, "node-sampling-rate": p, "reproducible": True,
                               "on-client-failure": policy, "min-clients": 2, "epsilon": "inf"})
    q = Query(3, "grad", "class-onehot", (Point(0, 0.0),), 1.0, math.inf, 2)
    sample = sample_partitions(True, cfg.seed, 3, "grad", p, range(m), m)
    nodes = _FailingNodes(m, bad=min(sample), failures=1)
    replies = collect_round(cfg, nodes, [q], {0: np.zeros(1)})[q.qid]
    got = {r.partition for r in replies}
    assert all(asked == sample for asked in nodes.asked)
    assert got == (sample - {min(sample)} if policy == "drop" else sample)
    assert len(nodes.asked) == (1 if policy == "drop" else 2)


def test_a_node_level_class_histogram_too_noisy_to_use_is_warned_about():
    """privacy-unit=node: the class histogram comes from the p m sampled nodes, noise std z_h / (p m) per class share;
    at 1,000 nodes and p = 0.03 (std 0.33) the run is warned before any work, with public priors or record level
    not."""
    import warnings

    from dpdro.common.config import NoisyPriorWarning

    node = {"algorithm": "dp-sgd-la", "privacy-unit": "node", "num-clients": 1000, "node-sampling-rate": 0.03,
            "eval-data": "server"}
    with pytest.warns(NoisyPriorWarning, match=r"= 0\.333"):
        Config.from_mapping(node)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoisyPriorWarning)
        Config.from_mapping({**node, "class-prior": "public", "class-prior-values": "1,1,1,1,1,1,1,1,1,1"})
        Config.from_mapping({**node, "privacy-unit": "record"})
        Config.from_mapping({**node, "node-sampling-rate": 1.0})  # std 0.01
