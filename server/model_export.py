"""A finished run's model files: model.pt and model.json (server/model_files.py), plots/ and MODEL_CARD.md
(server/run_report.py), written by the ``ModelExport`` callback; post-processing of released values only."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..common.config import TrainingConfig
from ..common.data import DATASETS, input_keys, resolve_data_root
from ..common.data_types import declared_classes
from .model_files import describe_module_class, input_scaling, state_dict_at, write_model_files
from .run_report import long_tailed_construction, minority_classes, write_model_card, write_run_plots


def write_model_outputs(run: Any) -> None:
    """model.pt and model.json (server/model_files.py), plots/ and MODEL_CARD.md (server/run_report.py) of a
    finished run (``run``: a callbacks.TrainingRun, not imported: callbacks imports this module): post-processing
    of the released iterate ``run.params`` (d,) of the trainable parameters (the frozen ones, from the plan's
    initial preparation, are saved as the module holds them) and of the reported metrics."""
    cfg, rd, test, setup, summary, rows = run.cfg, run.rd, run.test, run.setup, run.summary, run.rows
    model, factory, initial = run.plan.model, run.plan.factory, run.plan.initial
    params = model.unflatten(torch.as_tensor(run.params).to(model.dtype))
    shift = prediction_shift(cfg.training, setup)
    named = list(test.class_names) or declared_classes(cfg.classes)  # user data: names in label order
    classes = named if len(named) == test.num_classes else [str(k) for k in range(test.num_classes)]
    meta = {"factory": factory, "module_class": describe_module_class(model.module), "model_fix": cfg.model_fix,
            "num_classes": test.num_classes, "classes": classes, "input_shape": list(test.x.shape[1:]),
            "dtype": cfg.dtype, **initial.facts(), "dataset": cfg.dataset, "data": test.name,
            "input_scaling": input_scaling(test.name, cfg.to_dict()),
            # the declared keys that turn a user's file into model inputs (column order, public bounds, image size
            # and scaling, class order; the data sets' input_keys): what scoring new records by hand needs
            "preprocessing": {k: v for k, v in cfg.to_dict().items() if k in set(input_keys())},
            "priors": list(setup.priors) if setup.priors is not None else None, "posthoc_tau": cfg.posthoc_tau,
            "prediction_shift": None if shift is None else shift.tolist(), "logit_adjust_tau": cfg.tau,
            "eval_split": cfg.eval_split, "algorithm": cfg.algorithm,
            "private": cfg.private and not cfg.noise_from_saved_seed,
            "epsilon_spent": summary["epsilon_spent"], "delta": summary["delta"]}
    spec = DATASETS.get(cfg.dataset)
    if spec is not None and spec.model_facts is not None:  # csv: the training file's feature columns
        meta.update(spec.model_facts(resolve_data_root(cfg.data_root), cfg.to_dict(), tuple(test.x.shape[1:])))
    write_model_files(rd.path, state_dict_at(model.module, params), meta)
    construction = long_tailed_construction(cfg.dataset, test.num_classes, cfg.imbalance_ratio,
                                            spec is not None and spec.long_tailed)
    minority = minority_classes(summary, construction)
    plots = write_run_plots(rd.path, rows, summary, classes, minority)
    write_model_card(rd.path, summary, meta, plots, minority)


def prediction_shift(training: TrainingConfig, setup) -> np.ndarray | None:
    """-posthoc_tau log(pi) (K,), added to the logits at prediction (post-hoc logit adjustment), or None."""
    if training.posthoc_tau == 0 or setup.priors is None:
        return None
    return -training.posthoc_tau * np.log(np.asarray(setup.priors))
