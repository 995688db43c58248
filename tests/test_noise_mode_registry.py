"""The NoiseMode registry (common/noise_modes.py): one object per value of config key noise-mode, each giving the
formulas of server/release.py's docstring, and summary.json's trust statements unchanged."""

from __future__ import annotations

import math

import pytest

from dpdro.common.config import Config, field_by_key
from dpdro.common.noise_modes import NOISE_MODES, noise_mode
from dpdro.server.summary import trust_statement

Z, S, M_MIN = 1.3, 2.0, 4


def test_registry_matches_the_config_choices():
    assert tuple(NOISE_MODES) == field_by_key()["noise-mode"].choices
    with pytest.raises(ValueError, match="unknown noise mode 'nope'; allowed: central, distributed, local"):
        noise_mode("nope")


@pytest.mark.parametrize("k", [2, 4, 6])
def test_stds_and_server_view(k):
    central, distributed, local = (NOISE_MODES[m] for m in ("central", "distributed", "local"))
    assert (central.client_noise_std(Z, S, M_MIN), central.server_noise_std(Z, S, M_MIN, k)) == (0.0, Z * S)
    assert central.released_noise_std(Z, S, M_MIN, k) == pytest.approx(Z * S, rel=1e-15)
    assert central.server_view_multiplier(Z, M_MIN, k) == 0.0
    assert distributed.client_noise_std(Z, S, M_MIN) == pytest.approx(Z * S / 2, rel=1e-15)
    assert distributed.server_noise_std(Z, S, M_MIN, k) == pytest.approx(Z * S * math.sqrt(max(M_MIN - k, 0) / M_MIN))
    assert distributed.released_noise_std(Z, S, M_MIN, k) == pytest.approx(Z * S * math.sqrt(max(k, M_MIN) / M_MIN))
    assert distributed.server_view_multiplier(Z, M_MIN, k) == pytest.approx(Z * math.sqrt(k / M_MIN))
    assert (local.client_noise_std(Z, S, M_MIN), local.server_noise_std(Z, S, M_MIN, k)) == (Z * S, 0.0)
    assert local.released_noise_std(Z, S, M_MIN, k) == pytest.approx(Z * S * math.sqrt(k))
    assert local.server_view_multiplier(Z, M_MIN, k) == Z


@pytest.mark.parametrize("mode", list(NOISE_MODES))
def test_no_noise_when_not_private(mode):
    m = NOISE_MODES[mode]
    for z, s in ((0.0, S), (Z, math.inf)):
        assert m.client_noise_std(z, s, M_MIN) == m.server_noise_std(z, s, M_MIN, 3) == 0.0
        assert m.released_noise_std(z, s, M_MIN, 3) == 0.0


def test_flags_and_trust_statements():
    assert [m.secure_aggregation for m in NOISE_MODES.values()] == [False, True, False, True]
    assert [m.trusts_server for m in NOISE_MODES.values()] == [True, False, False, False]
    assert [m.discrete for m in NOISE_MODES.values()] == [False, False, False, True]
    assert NOISE_MODES["distributed"].server_view_multiplier(Z, M_MIN, 0) == math.inf
    cfg = Config.from_mapping({"noise-mode": "distributed", "num-clients": 2})
    assert trust_statement(cfg, "flower").startswith("distributed: the server saw only SecAgg+ sums")
    assert trust_statement(cfg, "local").startswith("distributed: in-process run")
    assert trust_statement(Config.from_mapping({"noise-mode": "local"}), "local").startswith("local: every client")
    assert trust_statement(Config.from_mapping({}), "local").startswith("central: the server saw")
    assert NOISE_MODES["distributed"].not_accounted()[0].startswith("SecAgg+ quantisation")
    assert NOISE_MODES["central"].not_accounted() == NOISE_MODES["local"].not_accounted() == []
