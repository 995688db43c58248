"""White-box canary audit of the node evaluation's release (eval-data=nodes, server/node_evaluation.py): an empirical
epsilon lower bound for one release of the per-class correct and total counts, and its negative control.

    dpdro lab audit --mode canary   (its own section of docs/research/AUDIT.md)

Threat model and statistics as simulations/canary_audit.py (Nasr et al. 2021, 2023; Clopper-Pearson bounds over a
threshold grid, Bonferroni): the auditor chooses the held-out records and the evaluated model. The model is
logits = x (the record's K features times one parameter s = 1), and canary k is a held-out record of class k whose
feature k is 1 and all others 0 (K = 1000 classes by default, so that one release gives 1000 trials): the model
classifies it correctly, so it
adds (e_k, e_k) to the (2K,) count vector, the worst case of the sensitivity sqrt(2) (one class's correct and total
count, each by 1). Canary k sits on node k mod m (m clients); an independent fair coin per canary and release decides
presence (the record is held out on its node) or absence (the null record: nothing). Every release runs through the
product's path: the ``eval_query`` of server/node_evaluation.py, ``Releaser.run`` over a ``LocalTransport`` of real
``ShardWorker``s (their ``_answer_eval``: model, argmax, counts, client noise shares outside central mode), and a
``Ledger`` holding the plan of one evaluation at the audited noise multiplier.

Statistic of canary k: the released (c_k + t_k) / sqrt(2), in units of the claimed noise std z S f (S = sqrt(2)):
the projection on the canary's direction, mean 1 / (z f) present and 0 absent, std 1 (a Gaussian mechanism with
noise multiplier z: tight for the claim). One release gives K independent trials (orthogonal coordinates).

Claim: epsilon(delta) of PoissonSampledDpEvent(1, GaussianDpEvent(z)), what the ledger charges per evaluation.
Negative control 'noise-half' (``canary_audit._ledger_class``): the releaser and the nodes draw half the calibrated
noise while the claim stays; its lower bound must exceed the claim.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..common.config import Config
from ..common.data import ArrayDataset
from ..common.rng import secret_rng
from .canary_audit import EpsilonBound, _ledger_class, claimed_epsilon, epsilon_lower_bound, write_section

CLASSES = 1000  # K, canaries per release (one per class): the default of ``audit_node_evaluation``


@dataclass(frozen=True)
class EvalAuditRow:
    """One audit of the node evaluation release: noise mode, broken (None or 'noise-half'), noise multiplier z,
    claimed epsilon per release, delta, the bound, the number of releases run and the measured std of absent
    canaries' statistics in claimed noise stds."""

    noise_mode: str
    broken: str | None
    noise_multiplier: float
    claimed: float
    delta: float
    bound: EpsilonBound
    releases: int
    noise_ratio: float
    config: str = "node-evaluation"  # the names canary_audit.AuditRow has, for the CLI's verdict
    mechanism: str = "eval-counts"

    @property
    def flagged(self) -> bool:
        """Whether the audit shows a violation: the lower bound exceeds the claimed epsilon."""
        return self.bound.lower > self.claimed


class _Scaled(nn.Module):
    """logits = s x (flattened), one parameter s: the auditor's model, (1,) parameters whatever K."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1) * self.scale


def audit_module() -> nn.Module:
    """The auditor's model: logits = s x on records of K features (K classes); s comes with the query
    (``audit_parameters``)."""
    return _Scaled()


def audit_parameters() -> np.ndarray:
    """Flat parameters (1,) float64 of ``audit_module``: s = 1, so a record whose only non-zero feature is k is
    classified k."""
    return np.ones(1)


def canaries(classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x (K, K) float, y (K,) int64): canary k has feature k = 1 and label k."""
    return torch.eye(classes), torch.arange(classes)


def audit_node_evaluation(*, noise_multiplier: float = 2.0, releases: int = 200, classes: int = CLASSES,
                          noise_mode: str = "central", broken: str | None = None, clients: int = 3,
                          seed: int | None = None, root: Path | None = None) -> EvalAuditRow:
    """Audit ``releases`` node evaluation releases of ``classes`` classes (K canaries each, so K x releases trials)
    at ``noise_multiplier`` in ``noise_mode`` (module docstring); ``broken`` = 'noise-half' runs the negative
    control. ``seed`` seeds the auditor's coins only (the product's noise stays secret-seeded). ValueError for
    releases < 1, clients < 1, classes < 2, a non-positive noise multiplier or an unknown break."""
    from ..client.local_transport import LocalTransport
    from ..server.ledger import Mechanism
    from ..server.node_evaluation import EVAL_MECHANISM, eval_query
    from ..server.releaser import Releaser
    from ..server.rundir import RunDir

    if releases < 1 or clients < 1 or classes < 2 or not noise_multiplier > 0:
        raise ValueError(f"eval audit: need releases >= 1, clients >= 1, classes >= 2 and noise multiplier > 0; got "
                         f"{releases}, {clients}, {classes} and {noise_multiplier}")
    if broken not in (None, "noise-half"):
        raise ValueError(f"eval audit: break {broken!r} unknown; allowed: noise-half")
    delta = 1e-5
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(root or tmp) / "node-evaluation" / noise_mode / (broken or "correct")
        cfg = Config.from_mapping({"dataset": "mnist-st", "num-clients": clients, "noise-mode": noise_mode,
                                   "epsilon": 100.0, "delta": delta, "eval-data": "nodes", "threads": 1,
                                   "dtype": "float64", "out-dir": str(out)})
        records = ArrayDataset(torch.zeros(4 * clients, classes), torch.zeros(4 * clients, dtype=torch.int64),
                               classes, "audit-eval")  # training shards: unused by an evaluation
        transport = LocalTransport(cfg, records, audit_module())
        n = transport.num_records
        plan = {Mechanism(EVAL_MECHANISM, 1.0, fixed_noise=noise_multiplier): 1}
        noise = {EVAL_MECHANISM: noise_multiplier}
        rd = RunDir(out)
        rd.create()
        ledger_cls = _ledger_class(broken)
        coins = np.random.default_rng(seed) if seed is not None else secret_rng()
        x, y = canaries(classes)
        flat = audit_parameters()
        present, absent = [], []
        for i in range(releases):
            flags = coins.random(classes) < 0.5
            for pid, w in enumerate(transport.workers):
                mine = [k for k in range(classes) if k % clients == pid and flags[k]]
                w.held_out = (x[mine].to(w.device, w.dtype), y[mine].to(w.device))
            releaser = Releaser(cfg, transport, ledger_cls(plan, noise, cfg.epsilon, delta, cfg.accountant), n, rd)
            q = eval_query(i, classes, None)
            released = releaser.run([q], {q.points[0].version: flat})[EVAL_MECHANISM] * n  # the noisy counts
            std = noise_multiplier * releaser.noise_sensitivity(q)  # the claimed noise std of each count
            stat = (released[:classes] + released[classes:]) / math.sqrt(2.0) / std
            present.append(stat[flags])
            absent.append(stat[~flags])
        present_all, absent_all = np.concatenate(present), np.concatenate(absent)
    return EvalAuditRow(noise_mode, broken, noise_multiplier, claimed_epsilon(1.0, noise_multiplier, delta), delta,
                        epsilon_lower_bound(present_all, absent_all, delta), releases, float(np.std(absent_all)))


def report_lines(rows: list[EvalAuditRow], command: str) -> list[str]:
    """The markdown section of the node evaluation audit: one table row per audit."""
    lines = [f"Command: `{command}` (simulations/eval_audit.py: {CLASSES} canaries per release, one per class; "
             "claimed epsilon: one evaluation release at noise multiplier z, delta 1e-5)", "",
             "| noise mode | break | z | claimed epsilon | lower bound (95 %) | estimate | trials (canaries) | "
             "absent std | flagged |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.noise_mode} | {r.broken or '-'} | {r.noise_multiplier:g} | {r.claimed:.2f} | "
                     f"{r.bound.lower:.2f} | {r.bound.estimate:.2f} | {r.bound.present + r.bound.absent} | "
                     f"{r.noise_ratio:.3f} | "
                     f"{'yes' if r.flagged else 'no'} |")
    return lines


# (noise mode, break) of the documented audit: the correct release in every noise mode and the negative control
EVAL_PLAN: tuple[tuple[str, str | None], ...] = (("central", None), ("distributed", None), ("local", None),
                                                 ("central", "noise-half"), ("distributed", "noise-half"))


def run_eval_audit(docs: Path, trials: int = 200_000, command: str = "dpdro lab audit --mode canary",
                   plan=EVAL_PLAN) -> tuple[Path, list[EvalAuditRow]]:
    """Every audit of ``plan`` with about ``trials`` trials each (ceil(trials / CLASSES) releases), written as the
    'node-evaluation' section of ``docs``/AUDIT.md (the other sections are kept); returns (its path, the rows)."""
    releases = max(1, math.ceil(trials / CLASSES))
    rows = [audit_node_evaluation(releases=releases, noise_mode=mode, broken=broken, clients=1 if mode == "central"
                                  else 3) for mode, broken in plan]
    return write_section(docs / "AUDIT.md", "node-evaluation", report_lines(rows, command)), rows
