"""ServerApp of the latency benchmark: Flower's own ``FedAvg`` (flwr.serverapp.strategy) over every node,
no client-side evaluation; the time of each round is taken from the strategy's ``evaluate_fn`` callback
(called before round 1 and after each round) and written as JSON to the run config's ``out-file``."""

import json
import time

import numpy as np
from flwr.app import Array, ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    k = int(cfg["min-nodes"])
    deadline = time.monotonic() + 300
    while len(list(grid.get_node_ids())) < k:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {k} nodes connected within 300 s")
        time.sleep(0.05)
    stamps: list[float] = []

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        stamps.append(time.perf_counter())
        return MetricRecord({"round": server_round})

    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=k, min_available_nodes=k)
    initial = ArrayRecord({"w": Array(np.zeros(int(cfg["dim"]), dtype=np.float32))})
    strategy.start(grid=grid, initial_arrays=initial, num_rounds=int(cfg["num-rounds"]), timeout=600,
                   evaluate_fn=evaluate_fn)
    rounds = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    print(f"[fedavg] seconds per round: {[round(r, 3) for r in rounds]}", flush=True)
    if cfg["out-file"]:
        with open(str(cfg["out-file"]), "w") as f:
            json.dump({"round_seconds": rounds, "nodes": k, "dim": int(cfg["dim"])}, f)
