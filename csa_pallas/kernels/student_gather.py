"""The lightning indexer's scores over a top-k selection, and their three gradients, as Pallas kernels (SPEC §8,
sparse mode): every query gathers its K selected index_k rows, as the sparse teacher's gather path does.

    I[t, k] = sum_j w[t, j] * ReLU(q[t, j] . index_k[topk[t, k]])     q [S, H_I, d_I], w [S, H_I]

* index_k of the batch element stays resident in VMEM for the whole query walk (`pl.Buffered(1)`, fetched once):
  f32 rows of d_p = d_I rounded up to 128 lanes (an exact upcast: f32 single-row loads compile on v5p, bf16 ones
  do not), R rows, R a power of two >= N, so a slot's row is index & (R - 1): an empty or out-of-range slot reads
  some row, and its score is never used (the loss masks it and hands it a zero cotangent).
* Forward (`_scores_kernel`, grid: query tiles of block_q rows): per query, its K_p slot indices (an SMEM block)
  drive K_p dynamic single-row loads into a staging buffer, then one [H_I, d_p] x [d_p, K_p] product (the heads
  are the MXU's rows; bf16 operands when index_q and index_k both are), the ReLU and the weighted head sum: one
  row of I in slot order (a duplicated index is simply a second slot).
* Backward (`_grads_kernel`): per query the rows are gathered again, the products recomputed, and with
  G = g * w_j * [q_j . k > 0] (bf16 hi + lo passes, as the dense kernels):
      dq[t] = G k_rows',   dw[t, j] = sum_k [g != 0] g * ReLU(q_j . k),   dk[topk[t, k]] += (G^T q[t]')[k]
  (primes: non-finite entries as 0, the weights in G too; the scores from the inputs as given: SPEC §6's agreement
  with `student._exact_chunk_scores` on non-finite inputs);
  dk is accumulated in VMEM per TensorCore (grid (2 cores, batch, query tiles / 2), the two partial [R, d_p] sums
  added in XLA) by read-modify-writes batched SCATTER_GROUP slots at a time (`add_rows_to_targets`: loads, then
  stores; alternate groups into two accumulators; 8-row windows, so a slot's row is added where its tile holds
  it). Batching needs the targets of a group to be distinct, so XLA first folds the cotangent of every slot that
  reads the same row as an earlier slot of its group into that slot and sends it to a discarded row
  (`scatter_plan`; exact, as the gradients are linear in the cotangent).

Static v5p estimates (tpu_estimate; S = 32K, K = 512, H_I = 64, d_I = 128, bf16): the scalar unit and the vector
load and store slots bound the per-slot work (the gather's row loads, the read-modify-writes), so the slots are
read from static SMEM rows (`slot_rows`) and the read-modify-writes batched. Where the loss takes its gradient in
the forward pass, the default (`StudentGatherConfig.fuse_kl`) is one kernel that gathers the rows once for the
scores, the KL and the gradients (`student_gather_kl`): 17.2 ms at S = 32K, ~3.6 cycles per slot per TensorCore
(20.7 and 4.3 with one accumulator and single-row adds; README, "Sparse mode" of the fused student, for the
history).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from csa_pallas.kernels import common, runtime, slot_rows, sparse_gather, student_scores
from csa_pallas.kernels.common import NN, NT, TN

CORES = common.MEGACORE  # the backward's dk partial sums: one per TensorCore
# Slots per batched read-modify-write of dk (`add_rows_to_targets`; a multiple of 8). Static v5p estimates of the
# one-kernel gradient pass at S = 32K (phase 3, per query): one accumulator and single-row adds, 16 per group 1,481
# bundles; two accumulators 1,205; with the 8-row windows (one load of the rows per 8 slots) 1,297 in groups of 16
# (the addresses of 32 slots in flight spill the scalar registers) and 1,098 in groups of 8.
SCATTER_GROUP = 8
# Zero rows past the R resident keys (one sublane tile): a slot that takes no part (empty, out of range, future, a
# masked or empty row, padding) reads row R in the gradient pass, so a non-finite index_k row it does not see never
# meets its zero cotangent in a product (0 * NaN), and its read-modify-write goes to a discarded row.
ZERO_ROWS = 8
# Leading rows of a dk accumulator: a target's 8-row window (`add_rows_to_targets`) starts up to 7 rows above it.
ACC_FRONT = 8


@dataclasses.dataclass(frozen=True)
class StudentGatherConfig:
    """block_q: queries per grid step (a multiple of 8; one query's slots are gathered and scored at a time);
    vmem_limit_bytes: Mosaic's scoped-VMEM limit for every kernel; fuse_kl: where the loss takes its gradient in
    the forward pass, one kernel per query tile gathers the rows once for the scores, the KL against the teacher's
    P and the gradients (`student_gather_kl`) instead of this module's scores and gradient kernels around the
    teacher's fused KL (which gather them twice).
    The one kernel's operands in a query-chunked loss (`fused_student`; a scalar reduction and fuse_kl):
    rows_in_place: each chunk's index_q rows read, and their gradient written, where they lie in the whole arrays
    (`student_gather_kl.loss_and_grads(rows_in_place=...)`) instead of per-chunk copies; dk_in_place: each
    chunk's dk added to the TensorCores' running sums in place (`dk_partials`) instead of partial sums added in
    XLA per chunk. None: wherever they apply (rows: `student_gather_kl.rows_in_place_ok`); True: a ValueError
    naming the field where they do not; False: the copies / the XLA sums."""

    block_q: int = 8
    vmem_limit_bytes: int = 48 * common.MiB
    fuse_kl: bool = True
    rows_in_place: Optional[bool] = None
    dk_in_place: Optional[bool] = None

    def __post_init__(self):
        if self.block_q < 8 or self.block_q % 8:
            raise ValueError(f"block_q: expected a positive multiple of 8, got {self.block_q}")
        if self.vmem_limit_bytes < common.MiB:
            raise ValueError(f"vmem_limit_bytes: expected at least 1 MiB, got {self.vmem_limit_bytes}")
        for name in ("rows_in_place", "dk_in_place"):
            if not common.is_optional_bool(getattr(self, name)):
                raise ValueError(f"{name}: expected None, True or False, got {getattr(self, name)!r}")


def vmem_bytes(cfg: StudentGatherConfig, *, num_blocks: int, heads: int, head_dim: int, width: int) -> int:
    """width: K_p (K rounded up to 128). VMEM of the largest kernel, the gradient kernel: resident keys, dk's two
    accumulators (the single-buffered output and a scratch), the staging rows, the per-step blocks and one
    query's [H_I, K_p] / [K_p, d_p] temporaries; with fuse_kl (`student_gather_kl`) also the staging of every
    query of a tile and its [block_q, K_p] scores, G, P' and counts and its [block_q, H_I, K_p] products."""
    rows, d_p = sparse_gather.resident_row_count(num_blocks), common.round_up(head_dim, 128)
    k_p, bq = width, cfg.block_q
    resident = (rows + ZERO_ROWS + 2 * accumulator_rows(rows)) * d_p * 4  # the keys; dk's two accumulators
    blocks = 2 * bq * (2 * heads * d_p * 4 + 2 * heads * 4 + 2 * k_p * 4)
    fused = (bq - 1) * k_p * d_p * 4 + 6 * bq * k_p * 4 + bq * heads * k_p * 4 if cfg.fuse_kl else 0
    return resident + blocks + 2 * k_p * d_p * 4 + 8 * heads * k_p * 4 + 4 * k_p * d_p * 4 + fused


def default_config(*, num_blocks: int, heads: int, head_dim: int, width: int,
                   vmem_capacity: int = 64 * common.MiB):
    """8 queries per step; None when the resident keys and dk's accumulators do not fit in VMEM. width: K."""
    cfg = StudentGatherConfig()
    need = vmem_bytes(cfg, num_blocks=num_blocks, heads=heads, head_dim=head_dim,
                      width=common.round_up(width, 128))
    if need > int(0.9 * vmem_capacity):
        return None
    return dataclasses.replace(cfg, vmem_limit_bytes=min(vmem_capacity - 4 * common.MiB,
                                                          max(32 * common.MiB, int(need * 1.2))))


def gathered_rows(slots, keys_ref, stage_ref, operand):
    """One query's K_p selected rows, [K_p, d_p] in the operand dtype: unrolled single-row loads into static
    staging rows. slots: the query's [K_p] row indices, already masked to [0, R) (`scores`; the mask in the kernel
    cost ~0.5 of 2.15 cycles per row), in a static SMEM row (`slot_rows`)."""
    width = slots.shape[0]

    def load(k, carry):  # unrolled (constant k in each copy): the row's SMEM offset and staging row are static
        stage_ref[lax.shift_right_logical(k, 3), pl.ds(k & 7, 1), :] = keys_ref[pl.ds(slots[k], 1), :]
        return carry

    lax.fori_loop(0, width, load, 0, unroll=True)
    return stage_ref[...].reshape(width, keys_ref.shape[1]).astype(operand)


def accumulator_rows(resident_rows: int) -> int:
    """Rows of a dk accumulator for R resident rows: ACC_FRONT leading rows, the R rows (row r at ACC_FRONT + r), the
    SCATTER_GROUP discarded targets of `scatter_plan` and a sublane tile more (a target's 8-row window,
    `add_rows_to_targets`, reaches up to 7 rows either side of it)."""
    return ACC_FRONT + resident_rows + SCATTER_GROUP + common.SUBLANES


def add_rows_to_targets(targets_row, rows_ref, acc_refs):
    """acc[ACC_FRONT + targets_row[k]] += rows[k] for every slot k of a query, acc one of the accumulators acc_refs
    (their sum is the result).

    Slot k's row reaches its target in sublane k % 8, where rows_ref holds it: the 8-row window of acc starting
    k % 8 rows above the target is loaded (one unaligned load), the whole [8, d_p] tile of rows holding row k is
    added, and only sublane k % 8 is stored back (a masked store), so no row is moved between sublanes and one
    load of rows_ref serves 8 slots. SCATTER_GROUP windows are loaded, then stored (the targets are distinct
    within a group, `scatter_plan`, and each store writes its target only), so the stores do not wait on
    possibly aliasing loads one slot at a time; with two accumulators consecutive groups alternate between them,
    so a group's loads need not wait for the previous group's stores either (distinct buffers cannot alias).
    targets_row: [K_p] in a static SMEM row (`slot_rows`); rows_ref: f32 [K_p, d_p]; acc_refs: f32
    [..., accumulator_rows(R), d_p] each (unit leading dims)."""
    d_p = rows_ref.shape[1]
    sublane = lax.broadcasted_iota(jnp.int32, (common.SUBLANES, d_p), 0)
    span = SCATTER_GROUP * len(acc_refs)  # one group per accumulator
    assert targets_row.shape[0] % span == 0, (targets_row.shape, span)

    def groups(i, carry):  # unrolled (constant i in each copy), as straight-line code; rolled when interpreted
        for a, acc_ref in enumerate(acc_refs):
            start = i * span + a * SCATTER_GROUP
            # unit leading dims as unit slices: one indexing transform, whose masked store the interpreter
            # discharges
            lead = (pl.ds(0, 1),) * (len(acc_ref.shape) - 2)
            shape = (1,) * len(lead) + (common.SUBLANES, d_p)
            tiles = [rows_ref[pl.ds(start + 8 * t, 8), :].reshape(shape) for t in range(SCATTER_GROUP // 8)]
            windows = [acc_ref.at[lead + (pl.ds(targets_row[start + e] + ACC_FRONT - e % 8, 8), slice(None))]
                       for e in range(SCATTER_GROUP)]
            old = [window[...] for window in windows]
            for e, window in enumerate(windows):
                pltpu.store(window, old[e] + tiles[e // 8], mask=(sublane == e % 8).reshape(shape))
        return carry

    lax.fori_loop(0, targets_row.shape[0] // span, groups, 0, unroll=True)


def weight_gradient(g, z):
    """d w[t, j] = sum_k g[k] ReLU(z[j, k]) over the slots with a nonzero cotangent, f32 [H_I, 1]: g [1, K_p], z
    [H_I, K_p]. The select keeps a zero-cotangent slot at 0 against a non-finite score (SPEC §6)."""
    return jnp.sum(jnp.where(g != 0.0, g * jnp.maximum(z, 0.0), 0.0), axis=1, keepdims=True)


def _scores_kernel(idx_ref, q_ref, w_ref, keys_ref, out_ref, stage_ref, buf_ref, sem_ref, *, operand):
    def per_query(t, slots):
        rows = gathered_rows(slots, keys_ref, stage_ref, operand)
        z = common.exact_dot(q_ref[t].astype(operand), rows, NT)  # [H_I, K_p]
        w = common.rows_to_column(w_ref[pl.ds(t, 1), :])  # [H_I, 1]
        out_ref[pl.ds(t, 1), :] = jnp.sum(w * jnp.maximum(z, 0.0), axis=0, keepdims=True)

    slot_rows.for_each_query([idx_ref], buf_ref, sem_ref, per_query)


def _grads_kernel(idx_ref, target_ref, q_ref, w_ref, keys_ref, g_ref, dq_ref, dw_ref, dk_ref, stage_ref,
                  dk_rows_ref, buf_ref, sem_ref, dk_odd_ref, *, operand):
    step, fold_step = pl.program_id(2), pl.num_programs(2) - 1  # read at the top level (the interpreter's rule)

    @pl.when(step == 0)  # the first query tile of this core's walk over a batch element
    def _():
        dk_ref[...] = jnp.zeros(dk_ref.shape, dk_ref.dtype)
        dk_odd_ref[...] = jnp.zeros(dk_odd_ref.shape, dk_odd_ref.dtype)

    @pl.when(step == fold_step)  # one step past the core's query tiles: the odd groups' sums join the even ones'
    def _():  # (`student_gather_kl._kernel` says why not at the end of the last tile's step)
        dk_ref[...] += dk_odd_ref[...]

    def per_query(t, slots, targets):
        rows = gathered_rows(slots, keys_ref, stage_ref, operand)
        q = q_ref[t].astype(operand)
        z = common.exact_dot(q, rows, NT)  # [H_I, K_p]
        positive = z > 0.0  # ReLU'(0) = 0 (SPEC §8)
        g = g_ref[pl.ds(t, 1), :]  # [1, K_p]
        w = common.rows_to_column(w_ref[pl.ds(t, 1), :])  # [H_I, 1]
        dw_ref[pl.ds(t, 1), :] = common.column_to_rows(weight_gradient(g, z), 1)
        terms = common.hi_lo_terms(jnp.where(positive, w * g, 0.0), operand)
        # the products take non-finite operands as 0 (SPEC §6), cleaned from the f32 staging rows and query
        clean_rows = common.finite_or_zero(stage_ref[...].reshape(rows.shape)).astype(operand)
        dq_ref[t] = sum(common.exact_dot(x, clean_rows, NN) for x in terms).astype(dq_ref.dtype)
        clean_q = common.finite_or_zero(q_ref[t]).astype(operand)
        dk_rows_ref[...] = sum(common.exact_dot(x, clean_q, TN) for x in terms)  # [K_p, d_p]
        add_rows_to_targets(targets, dk_rows_ref, (dk_ref, dk_odd_ref))

    @pl.when(step < fold_step)
    def _():
        slot_rows.for_each_query([idx_ref, target_ref], buf_ref, sem_ref, per_query)


def scatter_plan(idx, g, rows: int):
    """The backward's dk targets and cotangent: idx int32 [n, K_p] (the rows the slots read, in [0, R]), g f32
    [n, K_p] (their cotangent)
    -> (targets int32 [n, K_p], g' f32 [n, K_p]). Within each group of SCATTER_GROUP slots of a query, the first
    slot reading a row takes the summed cotangent of every slot of the group reading it and keeps the row as its
    target; the others get cotangent 0 and a target of their own past the resident rows (row R + e, discarded).
    Exact: a slot's gradients are linear in its cotangent and equal for slots reading the same row, so the sums
    are those of the per-slot read-modify-writes; the targets of a group are distinct."""
    n, k = idx.shape
    read = idx.reshape(n, k // SCATTER_GROUP, SCATTER_GROUP)
    same = read[..., :, None] == read[..., None, :]  # [n, groups, a, b]
    lane = jnp.arange(SCATTER_GROUP)
    earlier = lane[:, None] < lane[None, :]  # a < b
    first = ~jnp.any(same & earlier, axis=-2)
    merged = jnp.sum(jnp.where(same, g.reshape(read.shape)[..., None, :], 0.0), axis=-1)
    targets = jnp.where(first, read, rows + lane)
    return targets.reshape(n, k), jnp.where(first, merged, 0.0).reshape(n, k)


@dataclasses.dataclass(frozen=True)
class _Static:
    cfg: StudentGatherConfig
    batch: int
    padded_rows: int  # S_p: a multiple of CORES * block_q
    width: int  # K_p: a multiple of 128
    heads: int
    head_dim: int  # d_p
    resident_rows: int  # R (the keys have R + ZERO_ROWS rows)
    operand_dtype: object
    interpret: object

    @property
    def nq(self):
        return self.padded_rows // self.cfg.block_q

    def cost(self, passes: int, written: int, q_itemsize: int, slot_arrays: int, key_fetches: int):
        """slot_arrays: [S_p, K_p] 32-bit arrays read (the indices; the backward's targets and cotangent);
        key_fetches: how many times the grid fetches a batch element's resident keys, all batch elements together
        (the backward: once per TensorCore and batch element)."""
        b, s, k, h, d = self.batch, self.padded_rows, self.width, self.heads, self.head_dim
        flops = passes * 2 * b * s * k * h * d
        # index_q, index_weights, the slot arrays, the resident keys per fetch (the gathered rows are VMEM, not HBM)
        read = (b * (s * h * d * q_itemsize + 4 * s * h + 4 * slot_arrays * s * k)
                + 4 * key_fetches * (self.resident_rows + ZERO_ROWS) * d)
        return pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=read + written)


def _query_specs(st: _Static, tile):
    bq = st.cfg.block_q
    return [pl.BlockSpec((bq, st.width), lambda *g: (tile(*g), 0), memory_space=pltpu.SMEM),
            pl.BlockSpec((bq, st.heads, st.head_dim), lambda *g: (tile(*g), 0, 0)),
            pl.BlockSpec((bq, st.heads), lambda *g: (tile(*g), 0))]


def _forward(st: _Static, idx, q, w, keys):
    bq, tile = st.cfg.block_q, lambda p: p
    batch_of = lambda p: common.index_div(p, st.nq)
    return runtime.pallas_call(
        functools.partial(_scores_kernel, operand=st.operand_dtype),
        out_shape=jax.ShapeDtypeStruct((st.batch * st.padded_rows, st.width), jnp.float32),
        grid=(st.batch * st.nq,),
        in_specs=_query_specs(st, tile) + [
            pl.BlockSpec((None, st.resident_rows + ZERO_ROWS, st.head_dim), lambda p: (batch_of(p), 0, 0),
                         pipeline_mode=pl.Buffered(1))],
        out_specs=pl.BlockSpec((bq, st.width), lambda p: (p, 0)),
        scratch_shapes=[pltpu.VMEM((st.width // 8, 8, st.head_dim), jnp.float32)]
        + slot_rows.scratch(st.width, 1),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                             vmem_limit_bytes=st.cfg.vmem_limit_bytes),
        cost_estimate=st.cost(1, 4 * st.batch * st.padded_rows * st.width, q.dtype.itemsize, 1,
                              common.resident_fetches(st.batch, st.nq)),
        interpret=st.interpret,
        name=f"csa_student_gather_scores_bq{bq}",
    )(idx, q, w, keys)


def _backward(st: _Static, idx, q, w, keys, g):
    bq, half = st.cfg.block_q, st.nq // CORES
    # step `half` of a core (the dk sum, `_grads_kernel`) keeps its last tile's blocks: nothing fetched or written
    tile = lambda c, b, i: b * st.nq + c * half + jnp.minimum(i, half - 1)
    b, s, h, d = st.batch, st.padded_rows, st.heads, st.head_dim
    acc_rows = accumulator_rows(st.resident_rows)  # the resident rows and the discarded targets of `scatter_plan`
    passes = 1 + 2 * (1 if st.operand_dtype == jnp.float32 else 2)
    written = b * (s * h * d * q.dtype.itemsize + 4 * s * h) + 4 * CORES * b * acc_rows * d
    # A slot with a zero cotangent (every slot outside V(t)) reads a zero row: exact, as it contributes nothing.
    idx = jnp.where(g != 0.0, idx, st.resident_rows)
    targets, g = scatter_plan(idx, g, st.resident_rows)
    query = _query_specs(st, tile)  # query[0]: a [bq, K_p] SMEM block, the slots' rows and their targets alike
    dq, dw, dk = runtime.pallas_call(
        functools.partial(_grads_kernel, operand=st.operand_dtype),
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(w.shape, jnp.float32),
                   jax.ShapeDtypeStruct((CORES, b, acc_rows, d), jnp.float32)),
        grid=(CORES, b, half + 1),
        in_specs=[query[0], query[0]] + query[1:] + [
            pl.BlockSpec((None, st.resident_rows + ZERO_ROWS, d), lambda c, bb, i: (bb, 0, 0),
                         pipeline_mode=pl.Buffered(1)),
            pl.BlockSpec((bq, st.width), lambda *g_: (tile(*g_), 0))],
        out_specs=(pl.BlockSpec((bq, h, d), lambda *g_: (tile(*g_), 0, 0)),
                   pl.BlockSpec((bq, h), lambda *g_: (tile(*g_), 0)),
                   # one buffer (its block changes once per core and batch element): the odd accumulator
                   # takes the VMEM of the second
                   pl.BlockSpec((None, None, acc_rows, d), lambda c, bb, i: (c, bb, 0, 0),
                                pipeline_mode=pl.Buffered(1))),
        scratch_shapes=[pltpu.VMEM((st.width // 8, 8, d), jnp.float32), pltpu.VMEM((st.width, d), jnp.float32)]
        + slot_rows.scratch(st.width, 2) + [pltpu.VMEM((acc_rows, d), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                                             vmem_limit_bytes=st.cfg.vmem_limit_bytes),
        cost_estimate=st.cost(passes, written, q.dtype.itemsize, 3, CORES * b),
        interpret=st.interpret,
        name=f"csa_student_gather_grads_bq{bq}",
    )(idx, targets, q, w, keys, g)
    dk = jnp.sum(dk[:, :, ACC_FRONT:ACC_FRONT + st.resident_rows], axis=0)
    return dq, dw, jnp.pad(dk, ((0, 0), (0, ZERO_ROWS), (0, 0)))  # the zero rows' cotangent: 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scores(st: _Static, idx, q, w, keys):
    return _forward(st, idx, q, w, keys)


def _scores_fwd(st, idx, q, w, keys):
    return _scores(st, idx, q, w, keys), (idx, q, w, keys)


def _scores_bwd(st, residuals, g):
    idx, q, w, keys = residuals
    # The weights enter the backward's products only: their non-finite entries become 0 (SPEC §6; the kernel does
    # the same to the gathered rows and the query, whose scores it recomputes from the originals).
    dq, dw, dk = _backward(st, idx, q, common.finite_or_zero(w), keys, g)
    return None, dq, dw, dk


_scores.defvjp(_scores_fwd, _scores_bwd)


def resident_keys(index_k) -> jax.Array:
    """index_k float [B, N, d_I] -> the kernels' resident keys, f32 [B, R + ZERO_ROWS, d_p] (R = a power of two >=
    N, d_p = d_I rounded up to 128; zeros past N and d_I): an exact upcast, the differentiable side (its cotangent
    sums over query chunks in f32). A caller scoring many query chunks prepares it once."""
    _, n, d = index_k.shape
    rows = sparse_gather.resident_row_count(n) + ZERO_ROWS
    return jnp.pad(index_k.astype(jnp.float32), ((0, 0), (0, rows - n), (0, common.round_up(d, 128) - d)))


def scores_of_one_chunk(index_q, index_k, index_weights, topk_indices, cfg: StudentGatherConfig | None = None):
    """`scores` with index_k (float [B, N, d_I]) made resident here: for a caller that scores its rows once."""
    return scores(index_q, resident_keys(index_k), index_weights, topk_indices,
                  student_scores.operand_dtype(index_q.dtype, index_k.dtype), cfg)


def scores(index_q, keys, index_weights, topk_indices, operand_dtype, cfg: StudentGatherConfig | None = None):
    """I, f32 [B, S, K] in slot order (an empty or out-of-range slot holds some finite or non-finite value the
    caller masks); differentiable wrt index_q, the resident keys and index_weights (a slot's cotangent lands on
    the row it read, so an invalid slot must get a zero cotangent, as the loss gives it).

    index_q float [B, S, H_I, d_I]; keys f32 [B, R + ZERO_ROWS, d_p] (`resident_keys`); index_weights float
    [B, S, H_I];
    topk_indices int [B, S, K]; operand_dtype: the MXU operands (`student_scores.operand_dtype`)."""
    b, s, h, d = index_q.shape
    k = topk_indices.shape[2]
    rows, d_p = keys.shape[1] - ZERO_ROWS, keys.shape[2]
    if cfg is None:
        cfg = StudentGatherConfig()
    s_p, k_p = common.round_up(s, CORES * cfg.block_q), common.round_up(k, 128)
    st = _Static(cfg, b, s_p, k_p, h, d_p, rows, jnp.dtype(operand_dtype), runtime.interpret_mode())
    q_dtype = jnp.bfloat16 if index_q.dtype == jnp.bfloat16 else jnp.float32
    q = jnp.pad(index_q.astype(q_dtype), ((0, 0), (0, s_p - s), (0, 0), (0, d_p - d))).reshape(b * s_p, h, d_p)
    w = jnp.pad(index_weights.astype(jnp.float32), ((0, 0), (0, s_p - s), (0, 0))).reshape(b * s_p, h)
    # The row each slot reads, index & (R - 1); padded slots and rows read row R - 1 (their scores are sliced off,
    # their cotangent is 0).
    idx = jnp.pad(topk_indices.astype(jnp.int32), ((0, 0), (0, s_p - s), (0, k_p - k)), constant_values=-1)
    out = _scores(st, (idx & (rows - 1)).reshape(b * s_p, k_p), q, w, keys)
    return out.reshape(b, s_p, k_p)[:, :s, :k]
