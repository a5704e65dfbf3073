"""The sparse student's scores, the KL against the teacher's P and all three gradients in one kernel per query
tile (SPEC §4-§5, §8): each query's K selected index_k rows are gathered once, where the two-kernel route
(`student_gather`: scores, the teacher's fused KL, then the gradients) gathers them twice.

Used where the loss is differentiated with the gradient taken in the forward pass (`fused_student`, scalar
reductions): the teacher writes its slot-order P' [B, S_p, K_p] (`ops_sparse.teacher_padded`: -1 on empty slots,
a NaN row stays NaN) instead of reading the student's scores, and this kernel, per query tile of block_q rows,
  1. gathers every query's rows into a staging buffer [block_q, K_p, d_p] and writes its scores I [block_q, K_p]
     (as `student_gather._scores_kernel`),
  2. takes the KL of the tile against P' and G = grad_scale * (softmax_V(I) sum P - P) with the teacher kernels'
     own epilogue (`fused_kl.kl_epilogue`; V(t) = the slots where P' is not negative),
  3. runs the backward of every query from the staged rows and the products q . k kept from step 1 ([block_q,
     H_I, K_p] f32 in VMEM; recomputing them instead cost 4% of the kernel's estimate), as
     `student_gather._grads_kernel` does, dk by batched read-modify-writes. The batches need distinct targets,
     and here G exists only inside the kernel, so XLA cannot fold a duplicated slot's cotangent into the first
     slot reading its row. It folds the multiplicity instead: a slot's G depends only on the row it reads
     (SPEC §2: each duplicate is its own softmax entry with the same score and target), so the first valid slot
     reading a row in its group adds G * (the group's count of valid slots reading it) and the others are sent
     to discarded rows with a count of 0: `student_gather.scatter_plan` with the validity as the cotangent
     (the slots outside V(t) read the zero row R, so they never share a row with a valid slot).

A query-chunked caller (`fused_student`) passes the TensorCores' running dk sums as `dk_partials`: the buffer is
aliased to dk's output and DMA'd once per (core, batch element) into the accumulator, so a chunk adds to it in
place instead of writing partial sums that XLA re-reads and adds (4.4 ms of 163 at S = 128K, static estimates).

Static v5p estimates (S = 32K, K = 512, H_I = 64, d_I = 128, bf16) are in `student_plan.default_query_chunk`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from csa_pallas.kernels import common, fused_kl, runtime, slot_rows
from csa_pallas.kernels import student_gather as sg
from csa_pallas.kernels.common import NN, NT, TN


def _kernel(*refs, operand, kl: fused_kl.FusedKL, accumulate: bool, in_place: bool):
    refs = list(refs)
    if in_place:
        refs.pop(0)  # the chunk's tile offset: read by q's and dq's index maps only
    idx_ref, target_ref, q_ref, w_ref, keys_ref, p_ref, count_ref = refs[:7]
    refs = refs[7:]
    dk_in_ref = refs.pop(0) if accumulate else None  # HBM, aliased to dk's output: the running partial sums
    if in_place:
        refs.pop(0)  # HBM, aliased to dq's output: written through dq's blocks
    (dq_ref, dw_ref, dk_ref, stats_ref, stage_ref, logits_ref, grad_ref, dk_rows_ref, z_ref, buf_ref, sem_ref,
     dk_odd_ref, *copy_sem) = refs

    # this core's partial sums for this batch element (flattened [CORES * B, ...]; the grid ids are read out here:
    # the interpreter resolves them at the kernel's top level only)
    which = pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)
    step, fold_step = pl.program_id(2), pl.num_programs(2) - 1

    @pl.when(step == 0)  # the first query tile of this core's walk over a batch element
    def _():
        if accumulate:  # start from the partial sums of the previous query chunks (no XLA add per chunk)
            copy = pltpu.make_async_copy(dk_in_ref.at[pl.ds(which, 1)], dk_ref, copy_sem[0])
            copy.start()
            copy.wait()
        else:
            dk_ref[...] = jnp.zeros(dk_ref.shape, dk_ref.dtype)
        dk_odd_ref[...] = jnp.zeros(dk_odd_ref.shape, dk_odd_ref.dtype)

    # One step past the core's query tiles (its blocks those of the last tile, so nothing is fetched or written
    # back): the odd groups' sums join the even ones', once. (At the end of the last tile's step instead, the
    # static estimate charged the sum to every step: the branch's condition, read after the query loops, is not
    # statically computable for it.)
    @pl.when(step == fold_step)
    def _():
        dk_ref[...] += dk_odd_ref[...]

    @pl.when(step < fold_step)
    def _():  # one query tile: the scores (phase 1), its KL and G (2), the gradients (3)
        width = idx_ref.shape[1]
        d_p = keys_ref.shape[1]

        def score(t, slots):  # phase 1: gather once (into the query's own staging rows), score
            rows = sg.gathered_rows(slots, keys_ref, stage_ref.at[t], operand)
            z = common.exact_dot(q_ref[t].astype(operand), rows, NT)  # [H_I, K_p]
            z_ref[t] = z
            w = common.rows_to_column(w_ref[pl.ds(t, 1), :])
            logits_ref[pl.ds(t, 1), :] = jnp.sum(w * jnp.maximum(z, 0.0), axis=0, keepdims=True)

        slot_rows.for_each_query([idx_ref], buf_ref, sem_ref, score)
        # phase 2: the tile's KL and G (P' is the target; its empty slots are -1, masked to 0 by mask_target)
        fused_kl.kl_epilogue(kl, p_ref, logits_ref, stats_ref, grad_ref,
                             visible_at=lambda start, size: jnp.logical_not(p_ref[:, pl.ds(start, size)] < 0.0),
                             mask_target=True)

        def backward(t, targets):  # phase 3: the gradients from the staged rows
            # the products take non-finite operands as 0 (SPEC §6, `student_gather`), cleaned in f32 before the cast
            rows = common.finite_or_zero(stage_ref[t].reshape(width, d_p)).astype(operand)
            q = common.finite_or_zero(q_ref[t]).astype(operand)
            z = z_ref[t]
            positive = z > 0.0  # ReLU'(0) = 0 (SPEC §8)
            g = grad_ref[pl.ds(t, 1), :]  # [1, K_p]
            dw_ref[pl.ds(t, 1), :] = common.column_to_rows(sg.weight_gradient(g, z), 1)
            w = common.finite_or_zero(common.rows_to_column(w_ref[pl.ds(t, 1), :]))
            terms = common.hi_lo_terms(jnp.where(positive, w * g, 0.0), operand)
            dq_ref[t] = sum(common.exact_dot(x, rows, NN) for x in terms).astype(dq_ref.dtype)
            folded = common.hi_lo_terms(jnp.where(positive, w * (g * count_ref[pl.ds(t, 1), :]), 0.0), operand)
            dk_rows_ref[...] = sum(common.exact_dot(x, q, TN) for x in folded)  # [K_p, d_p]
            # distinct targets per group; the odd groups add into a second accumulator (`sg.add_rows_to_targets`)
            sg.add_rows_to_targets(targets, dk_rows_ref, (dk_ref, dk_odd_ref))

        slot_rows.for_each_query([target_ref], buf_ref, sem_ref, backward)


def rows_in_place_ok(index_q_all, chunk: int, cfg: sg.StudentGatherConfig | None = None) -> bool:
    """Whether `loss_and_grads(rows_in_place=...)` can read chunks of `chunk` rows of index_q_all [B, S_all, H_I,
    d_I] where they lie: d_I a whole number of lane tiles, bf16 or f32 (the kernel's own dtypes), the chunk whole
    tiles of both TensorCores' shares (no padding)."""
    bq = (sg.StudentGatherConfig() if cfg is None else cfg).block_q
    return (index_q_all.shape[3] % common.LANES == 0 and index_q_all.dtype in (jnp.bfloat16, jnp.float32)
            and chunk % (sg.CORES * bq) == 0 and index_q_all.shape[1] % chunk == 0)


def loss_and_grads(index_q, keys, index_weights, topk_indices, target, operand_dtype,
                   cfg: sg.StudentGatherConfig | None = None, grad_scale: float = 1.0, dk_partials=None,
                   rows_in_place=None):
    """(per-row KL f32 [B, S], non-empty rows bool [B, S], (d index_q, d keys, d index_weights)): the KL of
    softmax_V(I) against the teacher's slot-order target and the gradients of grad_scale * sum_t KL_t, I the
    student's scores over the selection (`student_gather.scores`). Not differentiable (the caller's custom_vjp
    scales the gradients by the loss's cotangent).

    index_q float [B, S, H_I, d_I]; keys f32 [B, R + ZERO_ROWS, d_p] (`student_gather.resident_keys`); index_weights
    [B, S, H_I]; topk_indices int [B, S, K]; target f32 [B, S_t, K_t] (S_t >= S, K_t >= K: the teacher's padded
    P', -1 on empty slots and past S and K); gradients: index_q's dtype, f32 [B, R + ZERO_ROWS, d_p], f32
    [B, S, H_I]. dk_partials: None, or the TensorCores' running dk sums f32 [CORES, B, accumulator_rows(R), d_p]
    (`dk_partials_zeros`; a query-chunked caller's carry), which the kernel adds to in place (the buffer is
    aliased to its output) and returns as d keys instead (`finish_dk_partials` turns them into d keys).
    rows_in_place: None, or (index_q_all [B, S_all, H_I, d_I], dq_all of its shape and dtype, first_row int32
    scalar) with index_q None (`rows_in_place_ok`; a query-chunked caller): the chunk's rows are read from
    index_q_all and their gradient written into dq_all (aliased to the output) at first_row, through a
    scalar-prefetched tile offset, and d index_q comes back as the whole updated dq_all (no chunk copies)."""
    if rows_in_place is not None:
        index_q, dq_all, first_row = rows_in_place
    b, _, h, d = index_q.shape
    s = topk_indices.shape[1]
    k = topk_indices.shape[2]
    rows, d_p = keys.shape[1] - sg.ZERO_ROWS, keys.shape[2]
    cfg = sg.StudentGatherConfig() if cfg is None else cfg
    bq = cfg.block_q
    s_p, k_p = common.round_up(s, sg.CORES * bq), common.round_up(k, 128)
    nq, half = s_p // bq, s_p // bq // sg.CORES
    q_dtype = jnp.bfloat16 if index_q.dtype == jnp.bfloat16 else jnp.float32
    in_place = rows_in_place is not None
    if in_place:  # [B * S_all, H_I, d_p]: a free reshape; a chunk's tiles start at its first row's tile
        s_all = index_q.shape[1]
        q = index_q.reshape(b * s_all, h, d_p)
        first_tile = (first_row // bq).astype(jnp.int32).reshape(1)
    else:
        q = jnp.pad(index_q.astype(q_dtype), ((0, 0), (0, s_p - s), (0, 0), (0, d_p - d))).reshape(b * s_p, h, d_p)
    w = jnp.pad(index_weights.astype(jnp.float32), ((0, 0), (0, s_p - s), (0, 0))).reshape(b * s_p, h)
    idx = jnp.pad(topk_indices.astype(jnp.int32), ((0, 0), (0, s_p - s), (0, k_p - k)), constant_values=-1)
    p = jnp.pad(target[:, :s, :k].astype(jnp.float32), ((0, 0), (0, s_p - s), (0, k_p - k)),
                constant_values=-1.0).reshape(b * s_p, k_p)
    valid = jnp.logical_not(p < 0.0)
    # A slot outside V(t) reads the zero row R (`student_gather.ZERO_ROWS`): a non-finite index_k row it does not
    # see never meets its zero G in a product.
    idx = jnp.where(valid, idx.reshape(b * s_p, k_p) & (rows - 1), rows)
    # The multiplicity fold: a valid slot's count of the valid slots of its group reading its row (invalid ones
    # read row R, so the first slot reading a valid row is valid).
    targets, counts = sg.scatter_plan(idx, valid.astype(jnp.float32), rows)
    kl = fused_kl.FusedKL(emit_gradient=True, seq_len=s, grad_scale=grad_scale)
    acc_rows = sg.accumulator_rows(rows)
    # *_: the scalar-prefetched ref, if any; step `half` of a core (the dk sum, `_kernel`) keeps its last tile's blocks
    last = lambda i: jnp.minimum(i, half - 1)
    tile = lambda c, bb, i, *_: bb * nq + c * half + last(i)
    slots = pl.BlockSpec((bq, k_p), lambda *g: (tile(*g), 0), memory_space=pltpu.SMEM)
    slot_values = pl.BlockSpec((bq, k_p), lambda *g: (tile(*g), 0))
    operand = jnp.dtype(operand_dtype)
    passes = 1 + 2 * (1 if operand == jnp.float32 else 2)  # the scores; dq's and dk's terms
    read = (b * s_p * (h * d_p * q.dtype.itemsize + 4 * h + 4 * 4 * k_p)
            + 4 * sg.CORES * b * (rows + sg.ZERO_ROWS) * d_p)
    written = b * s_p * (h * d_p * q.dtype.itemsize + 4 * h) + 4 * sg.CORES * b * acc_rows * d_p + 4 * b * nq * 8 * bq
    accumulate = dk_partials is not None
    q_tile = tile if not in_place else lambda c, bb, i, first: bb * (s_all // bq) + first[0] + c * half + last(i)
    in_specs = [slots, slots,
                pl.BlockSpec((bq, h, d_p), lambda *g: (q_tile(*g), 0, 0)),
                pl.BlockSpec((bq, h), lambda *g: (tile(*g), 0)),
                pl.BlockSpec((None, rows + sg.ZERO_ROWS, d_p), lambda c, bb, i, *_: (bb, 0, 0),
                             pipeline_mode=pl.Buffered(1)),
                slot_values, slot_values]
    operands = [idx, targets, q, w, keys, p, counts]
    aliases = {}
    if accumulate:  # read once per (core, batch element) by a DMA into dk's VMEM block (no second VMEM block)
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        operands.append(dk_partials.reshape(sg.CORES * b, acc_rows, d_p))
        aliases[len(operands) - 1] = 2
        read += 4 * sg.CORES * b * acc_rows * d_p
    if in_place:  # the chunk's dq blocks land in dq_all; the other rows keep what the aliased buffer holds
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        operands.append(dq_all.reshape(q.shape))
        aliases[len(operands) - 1] = 0
    out_specs = (pl.BlockSpec((bq, h, d_p), lambda *g: (q_tile(*g), 0, 0)),
                 pl.BlockSpec((bq, h), lambda *g: (tile(*g), 0)),
                 # one buffer: its block changes once per (core, batch element), and the odd groups' accumulator
                 # takes the VMEM of the second
                 pl.BlockSpec((1, acc_rows, d_p), lambda c, bb, i, *_: (c * b + bb, 0, 0),
                              pipeline_mode=pl.Buffered(1)),
                 pl.BlockSpec((None, None, fused_kl.KL_STAT_ROWS, bq),
                              lambda c, bb, i, *_: (bb, c * half + last(i), 0, 0)))
    kernel = functools.partial(_kernel, operand=operand, kl=kl, accumulate=accumulate, in_place=in_place)
    grid = dict(grid=(sg.CORES, b, half + 1), in_specs=in_specs, out_specs=out_specs,
                scratch_shapes=[pltpu.VMEM((bq, k_p // 8, 8, d_p), jnp.float32), pltpu.VMEM((bq, k_p), jnp.float32),
                                pltpu.VMEM((bq, k_p), jnp.float32), pltpu.VMEM((k_p, d_p), jnp.float32),
                                pltpu.VMEM((bq, h, k_p), jnp.float32)] + slot_rows.scratch(k_p, 1)
                               + [pltpu.VMEM((1, acc_rows, d_p), jnp.float32)]
                               + ([pltpu.SemaphoreType.DMA(())] if accumulate else []))
    if in_place:  # the tile offset is scalar-prefetched: every index map takes its ref (q's and dq's read it)
        grid = dict(grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, **grid))
        operands = [first_tile] + operands
        aliases = {i + 1: o for i, o in aliases.items()}
    dq, dw, dk, stats = runtime.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(w.shape, jnp.float32),
                   jax.ShapeDtypeStruct((sg.CORES * b, acc_rows, d_p), jnp.float32),
                   jax.ShapeDtypeStruct((b, nq, fused_kl.KL_STAT_ROWS, bq), jnp.float32)),
        **grid,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                                             vmem_limit_bytes=cfg.vmem_limit_bytes),
        cost_estimate=pl.CostEstimate(flops=passes * 2 * b * s_p * k_p * h * d_p, transcendentals=b * s_p * k_p,
                                      bytes_accessed=read + written),
        interpret=runtime.interpret_mode(),
        name=f"csa_student_gather_kl_grads_bq{bq}{'_in_place' if in_place else ''}",
    )(*operands)
    dk = dk.reshape(sg.CORES, b, acc_rows, d_p)
    kl_rows = stats[:, :, 0, :].reshape(b, s_p)[:, :s]
    nonempty = stats[:, :, 3, :].reshape(b, s_p)[:, :s] > 0
    dq = dq.reshape(index_q.shape) if in_place else dq.reshape(b, s_p, h, d_p)[:, :s, :, :d].astype(index_q.dtype)
    dw = dw.reshape(b, s_p, h)[:, :s]
    return kl_rows, nonempty, (dq, dk if accumulate else finish_dk_partials(dk), dw)


def dk_partials_zeros(keys):
    """Zero running dk sums for `loss_and_grads(dk_partials=...)`: f32 [CORES, B, accumulator_rows(R), d_p] for the
    resident keys f32 [B, R + ZERO_ROWS, d_p]."""
    b, rows, d_p = keys.shape[0], keys.shape[1] - sg.ZERO_ROWS, keys.shape[2]
    return jnp.zeros((sg.CORES, b, sg.accumulator_rows(rows), d_p), jnp.float32)


def finish_dk_partials(partials):
    """The TensorCores' dk sums [CORES, B, accumulator_rows(R), d_p] -> d keys f32 [B, R + ZERO_ROWS, d_p] (the
    discarded rows dropped, the zero rows' cotangent 0)."""
    rows = partials.shape[2] - sg.accumulator_rows(0)
    dk = jnp.sum(partials[:, :, sg.ACC_FRONT:sg.ACC_FRONT + rows], axis=0)
    return jnp.pad(dk, ((0, 0), (0, sg.ZERO_ROWS), (0, 0)))
