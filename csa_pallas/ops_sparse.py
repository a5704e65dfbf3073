"""Sparse (top-k) mode through the Pallas kernels: input preparation, kernel launches and the loss's custom_vjp.

Data flow of `indexer_distill_loss` (sparse mode):

  topk_indices, ids, loss_mask ──> slot bits (V(t)) ──> [visit path: block bits, per-tile flags (XLA)]
  q, compressed_kv, ids ──> [window_lse kernel ─> u] ──> sparse teacher kernel, the KL fused into its last step
      ──> per-row KL, lse, sum P, non-empty ──> reduction (XLA);  under jax.grad: G [B, S, K], the only residual
  backward: dI = per-row cotangent * G;  zeros for every teacher input.

Two paths (`choose_path`): "visit", the teacher kernel (`kernels.teacher`) reading the selection
(`kernels.selection`), and "gather", the K-proportional kernel (`kernels.sparse_gather`). The kernels read the
top-k indices as given; V(t) travels as slot bits ([B, S, K / 32] int32) and the visit path's selection as block
bits ([B, S, N / 32] int32): no [B, S, K]-sized array is made besides G (the gradient's residual).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Optional

import jax
import jax.numpy as jnp

from csa_pallas import masks
from csa_pallas import loss_vjp
from csa_pallas import ops
from csa_pallas import reference
from csa_pallas import validation
from csa_pallas.kernels import common
from csa_pallas.kernels import fused_kl
from csa_pallas.kernels import runtime
from csa_pallas.kernels import schedule as schedule_lib
from csa_pallas.kernels import selection
from csa_pallas.kernels import sparse_gather
from csa_pallas.kernels import teacher as teacher_kernel
from csa_pallas.kernels import teacher_config
from csa_pallas.validation import Problem

# Widest KL tile along the slots (lanes); K_p above it is walked in 128-lane tiles.
MAX_KL_LANES = 2048


PATHS = ("visit", "gather")
# Dispatch (static, from N, H, K and the chip's VMEM): the K-proportional gather path once
# N * H >= GATHER_HEAD_BLOCKS_PER_SLOT * K (and its resident rows fit in VMEM), the dense-visit path below.
# See `choose_path`.
GATHER_HEAD_BLOCKS_PER_SLOT = 600
# The visit path's tile lists (`TeacherConfig.tile_list`) are scalar-prefetched into SMEM next to the flag tables:
# at most this many int32 words (256 KiB of v5p's 1 MiB: S = 32K at 256-block tiles, the largest compiled for v5p
# here; 1024-block tiles take 16K).
MAX_LIST_WORDS = 64 * 1024


@dataclasses.dataclass(frozen=True)
class SparseLayout:
    """Static sizes of the sparse kernels: the path ("visit": the teacher kernel with a selection; "gather": the
    K-proportional kernel), its config, the kv-tile schedule (visit) and the padded extents."""

    cfg: object  # teacher_config.TeacherConfig (visit) or sparse_gather.GatherConfig (gather)
    schedule: Optional[schedule_lib.TileSchedule]
    padded_seq: int  # a multiple of block_q and of the bit kernels' rows (`selection.build_rows`)
    padded_blocks: int
    padded_width: int
    path: str = "visit"


def choose_path(problem: Problem, forced: Optional[str] = None, gather_fits: bool = True) -> str:
    """"gather" when N * H >= GATHER_HEAD_BLOCKS_PER_SLOT * K (and its resident rows fit in VMEM), else "visit";
    `forced` (the config's "path") overrides. H is the call's heads (the local heads under head sharding).

    Why this form: the visit path multiplies every causally visible kv tile some query of the tile selected from,
    ~N/2 blocks x H heads per query for a selection spread over the whole past, so it costs ~N H; the gather path
    costs ~K gathered rows per query (~2 bundles each, whatever H) plus a [H, D] x [D, K] product, so at these
    widths it costs ~K. Static v5p estimates, uniform selections, forward + backward per_head (`benchmarks/sparse.py`):
    Flash (H = 64, K = 512) S = 16K visit 7.2 / gather 8.1 ms, S = 32K 26.3 / 16.1 ms; Pro widths (H = 128,
    K = 1024) S = 16K 14.9 / 17.4 ms, S = 32K 54.0 / 34.9 ms. Visit grows as S^1.86, gather as S: they cross at
    N H / K = 585 (Flash) and 614 (Pro). A selection concentrated on recent blocks (banded) skips most of the visit
    path's tiles, so below the crossover the visit path is the better worst case and far better for local
    selections; above it, the gather path's worst case wins."""
    if forced is not None:
        if forced not in PATHS:
            raise ValueError(f"config: 'path' expected one of {PATHS}, got {forced!r}")
        if forced == "gather" and not gather_fits:
            raise ValueError("config: path 'gather' needs the compressed KV of one batch element resident in VMEM "
                             f"({problem.num_blocks} blocks x {problem.head_dim} does not fit)")
        return forced
    spread_cost = problem.num_blocks * problem.num_heads
    return "gather" if spread_cost >= GATHER_HEAD_BLOCKS_PER_SLOT * problem.width and gather_fits else "visit"


def forced_path(cfg):
    """The path a layout config forces (a `TeacherConfig`: "visit"; a Mapping: its "path"), or None."""
    if isinstance(cfg, teacher_config.TeacherConfig):
        return "visit"
    return cfg.get("path") if isinstance(cfg, Mapping) else None


def sparse_layout(problem: Problem, cfg=None, kl_logits_dtype=None) -> SparseLayout:
    """cfg: a `TeacherConfig` (the visit path), or a Mapping of fields overriding the heuristic default: "path"
    ("visit" | "gather"), then the chosen path's config fields (`teacher_config.TeacherConfig` or
    `sparse_gather.GatherConfig`); None: the problem's own (`Problem.layout_config`, the fused op's config=).
    kl_logits_dtype: size the default tiles for the fused-KL kernel (the loss path)."""
    dtype = ops.compute_dtype(problem.q, problem.compressed_kv)
    cfg = problem.layout_config if cfg is None else cfg
    overrides = {name: value for name, value in cfg.items() if name != "path"} if isinstance(cfg, Mapping) else None
    k_p = common.round_up(problem.width, common.LANES)
    n16 = common.round_up(max(problem.num_blocks, 1), 16)  # the gather kernel's DMA chunks of rows
    gather_cfg = sparse_gather.default_config(num_heads=problem.num_heads, head_dim=problem.head_dim,
                                              num_blocks_padded=n16, width_p=k_p, dtype=dtype,
                                              kl_logits_dtype=kl_logits_dtype)
    path = choose_path(problem, forced_path(cfg), gather_cfg is not None)
    if path == "gather":
        fields = {f.name for f in dataclasses.fields(sparse_gather.GatherConfig)}
        unknown = sorted(set(overrides or {}) - fields)
        if unknown:
            raise ValueError(f"config: unknown field {unknown[0]!r} for path 'gather'; expected some of "
                             f"{sorted(fields | {'path'})} (the teacher kernel's fields need config 'path': 'visit')")
        gather_cfg = dataclasses.replace(gather_cfg, **(overrides or {}))
        s_p = common.round_up(problem.seq_len, math.lcm(sparse_gather.CORES * gather_cfg.block_q,
                                                        selection.build_rows(problem.seq_len)))
        return SparseLayout(cfg=gather_cfg, schedule=None, padded_seq=s_p, padded_blocks=n16, padded_width=k_p,
                            path="gather")
    cfg = overrides if overrides is not None else cfg
    if not isinstance(cfg, teacher_config.TeacherConfig):
        default = teacher_config.default_config(
            num_heads=problem.num_heads, head_dim=problem.head_dim, seq_len=problem.seq_len,
            num_blocks=problem.num_blocks, width=problem.width, dtype=dtype, mode=ops.teacher_mode(problem),
            head_chunk=problem.head_chunk, kl_logits_dtype=kl_logits_dtype)
        cfg = teacher_config.with_overrides(default, cfg)
    s_p = common.round_up(problem.seq_len, math.lcm(cfg.block_q, selection.build_rows(problem.seq_len)))
    n_p = teacher_config.padded_blocks(problem.num_blocks, cfg.block_k)
    # Default positions: the causal prefix of each query tile is static (the selection already holds V(t), so
    # a loss_mask needs no table schedule here); otherwise the ranges come from the selected tiles.
    nq, nk = s_p // cfg.block_q, n_p // cfg.block_k
    listed = teacher_config.resolve_tile_list(cfg, sparse=True)
    if listed and problem.batch * nq * nk > MAX_LIST_WORDS:
        raise ValueError(f"tile_list: the lists take B * nq * nk = {problem.batch * nq * nk} words of SMEM, over "
                         f"{MAX_LIST_WORDS}; use fewer, larger tiles (block_q, block_k) or tile_list False")
    schedule = schedule_lib.TileSchedule(causal=problem.default_ids, nq=nq, nk=nk, block_q=cfg.block_q,
                                         block_k=cfg.block_k, ratio=problem.compress_ratio,
                                         num_blocks=problem.num_blocks, listed=listed)
    return SparseLayout(cfg=cfg, schedule=schedule, padded_seq=s_p, padded_blocks=n_p, padded_width=k_p,
                        path="visit")


def abstract_layout(q, compressed_kv, topk_indices, config=None, *, target: str = "per_head", kl_logits_dtype=None,
                    **ids) -> SparseLayout:
    """The layout `sparse_layout` picks for inputs of these shapes (`jax.ShapeDtypeStruct`s, traced abstractly:
    nothing is computed), e.g. which path and tiles a DeepSeek-V4 shape gets. ids: the id arguments of
    `validation.validate` (kv_segment_ids, ...)."""
    found = {}

    def trace(q, kv, idx, ids):
        problem = validation.validate(q, kv, topk_indices=idx, target=target, **ids)
        found["layout"] = sparse_layout(problem, config, kl_logits_dtype=kl_logits_dtype)
        return jnp.zeros(())

    jax.eval_shape(trace, q, compressed_kv, topk_indices, ids)
    return found["layout"]


def normalize_slots(head_sum: jax.Array) -> jax.Array:
    """L1 normalisation of slot-order head sums, f32 [..., K_p]; negative entries (empty slots, possibly summed
    over several shards) become `teacher.EMPTY_SLOT`. A NaN entry (a row that read a non-finite input) is not
    empty: it makes its row's total, so the whole row, NaN (SPEC §3), which the KL kernels read as visible."""
    valid = jnp.logical_not(head_sum < 0.0)
    acc = jnp.where(valid, head_sum, 0.0)
    total = jnp.sum(acc, axis=-1, keepdims=True)
    return jnp.where(valid, acc / jnp.maximum(total, common.F32_TINY), teacher_kernel.EMPTY_SLOT)


def _visible_limit(problem: Problem) -> jax.Array:
    """`Problem.one_document_prefix`: int [B, S], row t sees blocks [0, limit): block s is complete at
    t = (s + 1) m - 1, so s < (t + 1) // m (clamped to N: no int32 overflow)."""
    return jnp.minimum((problem.positions + 1) // problem.compress_ratio, problem.num_blocks)


def slot_validity(problem: Problem) -> jax.Array:
    """bool [B, S, K]: slot k of row t is in V(t) (SPEC §2) and the row takes part in the loss."""
    idx = problem.topk_indices
    if problem.one_document_prefix:
        valid = (idx >= 0) & (idx < _visible_limit(problem)[:, :, None])
    else:
        block_segment, block_end = reference.block_keys(problem)
        valid = masks.slot_visible(idx, problem.segment_ids, problem.positions, block_segment, block_end)
    if problem.loss_mask is not None:
        valid = valid & problem.loss_mask[:, :, None]
    return valid


@dataclasses.dataclass(frozen=True)
class Selection:
    """The selection in the forms the sparse teacher reads (`kernels.selection`)."""

    idx: jax.Array  # int32 [B, S_p, K_p] the top-k indices (padded with -1)
    vbits: jax.Array  # int32 [B, S_p, K_p / 32] slot bits: V(t)
    bits: jax.Array  # int32 [B, S_p, W_p] block bits
    tables: jax.Array  # int32 [B * nq * (1 + nkw)] duplicate and active-tile flags
    firsts: jax.Array  # int32 [B * nq] first kv tile of each query tile (table schedule); listed: the lists
    counts: jax.Array  # int32 [B * nq] number of kv tiles from there; listed: [B * nq + 1] (`tile_lists`)


def padded_indices(problem: Problem, layout: SparseLayout) -> jax.Array:
    """The caller's top-k indices int32 [B, S_p, K_p], padded with -1 (no copy when S and K are already aligned)."""
    idx = problem.topk_indices.astype(jnp.int32)
    return ops.pad_axis(ops.pad_axis(idx, 1, layout.padded_seq, -1), 2, layout.padded_width, -1)


# Packed documents: the slot validity gathers each slot's block keys in XLA, a [B, rows, K_p] int32 array per key;
# the rows go in chunks of about this many bytes per gathered array, each chunk packed into its slot bits at once.
PACKED_VALIDITY_CHUNK_BYTES = 8 * common.MiB


def padded_slot_bits(problem: Problem, layout: SparseLayout, idx=None) -> jax.Array:
    """V(t) as slot bits (`selection.slot_bits_pallas`): int32 [B, S_p, K_p / 32] (padding rows and slots empty).
    Default positions (`Problem.one_document_prefix`): from the rows' limits (no [B, S, K]-sized temporary);
    packed documents: the validity is computed in XLA (it gathers the blocks' metadata), in chunks of rows
    (`packed_validity_chunk`), and packed as int8 chunk by chunk. Over the whole sequence the gathered keys and
    the clamped indices were three [B, S, K] int32 arrays: 512 MiB of temp at S = 128K, K = 512."""
    idx = padded_indices(problem, layout) if idx is None else idx
    interpret = runtime.interpret_mode()
    rows = selection.build_rows(problem.seq_len)
    if problem.one_document_prefix:
        limit = _visible_limit(problem)
        if problem.loss_mask is not None:
            limit = jnp.where(problem.loss_mask, limit, 0)
        limit = ops.pad_axis(limit.astype(jnp.int32), 1, layout.padded_seq)[:, None, :]  # padding rows: 0
        return selection.slot_bits_pallas(idx, limit=limit, rows=rows, interpret=interpret)
    b, s_p, k_p = idx.shape
    block_segment, block_end = reference.block_keys(problem)
    segment_ids = ops.pad_axis(problem.segment_ids.astype(jnp.int32), 1, s_p)
    positions = ops.pad_axis(problem.positions.astype(jnp.int32), 1, s_p)
    row_ok = jnp.ones((b, problem.seq_len), bool) if problem.loss_mask is None else problem.loss_mask
    row_ok = ops.pad_axis(row_ok, 1, s_p, False)  # padding rows: empty (their indices are -1 too)
    chunk = packed_validity_chunk(b, s_p, k_p, rows)

    def bits_of(start):
        rows_of = lambda x: jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=1)
        chunk_idx = rows_of(idx)  # padding slots are -1: out of range, invalid
        valid = masks.slot_visible(chunk_idx, rows_of(segment_ids), rows_of(positions), block_segment, block_end)
        valid = valid & rows_of(row_ok)[:, :, None]
        return selection.slot_bits_pallas(chunk_idx, valid=valid.astype(jnp.int8), rows=rows, interpret=interpret)
    if chunk == s_p:
        return bits_of(0)
    return jax.lax.fori_loop(
        0, s_p // chunk, lambda i, out: jax.lax.dynamic_update_slice_in_dim(out, bits_of(i * chunk), i * chunk, 1),
        jnp.zeros((b, s_p, k_p // selection.WORD_BITS), jnp.int32))


def packed_validity_chunk(batch: int, padded_seq: int, padded_width: int, rows: int) -> int:
    """Rows per chunk of the packed-documents slot validity: a multiple of the bit kernel's `rows` dividing S_p,
    the largest whose [B, chunk, K_p] int32 gather stays within PACKED_VALIDITY_CHUNK_BYTES (at least `rows`)."""
    chunk = rows * max(1, PACKED_VALIDITY_CHUNK_BYTES // (batch * rows * padded_width * 4))
    chunk = min(chunk, padded_seq)
    while padded_seq % chunk:
        chunk -= rows
    return chunk


def selection_inputs(problem: Problem, layout: SparseLayout) -> Selection:
    cfg, schedule = layout.cfg, layout.schedule
    idx = padded_indices(problem, layout)
    vbits = padded_slot_bits(problem, layout, idx)
    bits = selection.block_bits_pallas(idx, vbits, layout.padded_blocks, rows=selection.build_rows(problem.seq_len),
                                       interpret=runtime.interpret_mode())
    tables, active = selection.tile_tables(bits, vbits, block_q=cfg.block_q, block_k=cfg.block_k,
                                           num_kv_tiles=schedule.nk)
    if schedule.listed:
        firsts, counts = selection.tile_lists(active)
    elif schedule.causal:
        firsts = counts = jnp.zeros((problem.batch * schedule.nq,), jnp.int32)
    else:
        firsts, counts = common.tile_ranges(active)
    return Selection(idx=idx, vbits=vbits, bits=bits, tables=tables, firsts=firsts, counts=counts)


def in_place_rows(problem: Problem, layout: SparseLayout) -> bool:
    """Whether the gather path reads the problem's q rows in place from `problem.q_window` (see `Problem`), as
    `GatherConfig.q_in_place` says (None: wherever it applies; True where it cannot: a ValueError naming it)."""
    if layout.path != "gather" or layout.cfg.q_in_place is False:
        return False
    dtype = ops.compute_dtype(problem.q, problem.compressed_kv)
    why = None  # why the rows cannot be read in place
    if problem.q_window is None:
        why = "query chunks of fused_indexer_distill_loss (query_chunk < S)"
    elif layout.padded_seq != problem.seq_len:  # padded_seq is a multiple of both cores' query tiles
        why = (f"chunks of whole query tiles of both TensorCores ({sparse_gather.CORES} x block_q = "
               f"{sparse_gather.CORES * layout.cfg.block_q} rows), got chunks of {problem.seq_len}")
    elif problem.q_window[0].dtype != dtype:
        why = f"q in the kernels' compute dtype ({jnp.dtype(dtype).name}), got {problem.q_window[0].dtype}"
    if why is not None and layout.cfg.q_in_place:
        raise ValueError(f"config: 'q_in_place' True needs {why}")
    return why is None


def teacher_inputs(problem: Problem, layout: SparseLayout, reduce_low=None):
    """(mode, q, kv, lse_in): the sparse kernels' padded operands (stop-gradient; the gather path's kv with its
    non-finite rows as given: its kernel makes +-inf NaN as it packs its resident rows); reduce_low: see
    `ops.lse_blocks`."""
    cfg = layout.cfg
    mode = ops.teacher_mode(problem)
    dtype = ops.compute_dtype(problem.q, problem.compressed_kv)
    if in_place_rows(problem, layout):
        q_all, first_row = problem.q_window
        first_tile = (first_row // layout.cfg.block_q).astype(jnp.int32).reshape(1)
        q = sparse_gather.RowWindow(jax.lax.stop_gradient(q_all), first_tile)
    else:
        q = ops.pad_axis(jax.lax.stop_gradient(problem.q).astype(dtype), 1, layout.padded_seq)
    to_hbm = None
    if layout.path == "gather":
        kv = ops.pad_axis(ops.cast_keys(problem), 1, layout.padded_blocks)  # kv_ready: already cast, no copy
        to_hbm = lambda shifted: shifted  # [B, S_p, H]: per-step [bq, H] blocks
    else:
        kv = ops.pad_axis(ops.kernel_keys(problem), 1, layout.padded_blocks)
    lse_in = ops.lse_blocks(ops.teacher_lse(problem), problem, cfg, layout.padded_seq, dtype, reduce_low,
                            to_hbm=to_hbm)
    return mode, q, kv, lse_in


def _launch(layout: SparseLayout, operands, *, mode, scale: float, seq_len: int, normalize=True, kl=None,
            logits=None, interpret=None):
    """The sparse teacher of the layout's path on prepared operands (q, kv, lse_in, the top-k indices, the slot
    bits, and for the visit path the block bits, ranges and tables); scale: the softmax scale, seq_len: S."""
    interpret = runtime.interpret_mode() if interpret is None else interpret
    q, kv, lse_in, idx, vbits, *visit = operands
    if layout.path == "gather":
        return sparse_gather.sparse_gather_pallas(q, kv, idx, vbits, lse_in, mode=mode, cfg=layout.cfg,
                                                  scale=scale, normalize=normalize, kl=kl,
                                                  logits=logits, interpret=interpret)
    bits, firsts, counts, tables = visit
    return teacher_kernel.teacher_pallas(q, kv, None, None, firsts, counts, lse_in, mode=mode, cfg=layout.cfg,
                                         scale=scale, schedule=layout.schedule, normalize=normalize,
                                         seq_len=seq_len, kl=kl, logits=logits,
                                         picks=(idx, vbits, bits, tables), interpret=interpret)


def kernel_operands(problem: Problem, layout: SparseLayout, reduce_low=None):
    """(mode, operands of `_launch`)."""
    mode, q, kv, lse_in = teacher_inputs(problem, layout, reduce_low)
    if layout.path == "gather":
        idx = padded_indices(problem, layout)
        return mode, (q, kv, lse_in, idx, padded_slot_bits(problem, layout, idx))
    sel = selection_inputs(problem, layout)
    return mode, (q, kv, lse_in, sel.idx, sel.vbits, sel.bits, sel.firsts, sel.counts, sel.tables)


def teacher_padded(problem: Problem, layout: SparseLayout, normalize: bool = True, reduce_low=None):
    """P' f32 [B, S_p, K_p]: slot-order target on valid slots, -1 on empty slots (and padding). normalize=False:
    (the unnormalised slot head sum, the rows' M f32 [B, S_p], base 2), see `ops.teacher_padded`."""
    mode, operands = kernel_operands(problem, layout, reduce_low)
    out = _launch(layout, operands, mode=mode, scale=problem.softmax_scale, seq_len=problem.seq_len,
                  normalize=normalize)
    return ops.detached_teacher_out(out, normalize, problem.batch)


def teacher_distribution(problem: Problem, cfg=None) -> jax.Array:
    """P, f32 [B, S, K] in slot order (0 on empty slots and empty rows)."""
    b, s, k = problem.batch, problem.seq_len, problem.width
    if problem.num_blocks == 0:
        return jnp.zeros((b, s, k), jnp.float32)
    layout = sparse_layout(problem, cfg)
    return jnp.maximum(teacher_padded(problem, layout)[:, :s, :k], 0.0)


def kl_schedule(batch: int, s_p: int, k_p: int, block_q: int):
    bk = k_p if k_p <= MAX_KL_LANES else common.LANES
    nq, nk = s_p // block_q, k_p // bk
    schedule = schedule_lib.TileSchedule(causal=False, nq=nq, nk=nk, block_q=block_q, block_k=bk, ratio=1,
                                         num_blocks=k_p)
    firsts = jnp.zeros((batch * nq,), jnp.int32)  # every query tile visits every slot tile
    counts = jnp.full((batch * nq,), nk, jnp.int32)
    return schedule, firsts, counts


def kl_rows(indexer_logits, target_padded, layout: SparseLayout):
    """Per-row KL [B, S] over the K slots and the non-empty row mask [B, S] (V(t): the slots where P is not
    negative; NaN is visible)."""
    schedule, firsts, counts = kl_schedule(indexer_logits.shape[0], layout.padded_seq, layout.padded_width,
                                            layout.cfg.block_q)
    return loss_vjp.padded_kl_rows(indexer_logits, target_padded, qmeta=None, kmeta=None, firsts=firsts, counts=counts,
                              schedule=schedule, target_mask=True)


@dataclasses.dataclass(frozen=True)
class _FusedSparse:
    """FusedStatic.run for sparse mode: launches the layout's path with the fused KL."""

    layout: SparseLayout

    def __call__(self, static: loss_vjp.FusedStatic, kl, logits, operands):
        return _launch(self.layout, operands, mode=static.mode, scale=static.scale, seq_len=static.seq_len, kl=kl,
                       logits=logits, interpret=static.interpret)


def fused_kl_rows(indexer_logits, problem: Problem, layout: SparseLayout,
                  kl_chunk: int = fused_kl.FusedKL.chunk, with_gradient: bool = False, grad_scale: float = 1.0):
    """Per-row KL over the K slots [B, S] and the non-empty mask [B, S] from the sparse teacher kernel (either
    path) with the fused KL (P stays in VMEM; V(t) = the row's valid slots). with_gradient, grad_scale: see
    `loss_vjp.fused_rows`."""
    mode, operands = kernel_operands(problem, layout)
    chunk = getattr(layout.cfg, "kl_chunk", None) or kl_chunk  # GatherConfig has no kl_chunk field
    static = loss_vjp.FusedStatic(_FusedSparse(layout), mode, layout.cfg, layout.schedule, problem.softmax_scale,
                                  problem.seq_len, runtime.interpret_mode(), chunk)
    return loss_vjp.fused_rows(indexer_logits, static, operands, padded_seq=layout.padded_seq,
                               padded_width=layout.padded_width, with_gradient=with_gradient,
                               grad_scale=grad_scale)


def indexer_distill_loss(indexer_logits, problem: Problem, *, reduction: str = "mean", scale=1.0, cfg=None):
    """Sparse-mode loss through the fused sparse teacher + KL kernel; same contract as
    `reference.indexer_distill_loss`."""
    return loss_vjp.loss_through_kernels(
        indexer_logits, problem,
        make_layout=lambda pr: sparse_layout(pr, cfg, kl_logits_dtype=ops.logits_dtype(indexer_logits)),
        make_target=lambda pr, layout: pr,
        make_kl_rows=lambda logits, pr, layout: fused_kl_rows(logits, pr, layout), reduction=reduction,
        scale=scale)
