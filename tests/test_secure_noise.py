"""Config key secure-noise (common/rng.py): noise built of OS CSPRNG bytes as the sum of 4 Gaussian draws (Opacus'
secure_mode; Holohan and Braghin 2021) has the right std and shape, is not reproducible from any seed, and the
run's outputs say what it protects against. Statistical tolerances are fixed at about 6 standard errors, so an
honest sampler fails them with probability below 1e-8."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from dpdro.client.worker import ShardWorker
from dpdro.common.config import Config, ConfigError
from dpdro.common.data import ArrayDataset
from dpdro.common.messages import Point, Query
from dpdro.common.rng import csprng_uniform, gaussian_noise, secure_gaussian
from dpdro.server.release import noisy_mean
from dpdro.server.summary import not_accounted

N = 200_000


def test_secure_gaussian_has_the_right_std_and_shape():
    std = 2.5
    x = secure_gaussian(std, (N // 4, 4))
    assert x.shape == (N // 4, 4) and x.dtype == np.float64
    x = x.ravel()
    assert abs(x.mean()) < 6 * std / math.sqrt(N)
    assert abs(x.std() / std - 1) < 6 / math.sqrt(2 * N)  # the sample std's relative standard error is 1/sqrt(2N)
    ks = stats.kstest(x / std, "norm").statistic
    assert ks < 3 / math.sqrt(N)  # P(D > 3 / sqrt(N)) ~ 2 exp(-18) < 4e-8 for a Gaussian
    assert secure_gaussian(0.0, (3,)).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="noise std must be finite and >= 0, got -1"):
        secure_gaussian(-1.0, (3,))


def test_csprng_uniform_is_on_the_53_bit_grid_in_0_1():
    u = csprng_uniform(N)
    assert u.min() > 0 and u.max() <= 1 and np.all(u * 2.0**53 == np.round(u * 2.0**53))
    assert abs(u.mean() - 0.5) < 6 * math.sqrt(1 / 12 / N)


def test_secure_noise_is_not_reproducible_from_the_seed():
    """The same seeded generator gives the same PCG64 noise twice, but different secure noise."""
    q = Query(0, "h", "class-onehot", (Point(0, 0.0),), 1.0, 1.0, 10)
    total = np.zeros(10)
    plain = [noisy_mean(q, total, 1.0, 100, np.random.default_rng(7)) for _ in range(2)]
    secure = [noisy_mean(q, total, 1.0, 100, np.random.default_rng(7), secure=True) for _ in range(2)]
    assert np.array_equal(*plain) and not np.array_equal(*secure)
    a = gaussian_noise(1.0, (10,), np.random.default_rng(7), secure=True)
    assert not np.array_equal(a, gaussian_noise(1.0, (10,), np.random.default_rng(7)))


def test_a_client_with_secure_noise_draws_fresh_noise():
    """A local-mode client answering the same query twice (same seed, same sample: rate 1) adds different noise
    with secure-noise=true; its noise has the query's std."""
    cfg = Config.from_mapping({"noise-mode": "local", "secure-noise": True, "num-clients": 1})
    gen = torch.Generator().manual_seed(1)
    w = ShardWorker(cfg, ArrayDataset(torch.zeros(25, 1, 28, 28), torch.randint(0, 10, (25,), generator=gen), 10,
                                      "t"), 0)
    q = Query(0, "h", "class-onehot", (Point(0, 0.0),), 1.0, 1.0, 10, extra=(0.0,) * 10, noise_std=3.0)
    exact = w.answer(Query(0, "h", "class-onehot", (Point(0, 0.0),), 1.0, 1.0, 10, extra=(0.0,) * 10),
                     {0: np.zeros(1)}).total
    draws = np.stack([w.answer(q, {0: np.zeros(1)}).total - exact for _ in range(400)])
    assert not np.array_equal(draws[0], draws[1])
    assert abs(draws.std() / 3.0 - 1) < 6 / math.sqrt(2 * draws.size)


def test_secure_noise_is_refused_with_reproducible_and_reported():
    with pytest.raises(ConfigError, match="config key 'secure-noise': got true with reproducible=true"):
        Config.from_mapping({"secure-noise": True, "reproducible": True, "reproducible-for-testing": True})

    class Setup:
        prior_source = "private"

    secure = not_accounted(Config.from_mapping({"secure-noise": True}), Setup())
    plain = not_accounted(Config.from_mapping({}), Setup())
    assert any("sum of 4 draws built of OS CSPRNG bytes" in line for line in secure)
    assert any("does not protect against floating-point attacks" in line for line in plain)


@pytest.mark.data
@pytest.mark.parametrize("mode", ["central", "local"])
def test_a_run_with_secure_noise(small_config, tmp_path, mode):
    """A small private run with secure-noise=true (the server's draws in central mode, the clients' in local mode)
    spends its target like any run and says what the secure sampler covers."""
    from dpdro.client.local_transport import LocalTransport
    from dpdro.common.data import load_from_config
    from dpdro.server.engine import train

    cfg = small_config(out_dir=str(tmp_path / mode), noise_mode=mode, algorithm="dp-sgd", secure_noise=True,
                       reproducible=False, reproducible_for_testing=False)
    s = train(cfg, LocalTransport(cfg, load_from_config(cfg, True)), load_from_config(cfg, False)).summary
    assert s["private"] and 0.99 * 4 <= s["epsilon_spent"] <= 4
    assert any("sum of 4 draws built of OS CSPRNG bytes" in line for line in s["not_accounted"])
    assert math.isfinite(s["test_accuracy"])
