"""What a book-keeping engine (Bu et al. 2023) would buy on the MNIST CNN, measured before building one: the clipped
sum of per-record gradients from one backward pass (layer inputs and output gradients kept by hooks, each record's
weight gradient of a convolution formed as an unfold and a batched product, GroupNorm's and the linear layers' from
their two factors), against torch.func's per-record gradients (the product's default engine) and a non-private
step, on one synthetic batch; the two clipped sums are checked equal.

    nice -n 5 python -m dpdro.simulations.bench_bookkeeping [--batch 256] [--repeats 15]

Prints the median seconds and the ratios to the non-private step (the goal of a refresh: <= 1.3), then where the
book-keeping step spends its time (torch.profiler). A benchmark, not a test; nothing here is used by a run.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap


def bookkeeping_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float) -> torch.Tensor:
    """sum_i min(1, clip / ||g_i||) g_i (d,) from one backward pass (the layers' output gradients; the summed
    parameter gradients it also forms are cheaper than freezing the parameters, which makes the first convolution
    form its input gradient instead: 26 against 5 ms a call measured here): per layer, the records' gradient blocks,
    their squared norms summed over the blocks, then one weighted sum per block. Conv2d, Linear and GroupNorm
    layers only."""
    acts, grads, layers = {}, {}, []

    def keep(mod, inputs, out):
        acts[mod] = inputs[0].detach()
        out.register_hook(lambda g: grads.__setitem__(mod, g.detach()))

    handles = []
    for mod in model.modules():
        if isinstance(mod, (nn.Conv2d, nn.Linear, nn.GroupNorm)):
            layers.append(mod)
            handles.append(mod.register_forward_hook(keep))
    try:
        model.zero_grad()
        F.cross_entropy(model(x), y, reduction="sum").backward()
    finally:
        for h in handles:
            h.remove()
    blocks = []
    for mod in layers:
        a, g = acts[mod], grads[mod]
        if isinstance(mod, nn.Conv2d):
            u = F.unfold(a, mod.kernel_size, padding=mod.padding, stride=mod.stride)  # (B, C_in k^2, L)
            blocks += [torch.bmm(g.flatten(2), u.transpose(1, 2)).flatten(1), g.flatten(2).sum(2)]
        elif isinstance(mod, nn.Linear):
            blocks += [(g[:, :, None] * a[:, None, :]).flatten(1), g]
        else:
            blocks += [(F.group_norm(a, mod.num_groups, eps=mod.eps) * g).flatten(2).sum(2), g.flatten(2).sum(2)]
    norms = torch.stack([b.square().sum(1) for b in blocks]).sum(0).sqrt()
    scale = (clip / norms).clamp(max=1.0)
    return torch.cat([scale @ b for b in blocks])


def torch_func_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float) -> torch.Tensor:
    """The same clipped sum from torch.func's per-record gradients (vmap of grad)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    rows = torch.cat([v.reshape(len(x), -1) for v in g.values()], 1)
    return (clip / rows.norm(dim=1)).clamp(max=1.0) @ rows


def main(argv: list[str] | None = None) -> None:
    from ..common.models import GroupNormCNN

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GroupNormCNN(10)
    hooked = copy.deepcopy(model)  # torch.func refuses a module with hooks
    x, y = torch.randn(a.batch, 1, 28, 28), torch.randint(0, 10, (a.batch,))

    def nonprivate():
        model.zero_grad()
        F.cross_entropy(model(x), y, reduction="sum").backward()

    steps = {"non-private": nonprivate, "torch.func": lambda: torch_func_sum(model, x, y, 1.0),
             "book-keeping": lambda: bookkeeping_sum(hooked, x, y, 1.0)}
    times = {k: [] for k in steps}
    for _ in range(a.repeats + 1):  # interleaved, the first round dropped (warm-up)
        for k, f in steps.items():
            s = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - s)
    med = {k: sorted(v[1:])[len(v) // 2] for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:13s} {v * 1e3:7.2f} ms  ({v / med['non-private']:.2f} x non-private)")
    diff = (torch_func_sum(model, x, y, 1.0) - bookkeeping_sum(hooked, x, y, 1.0)).abs().max().item()
    print(f"max |torch.func - book-keeping| over the clipped sum: {diff:.2e}")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            bookkeeping_sum(hooked, x, y, 1.0)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
