"""Secure aggregation of one round of releases with Flower's SecAgg+ (noise-mode=distributed on Flower).

Flower 1.42 ships SecAgg+ only as a legacy-strategy workflow (``flwr.server.workflow.SecAggPlusWorkflow``,
docs/explanation/FLOWER.md section 4): four 'train' message rounds (setup, share keys, collect masked vectors,
unmask) whose third round carries a legacy FitIns and reads back a FitRes. This module drives that workflow from our
ServerApp for one round of queries:

- the FitIns of a node carries the round's queries (JSON in its config) and the model versions the node lacks
  (its parameters); the node's ClientApp answers with its noised sums (each client adds its share
  N(0, (z S)^2 / m_min) before anything leaves it) as the FitRes parameters, one array per query, divided by the
  query's sensitivity S so that every array is in units of S;
- the secaggplus_mod on the node quantises each array into the fixed-point grid of ``SecAggRange``, masks it
  and uploads only the masked integers; the server unmasks the modular sum of the nodes that finished stage 2
  (dropped nodes' masks are reconstructed from secret shares), dequantises and divides by their number;
- we multiply back by that number and by S: the server learns the sum of the surviving nodes' noised sums and
  nothing about any single node (beyond what the sum says).

Every FitRes has num_examples = 1 and max_weight = 1, so the workflow's weighting is exactly 1 per node.
The quantisation is stochastic rounding to a grid of step 2 R / Q: each node's error per coordinate is below
one step, so the sum of k nodes is within k steps (times S) of the exact sum; ``SecAggRange.bound`` reports it
for every release, and the run refuses to start unless the step is at most a tenth of a share's noise std
(``noise_modes.check_secagg_grid``). R = (largest shard) + 10 noise stds covers any clipped sum (its coordinates
are at most S times the node's record count) plus its noise share except with probability < 1e-22 per coordinate,
so the workflow's own clipping to [-R, R] essentially never acts.

noise-mode=distributed-discrete: the nodes' arrays are their DDG shares (integers modulo 2^b, ``common.ddg``), which
the grid of ``SecAggRange.for_round`` carries exactly (step 1); the server gets their integer sum and reduces it
modulo 2^b (``codec.ddg_share_sum``): what the distributed discrete Gaussian's analysis assumes secure aggregation
reveals, with no quantisation error.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from ...common.codec import ddg_round_bits, ddg_share_sum
from ...common.config import ConfigError
from ...common.messages import Query
from ...common.noise_modes import secagg_grid

log = logging.getLogger(__name__)
MODULUS = 2**32


@dataclass(frozen=True)
class SecAggRange:
    """The fixed-point grid of one SecAgg+ round: clipping range R (in units of each query's sensitivity)
    and quantisation range Q (a power of two with m Q < 2^32 for m nodes, so that the modular sum cannot
    wrap)."""

    clipping_range: float
    quantization_range: int
    modulus: int = MODULUS

    @classmethod
    def for_round(cls, queries: list[Query], largest_shard: int, clients: int) -> SecAggRange:
        """``noise_modes.secagg_grid``: R = largest shard + 1 + 10 noise-share stds (units of S); Q = 2^(31 - ceil(log2
        m)), so m Q <= 2^31 (``release.check_secagg_grid`` refused, before the run, a step not small against a
        share). A round of DDG shares (noise-mode=distributed-discrete, b = ``codec.ddg_round_bits``): R = 2^(b-1),
        Q = 2^b (step 1: each share, sent shifted by -R, ``codec.to_units``, is quantised to itself, exactly) and
        modulus 2^(b + ceil(log2 m) + 1) > m Q (room for the workflow's weight factor m Q); ConfigError, before any
        node is asked, when that exceeds Flower's 2^32."""
        bits = ddg_round_bits(queries)
        if bits:
            room = max(1, math.ceil(math.log2(max(clients, 2)))) + 1
            if bits + room > 32:
                raise ConfigError(f"config key 'ddg-bits': a release needs {bits} bits per coordinate, and SecAgg+ "
                                  f"over {clients} nodes needs {room} more within Flower's 32-bit modulus; allowed: "
                                  f"at most {32 - room} bits on Flower (a larger ddg-wrap-probability, or fewer "
                                  "records per release, needs fewer)")
            return cls(2.0 ** (bits - 1), 2**bits, 2 ** (bits + room))
        shares = [q.noise_std / q.sensitivity for q in queries if q.sensitivity > 0 and math.isfinite(q.sensitivity)]
        return cls(*secagg_grid(largest_shard, max(shares, default=0.0), clients))

    @property
    def step(self) -> float:
        """Quantisation step 2 R / Q, in units of a query's sensitivity."""
        return 2.0 * self.clipping_range / self.quantization_range

    def bound(self, clients: int, sensitivity: float) -> float:
        """Largest error per coordinate of the sum of ``clients`` quantised arrays, in the query's own units."""
        return clients * self.step * sensitivity


class SecureRound:
    """Runs SecAgg+ once for ``queries`` over ``node_of`` (partition -> Flower node id) on ``grid``.

    ``contents`` maps node id -> (FitIns parameters as a list of arrays, FitIns config). ``run`` returns
    (qid -> the summed noised vector, number of nodes in the sum, node ids that dropped), or raises
    RuntimeError when the protocol halted (too few nodes for the reconstruction threshold): nothing was
    learned by the server then.
    """

    def __init__(self, grid, context, timeout: float, num_shares: int | float, threshold: int | float,
                 ranges: SecAggRange) -> None:
        self.grid, self.context, self.timeout = grid, context, timeout
        self.num_shares, self.threshold, self.ranges = num_shares, threshold, ranges
        self.round = 0

    def run(self, queries: list[Query], contents: dict[int, tuple[list[np.ndarray], dict]]
            ) -> tuple[dict[str, np.ndarray], int, list[int]]:
        """Run the four SecAgg+ stages once (see the class docstring for what it returns and raises)."""
        from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
        from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays
        from flwr.server.compat.grid_client_proxy import GridClientProxy
        from flwr.server.compat.legacy_context import LegacyContext
        from flwr.server.strategy import FedAvg
        from flwr.server.workflow import SecAggPlusWorkflow
        from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
        from flwr.server.workflow.constant import Key as WorkflowKey

        self.round += 1
        captured: dict = {}
        proxies = {nid: GridClientProxy(nid, self.grid, self.context.run_id) for nid in contents}

        class _Capture(FedAvg):
            """A legacy strategy that hands each node its own FitIns and keeps the secure aggregate."""

            def configure_fit(self, server_round, parameters, client_manager):
                """Each node's own FitIns (queries and the versions it lacks)."""
                return [(proxies[nid], FitIns(ndarrays_to_parameters(arrays), config))
                        for nid, (arrays, config) in contents.items()]

            def aggregate_fit(self, server_round, results, failures):
                """Keep the unmasked mean (identical in every result) and the nodes in it."""
                if results:
                    captured["mean"] = parameters_to_ndarrays(results[0][1].parameters)
                    captured["nodes"] = [p.node_id for p, _ in results]
                return None, {}

        ctx = Context(run_id=self.context.run_id, node_id=self.context.node_id, node_config=self.context.node_config,
                      state=RecordDict(), run_config=self.context.run_config)
        legacy = LegacyContext(ctx, strategy=_Capture())
        legacy.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: self.round})
        legacy.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
        workflow = SecAggPlusWorkflow(self.num_shares, self.threshold, max_weight=1.0,
                                      clipping_range=self.ranges.clipping_range,
                                      quantization_range=self.ranges.quantization_range,
                                      modulus_range=self.ranges.modulus,
                                      timeout=self.timeout)
        flwr_log = logging.getLogger("flwr")
        level = flwr_log.level
        flwr_log.setLevel(logging.WARNING)  # the workflow logs four stages at INFO/DEBUG for every release
        try:
            workflow(self.grid, legacy)
        finally:
            flwr_log.setLevel(level)
        if "mean" not in captured:
            raise RuntimeError("SecAgg+ halted (too few nodes answered for its reconstruction threshold); "
                               "the server learned nothing of this round")
        k = len(captured["nodes"])
        bits = ddg_round_bits(queries)
        sums = {q.qid: ddg_share_sum(a, k, bits, int(q.ddg[2])) if q.ddg else
                np.asarray(a, dtype=np.float64) * k * q.sensitivity
                for q, a in zip(queries, captured["mean"], strict=True)}
        dropped = sorted(set(contents) - set(captured["nodes"]))
        return sums, k, dropped
