"""ServerApp of the DP-FedAvg anchor: Flower's ``FedAvg`` (each round ``sampled`` of the nodes drawn uniformly
without replacement, Flower's own sampler) wrapped in Flower's ``DifferentialPrivacyServerSideFixedClipping``
(each node's update clipped to ``clip`` in L2, Gaussian noise of std noise-multiplier x clip / sampled added to the
mean), from dpdro's initial model, for ``num-rounds`` rounds. The final parameters (flat float32) are written to
``out-file`` (.npy, atomically) with the seconds of each round beside them (.json)."""

import json
import os
import time

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

from dpdro.simulations.dp_fedavg import anchor_config, node_shard

app = ServerApp()


def _save(path: str, w: np.ndarray) -> None:
    tmp = path + ".tmp.npy"
    np.save(tmp, w)
    os.replace(tmp, path)


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    cfg = anchor_config(rc)
    nodes, sampled, rounds = cfg.num_clients, int(rc["sampled"]), int(rc["num-rounds"])
    deadline = time.monotonic() + 900
    while len(list(grid.get_node_ids())) < nodes:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {nodes} nodes connected within 900 s")
        time.sleep(0.1)
    model = node_shard(cfg, 0)[2]  # the model as every node builds it (dpdro's, seeded by the config's seed)
    w0 = model.initial().detach().numpy().astype(np.float32)
    fedavg = FedAvg(fraction_train=sampled / nodes, fraction_evaluate=0.0, min_train_nodes=sampled,
                    min_available_nodes=nodes)
    strategy = DifferentialPrivacyServerSideFixedClipping(fedavg, noise_multiplier=float(rc["noise-multiplier"]),
                                                          clipping_norm=float(rc["clip"]), num_sampled_clients=sampled)
    stamps: list[float] = []
    out = str(rc["out-file"])

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        stamps.append(time.perf_counter())
        if server_round == rounds and out:
            _save(out, arrays["w"].numpy())
        return MetricRecord({"round": server_round})

    train_config = ConfigRecord({"lr": float(rc["lr"]), "local-epochs": int(rc["local-epochs"]),
                                 "batch": int(rc["batch"])})
    strategy.start(grid=grid, initial_arrays=ArrayRecord({"w": Array(w0)}), num_rounds=rounds, timeout=600,
                   train_config=train_config, evaluate_fn=evaluate_fn)
    if out:
        with open(out + ".json", "w") as f:
            json.dump({"round_seconds": [b - a for a, b in zip(stamps, stamps[1:], strict=False)]}, f)
