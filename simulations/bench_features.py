"""Cost of the scattering front-end (config key features=scatternet), from one process:

1. what a node does once: the features of a data set's training and test splits (``scattering.compute_features``:
   kymatio's Scattering2D(J=2), the key's hash and the cache write; a cache hit is reported as such);
2. one training iteration: a client's clipped sum of per-record cross-entropy gradients over a Poisson sample of
   ``--batch`` expected records (``worker.clipped_total``, dp-sgd's refresh), on the features with scatter-linear
   (per-record-engine torch.func, and ghost: ``per_sample.OuterRows``) and scatter-cnn and on the images with
   cnn32, the median of ``--repeats`` timings, and the ratios to cnn32.

    DPDRO_DATA_ROOT=... .venv/bin/python simulations/bench_features.py [--dataset cifar10-st] [--threads 2]

Prints the figures with the machine's load (the 1-minute load average before and after).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="cifar10-st")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1024, help="expected Poisson batch of one iteration")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-dir", default="auto", help="where the features are cached (config key cache-dir)")
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from dpdro.client.worker import clipped_total
    from dpdro.common.config import Config
    from dpdro.common.data import load_from_config, resolve_cache_dir
    from dpdro.common.models import make_model
    from dpdro.common.per_sample import FlatModel
    from dpdro.common.quantities import QUANTITIES, Problem
    from dpdro.common.scattering import cache_path, compute_features

    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()[0]:.2f}; torch threads {torch.get_num_threads()}")
    cfg = Config.from_mapping({"dataset": args.dataset, "cache-dir": args.cache_dir})
    cache = resolve_cache_dir(cfg.cache_dir)
    splits = {}
    total = 0.0
    for name, split in (("train", True), ("test", False)):
        images = load_from_config(cfg, split)
        hit = cache_path(images.x, "scatternet", cache, args.dataset).is_file()
        start = time.perf_counter()
        features = compute_features(images.x, "scatternet", cache, args.dataset)
        seconds = time.perf_counter() - start
        total += seconds
        print(f"{name}: {len(images)} images {tuple(images.x.shape[1:])} -> features {tuple(features.shape[1:])} in "
              f"{seconds:.1f} s ({'read from the cache' if hit else 'computed and cached'}; "
              f"{1000 * seconds / len(images):.2f} ms per image)")
        splits[name] = (images, features)
    print(f"both splits: {total:.1f} s")

    images, features = splits["train"]
    rng = np.random.default_rng(0)
    problem = Problem.from_config(cfg).with_offset((), torch.float32, torch.device("cpu"))
    timings = {}
    runs_of = (("cnn32", "torch.func", images.x), ("scatter-linear", "torch.func", features),
               ("scatter-linear", "ghost", features), ("scatter-cnn", "torch.func", features))
    for model_name, engine, x in runs_of:
        model = FlatModel(make_model(model_name, images.num_classes, 0, input_shape=tuple(x.shape[1:])), engine)
        label = model_name if engine == "torch.func" else f"{model_name} (engine {engine})"
        flat = model.initial()
        runs = []
        for _ in range(args.repeats):
            rows = torch.as_tensor(np.flatnonzero(rng.random(len(images)) < args.batch / len(images)))
            start = time.perf_counter()
            clipped_total(model, QUANTITIES["ce-grad"], [flat], [0.0], [1.0], x, images.y, rows, 1.0, model.dim,
                          problem)
            runs.append(time.perf_counter() - start)
        timings[label] = statistics.median(runs)
        print(f"one iteration, {label} ({model.dim:,} parameters): {timings[label]:.3f} s (median of "
              f"{args.repeats}, about {args.batch} records)")
    for label in timings:
        if label != "cnn32":
            print(f"ratio {label} / cnn32: {timings[label] / timings['cnn32']:.2f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
