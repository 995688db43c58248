"""The work of one client on one query: Poisson-sample its records, compute the per-record quantity at
one point (refresh) or two points (difference), clip each record's vector and sum (docs/explanation/ALGORITHMS.md 5.3).

Nothing here knows about Flower: the in-process transport and the ClientApp call the same code.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Iterator, Mapping

import numpy as np
import torch
from torch import nn

from ..common.config import check_device
from ..common.data import ArrayDataset
from ..common.eval_counts import EVAL_QUANTITY, node_counts
from ..common.faults import active_fault
from ..common.feature_norm import apply_stats
from ..common.messages import UNDISCLOSED, Query, Reply
from ..common.model_fix import fix_model
from ..common.model_init import prepare_model
from ..common.models import make_model, resolve_model, validate_model
from ..common.partition import site_of
from ..common.per_sample import FlatModel, OuterRows, RowBlocks, clip_scales, clipped_sum_and_count, combine_outer
from ..common.quantities import QUANTITIES, Problem
from ..common.rng import gaussian_noise, site_rng
from .local_steps import local_update

log = logging.getLogger(__name__)


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype for config key ``dtype``."""
    return {"float32": torch.float32, "float64": torch.float64}[name]


class ShardWorker:
    """Answers queries on one client's shard.

    Args:
        cfg: the run's Config.
        shard: the client's records.
        partition: the client's partition id (enters the sampling seed in reproducible mode).
        module: a model object to compute with instead of the one config key ``model`` names (single-node runs of
            the Python API's ``model=``; a private copy is made, so workers never share a module).
    """

    def __init__(self, cfg, shard: ArrayDataset, partition: int, module: nn.Module | None = None,
                 held_out: ArrayDataset | None = None) -> None:
        self.cfg = cfg
        check_device(cfg.device)  # first: a bad device is a config error before any work
        self.num_classes = shard.num_classes
        self.partition = partition
        self.dtype = torch_dtype(cfg.dtype)
        self.device = torch.device(cfg.device)
        self.x = shard.x.to(self.device, self.dtype)
        self.y = shard.y.to(self.device)
        # the declared group attribute (dro-groups=attribute); None for a data set without one
        self.groups = shard.groups.to(self.device) if shard.groups is not None else None
        if module is not None:
            base = validate_model(fix_model(copy.deepcopy(module), cfg.model_fix).to(self.dtype))
        else:
            base = make_model(resolve_model(cfg.model, cfg.dataset), shard.num_classes, cfg.seed, self.dtype,
                              tuple(shard.x.shape[1:]), cfg.model_fix)
        # the frozen parameters as the server has them; the trainable ones come with every query's versions
        prepare_model(base, cfg.init_weights, cfg.trainable, load=False)
        self.model = FlatModel(base.to(self.device), cfg.per_record_engine)
        # the node's own held-out records (eval-data=nodes), never trained on; None: it holds none
        self.held_out = None if held_out is None else (held_out.x.to(self.device, self.dtype),
                                                       held_out.y.to(self.device))
        self._said_no_held_out = False
        self.problem = Problem.from_config(cfg)
        self._problems: dict[tuple[float, ...], Problem] = {}
        self._feature_norm: tuple[float, ...] = ()  # the statistics the model's input norm holds (feature-norm)

    @property
    def num_records(self) -> int:
        """Records in this client's shard."""
        return int(self.y.shape[0])

    def sample(self, query: Query) -> np.ndarray:
        """Indices of this shard's sample for ``query``. Poisson: each record independently with probability
        rate (possibly none). 'fixed-size' (non-private runs only): round(rate * shard size) records drawn
        without replacement."""
        rng = site_rng(self.cfg.reproducible, self.cfg.seed, "sample", query.iteration, query.mechanism,
                       self.partition)
        if self.cfg.sampling == "fixed-size":
            k = int(round(query.rate * self.num_records))
            return np.sort(rng.choice(self.num_records, size=k, replace=False))
        return np.flatnonzero(rng.random(self.num_records) < query.rate)

    def _inject(self, query: Query) -> str | None:
        """Test hook ($DPDRO_INJECT_FAULT, common/faults.py; read per query, so that a cached worker follows a
        request's fault): raise, hang, or return 'nan' for a malformed reply."""
        fault = active_fault()
        if fault is None:
            return None
        pid, it, kind = fault
        if pid != self.partition or it != query.iteration:
            return None
        if kind == "raise" or (kind == "raise-once" and query.attempt == 0):
            raise RuntimeError(f"injected failure of partition {pid} at iteration {it} (injected fault)")
        if kind == "hang" and query.attempt == 0:
            time.sleep(3600)
        return kind if kind == "nan" else None

    def _problem(self, offset: tuple[float, ...]) -> Problem:
        if offset not in self._problems:
            self._problems = {offset: self.problem.with_offset(offset, self.dtype, self.device)}
        return self._problems[offset]

    def _groups(self, problem: Problem) -> torch.Tensor:
        """Each record's group (N,) int64: its class, its node (dro-groups=node: this shard's partition id, in
        [0, num-clients), for every record), its node's site (dro-groups=site: ``common.partition.site_of``) or its
        declared group attribute (ValueError without one)."""
        if problem.group_by == "class":
            return self.y
        if problem.group_by == "node":
            return torch.full_like(self.y, self.partition)
        if problem.group_by == "site":
            return torch.full_like(self.y, site_of(self.partition, self.cfg.num_clients, self.cfg.num_sites))
        if self.groups is None:
            raise ValueError("dro-groups='attribute': this client's data set declares no group attribute")
        return self.groups

    def _use_feature_norm(self, stats: tuple[float, ...]) -> None:
        """feature-norm=private: fix the model's input normalisation to the released channel statistics the query
        carries (once per change; an empty tuple leaves the model as built). The Opacus engine's hooked copy is
        rebuilt with them."""
        if stats and stats != self._feature_norm:
            apply_stats(self.model.module, stats)
            self.model.buffers_changed()
            self._feature_norm = stats

    def _inputs(self, query: Query, versions: Mapping[int, np.ndarray]):
        """(quantity function, parameter points on this worker's device and dtype, problem with the query's
        offset, records' groups or None) of ``query``: what ``answer`` and ``record_rows`` compute with."""
        self._use_feature_norm(query.feature_norm)
        fn = QUANTITIES[query.quantity]
        flats = [torch.as_tensor(versions[p.version]).to(self.device, self.dtype) for p in query.points]
        problem = self._problem(query.offset)
        groups = self._groups(problem) if getattr(fn, "uses_groups", False) else None
        return fn, flats, problem, groups

    def record_rows(self, query: Query, versions: Mapping[int, np.ndarray],
                    idx: np.ndarray | None = None) -> Iterator[torch.Tensor | RowBlocks]:
        """The unclipped per-record vectors of ``query`` (what ``answer`` clips and sums) for the records
        ``idx`` (m,) of this shard (default: every record, no sampling), chunk by chunk: (B, query.dim) tensors or
        ``RowBlocks``, B <= chunk-size, in the order of ``idx``. For measurements on the records (the estimator
        diagnostics), never for a release: nothing here is clipped or noised. KeyError if a version is missing."""
        fn, flats, problem, groups = self._inputs(query, versions)
        rows = np.arange(self.num_records) if idx is None else np.asarray(idx)
        yield from record_rows(self.model, fn, flats, [p.scalar for p in query.points], query.point_coefs(),
                               self.x, self.y, torch.as_tensor(rows, device=self.device), problem, query.extra,
                               self.cfg.chunk_size, groups)

    def answer(self, query: Query, versions: Mapping[int, np.ndarray]) -> Reply:
        """Sum of clipped per-record vectors over this shard's sample, shape (query.out_dim,): with
        ``query.count_scale`` > 0 the last coordinate is count_scale * clip * (number of clipped records), and
        with ``query.noise_std`` > 0 this client adds N(0, noise_std^2) to every coordinate (distributed and
        local noise modes; the noise comes from a PCG64 generator seeded from the OS CSPRNG unless reproducible, or
        with config key secure-noise built of OS CSPRNG bytes, ``common.rng.secure_gaussian``)
        and reports no count (-1): the server is not trusted with it. A ``query.count_only`` query's reply is (1,):
        the number of sampled records whose vector was not scaled down by ``query.clip``. ``versions`` maps the
        query's model version ids to flat parameter arrays (d,). Raises KeyError if a version is missing."""
        fault = self._inject(query)
        if query.quantity == EVAL_QUANTITY:
            return self._answer_eval(query, versions)
        if query.ddg:
            return self._answer_ddg(query, versions, fault)
        node_unit = getattr(self.cfg, "privacy_unit", "record") == "node"
        # privacy-unit=node: every record of the shard (the node is the unit; server/node_sampling.py)
        idx = np.arange(self.num_records) if node_unit else self.sample(query)
        fn, flats, problem, groups = self._inputs(query, versions)
        if node_unit and query.local:  # local SGD from the broadcast model; its update, clipped as one vector
            total, clipped = node_contribution(self._local_update(query, fn, flats[0], problem, groups), 1,
                                               query.clip), 0
        else:
            rows = torch.as_tensor(idx, device=self.device)
            total, clipped = clipped_total(self.model, fn, flats, [p.scalar for p in query.points],
                                           query.point_coefs(), self.x, self.y, rows, query.clip, query.dim, problem,
                                           query.extra, self.cfg.chunk_size, groups)
            if node_unit:  # the node's mean, clipped to the clip norm as one vector; it counts as one unit
                total = node_contribution(total, len(idx), query.clip)
        out = total.cpu().numpy()
        if query.count_only:  # the number of sampled records under the clip (messages.Query.count_only)
            out = np.array([float(len(idx) - clipped)])
        elif query.count_scale > 0:
            out = np.append(out, query.count_scale * query.clip * clipped)
        count = 1 if node_unit else int(len(idx))
        if query.noise_std > 0:
            rng = site_rng(self.cfg.reproducible, self.cfg.seed, "client-noise", query.iteration, query.mechanism,
                           self.partition, query.attempt)
            out = out + gaussian_noise(query.noise_std, out.shape, rng, secure=self.cfg.secure_noise)
            count = UNDISCLOSED
        if fault == "nan":
            out[:] = np.nan
        return Reply(query.qid, self.partition, out, count)

    def _local_update(self, query: Query, fn, flat0: torch.Tensor, problem: Problem,
                      groups: torch.Tensor | None) -> torch.Tensor:
        """x_0 - x_K (query.dim,) float64 of ``query.local``'s local SGD on this node's whole shard
        (``client.local_steps.local_update``), the per-record gradients of the query's quantity at its one point's
        scalar, unclipped. ValueError for a query of several points or whose quantity is not a gradient of the
        model's parameters (its dim is not the model's)."""
        if len(query.points) != 1 or query.dim != flat0.numel():
            raise ValueError(f"release '{query.mechanism}': local steps need a one-point gradient of the model's "
                             f"{flat0.numel()} parameters; got {len(query.points)} points and dim {query.dim}")
        scalar = query.points[0].scalar
        epochs, lr, batch = query.local

        def grad_sum(x: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
            return clipped_total(self.model, fn, [x.to(self.dtype)], [scalar], (1.0,), self.x, self.y,
                                 torch.as_tensor(rows, device=self.device), math.inf, query.dim, problem,
                                 query.extra, self.cfg.chunk_size, groups)[0]

        rng = site_rng(self.cfg.reproducible, self.cfg.seed, "local-steps", query.iteration, query.mechanism,
                       self.partition, query.attempt)
        return local_update(flat0, self.num_records, grad_sum, int(epochs), lr, int(batch), rng)

    def _answer_ddg(self, query: Query, versions: Mapping[int, np.ndarray], fault: str | None) -> Reply:
        """noise-mode=distributed-discrete: this client's share of the release (``common.ddg.ShareSpec``; Kairouz,
        Liu and Steinke 2021): each sampled record's vector clipped to ``query.clip`` (with the clipped-count
        coordinate when ``query.count_scale`` > 0; for a count-only query the record's 1 or 0), divided by the
        sensitivity, scaled to the integer grid, rotated and conditionally rounded, summed, plus a discrete
        Gaussian share, modulo 2^bits: (d',) float64 of integers, count undisclosed. The rounding and the noise
        draw from the run's client-noise generator (OS CSPRNG-seeded unless reproducible; OS CSPRNG bytes with
        secure-noise)."""
        from ..common import ddg
        from ..common.per_sample import RowBlocks, clip_scales, norm_upper_bound

        spec = ddg.ShareSpec.from_tuple(query.ddg)
        idx = self.sample(query)
        fn, flats, problem, groups = self._inputs(query, versions)
        sens = query.sensitivity

        def chunks():
            for v in record_rows(self.model, fn, flats, [p.scalar for p in query.points], query.point_coefs(),
                                 self.x, self.y, torch.as_tensor(idx, device=self.device), problem, query.extra,
                                 self.cfg.chunk_size, groups):
                v = v.dense() if isinstance(v, RowBlocks) else v
                if query.count_only:  # 1 for a record whose vector is within the clip (Query.count_only)
                    rows = (norm_upper_bound(v) <= query.clip).to(torch.float64).unsqueeze(1)
                else:
                    scale, was_clipped = clip_scales(v, query.clip)
                    finite = torch.where((scale > 0).unsqueeze(1), v, torch.zeros((), dtype=v.dtype, device=v.device))
                    rows = finite.to(torch.float64) * scale.to(torch.float64).unsqueeze(1)
                    if query.count_scale > 0:
                        flag = was_clipped.to(torch.float64).unsqueeze(1) * (query.count_scale * query.clip)
                        rows = torch.cat([rows, flag], dim=1)
                yield rows.cpu().numpy() / sens

        rng = None if self.cfg.secure_noise else site_rng(self.cfg.reproducible, self.cfg.seed, "client-noise",
                                                          query.iteration, query.mechanism, self.partition,
                                                          query.attempt)
        out = spec.encode(chunks(), ddg.uniform_from(rng), query.out_dim).astype(np.float64)
        if fault == "nan":
            out[:] = np.nan
        return Reply(query.qid, self.partition, out, UNDISCLOSED)

    def _answer_eval(self, query: Query, versions: Mapping[int, np.ndarray]) -> Reply:
        """A node evaluation (eval-data=nodes, common/eval_counts.py): the (2K,) per-class correct and total counts
        of the query's model on this node's held-out records, noised like any reply when ``query.noise_std`` > 0.
        A node without held-out records says so (a warning in its log, once) and replies zeros over 0 records."""
        self._use_feature_norm(query.feature_norm)
        flat = torch.as_tensor(versions[query.points[0].version]).to(self.device, self.dtype)
        if self.held_out is None or int(self.held_out[1].shape[0]) == 0:
            if not self._said_no_held_out:  # once per worker: every evaluation of the run would repeat it
                self._said_no_held_out = True
                log.warning("partition %d holds no held-out records: it contributes nothing to the node evaluation "
                            "(eval-data=nodes)", self.partition)
            out, count = np.zeros(query.dim, dtype=np.float64), 0
        else:
            x, y = self.held_out
            out = node_counts(self.model, flat, x, y, query.dim // 2, query.extra, self.cfg.chunk_size)
            count = int(y.shape[0])
        if query.noise_std > 0:
            rng = site_rng(self.cfg.reproducible, self.cfg.seed, "client-noise", query.iteration, query.mechanism,
                           self.partition, query.attempt)
            out = out + gaussian_noise(query.noise_std, out.shape, rng, secure=self.cfg.secure_noise)
            count = UNDISCLOSED
        return Reply(query.qid, self.partition, out, count)


def node_contribution(total: torch.Tensor, num_records: int, clip: float) -> torch.Tensor:
    """A node's contribution under privacy-unit=node (server/node_sampling.py): ``total`` (D,) float64, the sum of
    its records' clipped vectors, divided by its record count (a mean over its shard; 0 for an empty shard) and
    clipped to L2 norm at most ``clip`` as one vector (``per_sample.clip_scales``: rounding included, never above
    ``clip``; a vector with a non-finite entry becomes 0). ``clip`` inf (non-private) leaves the mean unclipped."""
    mean = total / max(num_records, 1)
    if not math.isfinite(clip):
        return mean
    if not bool(torch.isfinite(mean).all()):  # e.g. local steps that diverged: the zero vector, within any clip
        return torch.zeros_like(mean)
    scale, _ = clip_scales(mean.unsqueeze(0), clip)
    return mean * scale[0]


def clipped_total(model: FlatModel, fn, flats, scalars, coefs, x: torch.Tensor, y: torch.Tensor,
                  rows: torch.Tensor, clip: float, dim: int, problem: Problem, extra=(),
                  chunk_size: int = 256, groups: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """Sum over the records ``rows`` of clip_{clip}(sum_j coefs[j] fn(flats[j], scalars[j])), shape (dim,),
    float64 on x's device, and the number of records whose vector was scaled down by the clip: the work of
    one client on one query. Each record's vector is clipped exactly to ``clip`` in its dtype, rounding
    included (``per_sample.clip_scales``), so the server's reply check never rejects an honest sum. Every
    addition, within a chunk and across chunks, is in float64 (``per_sample.sum64``), so the sum is within
    gamma_m m clip of the exact sum of the m clipped vectors (gamma_m in u = 2^-53) whatever the dtype: the
    bound the release's noise is inflated for (``release.sum_rounding_factor``).

    Records are processed ``chunk_size`` at a time (vectorised within a chunk), so peak memory grows with
    chunk_size * dim, not with the number of records. ``flats`` are (d,) parameter points, ``rows`` (m,)
    indices into x (N, ...) and y (N,); ``fn`` is a per-record quantity of ``common.quantities``; ``groups`` (N,)
    the records' groups, passed to a quantity that reads them (``quantities.uses_groups``).
    """
    total = torch.zeros(dim, dtype=torch.float64, device=x.device)
    clipped = 0
    for v in record_rows(model, fn, flats, scalars, coefs, x, y, rows, problem, extra, chunk_size, groups):
        part, n_clipped = clipped_sum_and_count(v, clip)
        total += part
        clipped += n_clipped
    return total, clipped


def record_rows(model: FlatModel, fn, flats, scalars, coefs, x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor,
                problem: Problem, extra=(), chunk_size: int = 256,
                groups: torch.Tensor | None = None) -> Iterator[torch.Tensor | RowBlocks]:
    """The per-record vectors sum_j coefs[j] fn(flats[j], scalars[j]) of the records ``rows``, unclipped, chunk by
    chunk (``chunk_size`` records each, in the order of ``rows``): a (B, D) tensor, or for one point of a quantity
    with row blocks (a refresh) its ``RowBlocks`` (no (B, D) matrix is formed). Arguments as in ``clipped_total``,
    which clips and sums exactly these chunks."""
    for start in range(0, int(rows.shape[0]), chunk_size):
        sel = rows[start:start + chunk_size]
        xb, yb = x[sel], y[sel]
        kw = {"groups": groups[sel]} if groups is not None else {}
        if len(flats) == 1 and getattr(fn, "rows", None) is not None:
            # one point (a refresh): the quantity's row blocks, no (chunk, D) matrix is formed
            yield fn.rows(model, flats[0], scalars[0], xb, yb, problem, extra, **kw).scaled(coefs[0])
        else:
            yield _combined_rows(fn, model, flats, scalars, coefs, xb, yb, problem, extra, kw)


def _combined_rows(fn, model: FlatModel, flats, scalars, coefs, xb: torch.Tensor, yb: torch.Tensor, problem: Problem,
                   extra, kw: dict) -> torch.Tensor | RowBlocks:
    """sum_j coefs[j] fn(flats[j], scalars[j]) per record: the rows a query of several points clips. A quantity
    with row blocks (``quantities.row_blocks``) is combined block by block (the same float operations per entry
    as on the (B, D) matrix, without concatenating it); any other gives its (B, D) matrix."""
    rows_fn = getattr(fn, "rows", None)
    if rows_fn is not None:
        terms = [rows_fn(model, flat, scalar, xb, yb, problem, extra, **kw)
                 for flat, scalar in zip(flats, scalars, strict=True)]
        if all(isinstance(t, OuterRows) for t in terms) and (outer := combine_outer(terms, coefs)) is not None:
            return outer  # a linear layer on fixed inputs: the points' rows differ in g only
        return RowBlocks([_combine([t.weighted_block(j) for t in terms], coefs)
                          for j in range(len(terms[0].blocks))])
    return _combine([fn(model, flat, scalar, xb, yb, problem, extra, **kw).detach()
                     for flat, scalar in zip(flats, scalars, strict=True)], coefs)


def _combine(terms: list[torch.Tensor], coefs) -> torch.Tensor:
    """sum_j coefs[j] terms[j] for fresh tensors of one shape (the first is overwritten where that saves a pass)."""
    v = None
    for term, coef in zip(terms, coefs, strict=True):
        if v is None:
            v = term if coef == 1.0 else coef * term
        elif coef == -1.0:
            v.sub_(term)  # v is this chunk's own fresh tensor; in place saves a (chunk, D) pass
        else:
            v = v + coef * term
    return v
