"""ClientApp of the DP-FedAvg anchor: local SGD on the node's shard from the received flat parameters ``w``
(``local-epochs`` passes of mini-batches of ``batch`` records at step ``lr``), the updated parameters returned with
num-examples = 1 (equal weights: DP-FedAvg's fixed-denominator mean, McMahan et al. 2018; Flower's accounted path
requires them). A node without records returns ``w`` moved by one float32 ulp in one coordinate (Flower's clip
divides by the update's norm). The update is clipped and noised by the server's wrapper, not here."""

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from dpdro.simulations.dp_fedavg import anchor_config, node_shard

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = anchor_config(context.run_config)
    settings = msg.content["config"]
    pid = int(context.node_config["partition-id"])
    x, y, model = node_shard(cfg, pid)
    w = torch.from_numpy(np.asarray(msg.content["arrays"]["w"].numpy(), dtype=np.float32).copy())
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + int(settings["server-round"]) * 10_007 + pid)
    lr, batch = float(settings["lr"]), int(settings["batch"])
    torch.set_num_threads(1)
    for _ in range(int(settings["local-epochs"])):
        order = torch.randperm(len(y), generator=gen)
        for s in range(0, len(y), batch):
            b = order[s:s + batch]
            w.requires_grad_(True)
            (g,) = torch.autograd.grad(model.losses(w, x[b], y[b]).mean(), w)
            w = (w - lr * g).detach()
    if len(y) == 0:  # no records: a zero update, on which Flower's clip divides by zero (flwr 1.42
        w[0] = torch.nextafter(w[0], torch.tensor(float("inf")))  # supercore/differential_privacy.py): one ulp
    reply = RecordDict({"arrays": ArrayRecord({"w": Array(w.numpy())}), "metrics": MetricRecord({"num-examples": 1})})
    return Message(reply, reply_to=msg)
