"""Empirical privacy audit: membership inference against models trained by the product.

    dpdro lab audit [--mode mia] [--epsilons 1 8 inf] [--shadows 4] [--records 4000] [--iterations 200]
        [--algorithm dp-sgd]

Protocol. From an evenly spaced subset of MNIST-ST's training records, a seeded coin puts each record in
the target model's training set (member) or not (non-member), half and half. Attacks:

- loss threshold (Yeom et al. 2018): score = -loss of the record under the target model;
- LiRA (Carlini et al. 2022, online variant with a few shadow models): each shadow model trains on its own
  random half; for each record the logit-scaled confidence phi = log(p_y / (1 - p_y)) under the shadows that
  had it (IN) and did not (OUT) is fitted with a Gaussian each, and the score is the log-likelihood ratio
  of the target's phi.

Reported: ROC AUC and TPR at 1% FPR over all records, per epsilon (inf: non-private training). A DP
model bounds any attack's TPR by e^epsilon FPR + delta; with few shadows and short runs these are coarse
estimates, a sanity check and not a proof. The white-box audit with power is ``--mode canary``
(simulations/canary_audit.py); each mode rewrites only its own section of docs/research/AUDIT.md.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ..common.config import Config
from ..common.data import ArrayDataset, load_dataset
from ..common.rng import derived_rng
from .canary_audit import write_section


def roc_auc(member: np.ndarray, nonmember: np.ndarray) -> float:
    """P(score of a random member > score of a random non-member) + 0.5 P(tie) (Mann-Whitney)."""
    scores = np.concatenate([member, nonmember])
    order = scores.argsort(kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):  # average ranks over ties
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i:j + 1]] = 0.5 * (i + j) + 1
        i = j + 1
    m, n = len(member), len(nonmember)
    return float((ranks[:m].sum() - m * (m + 1) / 2) / (m * n))


def tpr_at_fpr(member: np.ndarray, nonmember: np.ndarray, fpr: float = 0.01) -> float:
    """Largest fraction of members flagged by a threshold that flags at most ``fpr`` of non-members."""
    threshold = np.quantile(nonmember, 1.0 - fpr, method="higher")
    return float(np.mean(member > threshold))


def lira_scores(target_phi: np.ndarray, shadow_phi: np.ndarray, shadow_in: np.ndarray) -> np.ndarray:
    """Online LiRA: per record, log N(phi; mu_in, s_in) - log N(phi; mu_out, s_out) with a variance floor.
    target_phi (N,), shadow_phi (S, N), shadow_in (S, N) bool. Records without IN or OUT shadows get 0."""
    out = np.zeros(target_phi.shape[0])
    global_sd = max(float(np.std(shadow_phi)), 1e-3)
    for i in range(target_phi.shape[0]):
        ins, outs = shadow_phi[shadow_in[:, i], i], shadow_phi[~shadow_in[:, i], i]
        if len(ins) == 0 or len(outs) == 0:
            continue
        s_in = max(float(np.std(ins)), 0.1 * global_sd)
        s_out = max(float(np.std(outs)), 0.1 * global_sd)
        z_in, z_out = (target_phi[i] - ins.mean()) / s_in, (target_phi[i] - outs.mean()) / s_out
        out[i] = -0.5 * z_in**2 - math.log(s_in) + 0.5 * z_out**2 + math.log(s_out)
    return out


def _train(base: dict, data: ArrayDataset, test: ArrayDataset, eps: float, seed: int, out: Path) -> np.ndarray:
    from ..client.local_transport import LocalTransport
    from ..server.engine import train

    # The audit trains every model afresh on each call: its own run directories are replaced.
    cfg = Config.from_mapping({**base, "epsilon": eps, "seed": seed, "out-dir": str(out), "overwrite": True})
    return train(cfg, LocalTransport(cfg, data), test).params


def _scores(params: np.ndarray, data: ArrayDataset, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-record loss (N,) and logit-scaled confidence phi (N,) under ``params``."""
    from ..common.models import make_model
    from ..common.per_sample import FlatModel

    model = FlatModel(make_model("cnn", 10, seed))
    with torch.no_grad():
        logits = model.logits(torch.as_tensor(params, dtype=torch.float32), data.x)
        logp = torch.log_softmax(logits.double(), 1)
    lp = logp[torch.arange(len(data)), data.y].numpy()
    loss = -lp
    p = np.exp(lp)
    phi = np.log(np.clip(p, 1e-12, None)) - np.log(np.clip(1 - p, 1e-12, None))
    return loss, phi


def run_audit(epsilons: list[float], shadows: int, records: int, iterations: int, root: Path, docs: Path,
              algorithm: str = "dp-sgd") -> Path:
    """Train target and shadow models per epsilon, attack, write the 'mia' section of docs/research/AUDIT.md (the canary
    section is kept); returns its path."""
    from tqdm import tqdm

    pool = load_dataset("mnist-st", True, max_records=records)
    test = load_dataset("mnist-st", False, max_records=1000)
    n = len(pool)
    base = {"dataset": "mnist-st", "algorithm": algorithm, "iterations": iterations, "q": 10,
            "refresh-batch": max(1, n // 16), "diff-batch": max(1, n // 32), "num-clients": 1, "threads": 0,
            "eval-every": iterations, "checkpoint-every": 0, "lr-x": 0.5, "reproducible": False}
    masks = derived_rng(0, "audit-membership").random((shadows + 1, n)) < 0.5
    rows = []
    bar = tqdm(total=len(epsilons) * (shadows + 1), desc="audit", unit="model")
    for eps in epsilons:
        phis, losses = [], []
        for k in range(shadows + 1):
            params = _train(base, pool.subset(np.flatnonzero(masks[k])), test, eps, 100 + k,
                            root / f"eps{eps:g}" / f"model{k}")
            loss, phi = _scores(params, pool, 100 + k)
            losses.append(loss)
            phis.append(phi)
            bar.update(1)
        member = masks[0]
        loss_score = -losses[0]
        lira = lira_scores(phis[0], np.stack(phis[1:]), masks[1:])
        rows.append({"epsilon": eps,
                     "loss_auc": roc_auc(loss_score[member], loss_score[~member]),
                     "loss_tpr": tpr_at_fpr(loss_score[member], loss_score[~member]),
                     "lira_auc": roc_auc(lira[member], lira[~member]),
                     "lira_tpr": tpr_at_fpr(lira[member], lira[~member])})
    bar.close()
    lines = [f"Generated by `dpdro lab audit --epsilons {' '.join(f'{e:g}' for e in epsilons)} --shadows {shadows} "
             f"--records {records} --iterations {iterations} --algorithm {algorithm}`. Target and {shadows} shadow "
             f"models per epsilon, each trained by {algorithm} on a random half of {n} MNIST-ST training records "
             f"(evenly spaced subset), {iterations} iterations; epsilon inf = non-private (no clipping, no noise). "
             "(dp-double-spider without clipping diverged at this step size in a first attempt, so the audit "
             "uses the same engine, ledger and noise through DP-SGD.) Attacks: loss "
             "threshold (Yeom et al. 2018) and online LiRA (Carlini et al. 2022) with the shadows above. "
             "Chance is AUC 0.5 and TPR 0.01 at 1% FPR. Coarse estimates from few short runs, not a proof.", "",
             "| epsilon | loss-threshold AUC | loss TPR @ 1% FPR | LiRA AUC | LiRA TPR @ 1% FPR |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['epsilon']:g} | {r['loss_auc']:.3f} | {r['loss_tpr']:.3f} | {r['lira_auc']:.3f} | "
                     f"{r['lira_tpr']:.3f} |")
    return write_section(docs / "AUDIT.md", "mia", lines)
