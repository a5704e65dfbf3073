"""Sparse teacher (+ fused KL), K-proportional: every query gathers its K selected compressed-KV rows.

The dense-visit teacher (`teacher` with a selection) costs ~N/2 (query, block) pairs per query whatever K is; at
long context that is the whole causal triangle. Here each query pays K gathered rows instead:

  * the compressed KV of the batch element stays resident in VMEM for the whole query walk: bf16 rows packed two
    features per u32 word (features d and d + D/2 share word d; bf16 single-row loads do not compile on v5p, u32
    ones do, and a bf16 value is the high half of an f32), f32 rows as their bits. The kernel packs them itself
    (`_pack_resident`) at the first step of each TensorCore's walk over a batch element, from compressed_kv as
    given in HBM (DMA'd in chunks of rows, double-buffered; +-inf made NaN on the way, so a score reading a
    non-finite value is NaN), so no packed copy exists in HBM (at S = 128K it was a 32 MiB temp, live through
    every query chunk).
    Resident size R * D * 2 bytes (bf16): 32 MiB at S = 128K, D = 512. Grid (TensorCores, B, query tiles per
    core, slot chunks): the core axis is the "parallel" one, so a step knows its core's first tile;
  * per query, its K_p slot indices (an SMEM block) drive K_p dynamic single-row loads into a staging buffer;
    an empty slot loads row index & (R - 1), whatever it holds, and is masked by its slot bit;
  * scores [H, K_p] = q[t] [H, D] x rows^T on the MXU (bf16: two half-D products on the unpacked halves; the heads
    are the M dimension), then the per-head log-sum-exp over the valid slots, the rebased finish (`rebase`) and
    P[t, k] = sum_h 2^(z - G_h), already in slot order: no scatter and no gather back, and a duplicated index is
    simply a second row (each slot its own softmax entry, SPEC §2).

After a step's bq queries: the same fused-KL epilogue as the teacher (`fused_kl`), or P normalised (-1 on empty
slots), or the unnormalised head sum with the rows' M (heads sharded over devices). One head chunk (all heads of
a query at once: [H, K_p] f32 temporaries).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from csa_pallas.kernels import common, fused_kl, rebase, runtime, selection

MiB = common.MiB
LANES = common.LANES


@dataclasses.dataclass(frozen=True)
class GatherConfig:
    """block_q: queries per grid step (a multiple of 8). vmem_limit_bytes: Mosaic's scoped-VMEM limit.
    unroll_slots: the 128 slots of a chunk as straight-line code with static SMEM offsets and staging rows (~2
    bundles per row on v5p; the default), or a loop over them (~3.5; a much smaller program); the interpreter
    runs either as a loop (`runtime.rolled`). q_in_place: how a query chunk of `fused_indexer_distill_loss`
    (`Problem.q_window`) reaches the kernel: its q rows read where they lie in the whole q through a
    scalar-prefetched tile offset (a `RowWindow`; no [B, chunk, H, D] copy), or a per-chunk copy (False); None: in
    place wherever it applies (q in the compute dtype, chunks of whole query tiles of both TensorCores); True where
    it cannot apply: a ValueError naming the field (`ops_sparse.in_place_rows`)."""

    block_q: int
    vmem_limit_bytes: int
    unroll_slots: bool = True
    q_in_place: Optional[bool] = None

    def __post_init__(self):
        if self.block_q < 8 or self.block_q % 8:
            raise ValueError(f"block_q: expected a positive multiple of 8, got {self.block_q}")
        if not common.is_optional_bool(self.q_in_place):
            raise ValueError(f"q_in_place: expected None, True or False, got {self.q_in_place!r}")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["rows", "first_tile"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class RowWindow:
    """q rows read in place: the kernel's S_p query rows are rows[:, first_tile * block_q:][:, :S_p] (a query chunk
    of a longer q, `fused_student`), fetched by the index maps from a scalar-prefetched tile offset instead of
    from a per-chunk copy (at S = 128K the copies of q were 6.2 ms of estimate and 32 MiB of temp).
    rows: [B, S_all, H, D] in the kernel's compute dtype; first_tile: int32 [1]."""

    rows: jax.Array
    first_tile: jax.Array


def lane_planes(words: int) -> tuple:
    """(planes, lanes): the resident row of `words` u32 words as planes of <= 128 lanes (a 128-lane plane makes a
    dynamic row's address the row index itself: ~2 bundles per gathered row instead of ~3.5 with 256-lane rows)."""
    if words <= common.LANES:
        return 1, words
    if words % common.LANES:
        raise ValueError(f"head_dim: the gather path needs D/2 (bf16) or D (f32) <= 128 or a multiple of 128, got "
                         f"{words} words")
    return words // common.LANES, common.LANES


def resident_row_count(num_blocks: int) -> int:
    """Rows of the resident array: a power of two >= N (>= 8), so a slot's row is index & (rows - 1) (one scalar
    op; an empty slot reads some row and is masked by its slot bit)."""
    return max(common.SUBLANES, 1 << (max(num_blocks, 1) - 1).bit_length())


PACK_ROWS = 128  # compressed_kv rows per DMA of `_pack_resident` (a [128, D] f32 working set per chunk)
CORES = common.MEGACORE  # the grid's "parallel" axis: one share of the query tiles per TensorCore


def pack_rows(num_blocks_padded: int) -> int:
    """Rows per DMA of `_pack_resident`: the largest power of two <= PACK_ROWS dividing N_p (a multiple of 16)."""
    return math.gcd(num_blocks_padded, PACK_ROWS)


EXPONENT = 0x7F800000  # f32 exponent bits (a bf16's are the same bits of its f32): all set on NaN and +-inf
QUIET = 0x00400000  # the f32 mantissa bit that makes an all-ones exponent a NaN (+-inf -> NaN)


def _pack_resident(kv_hbm, resident_ref, stage_ref, sems, batch, *, bf16: bool):
    """Fills resident_ref u32 [planes, R, lanes] with the batch element's rows of kv_hbm [B, N_p, D] (HBM): row s
    holds block s, bf16 packed two features per word (feature d in the low half, d + D/2 in the high half of word
    d), f32 as its bits; +-inf becomes NaN, so a score reading a non-finite value is NaN whatever the signs (SPEC
    §3: a lone -inf score would silently drop its slot; a NaN term makes the product NaN for any q, so no row-wide
    fill is needed). Rows past N_p keep what the scratch held: only empty slots read them, and their scores are
    selected away. Chunks of `stage_ref.shape[1]` rows are DMA'd double-buffered into stage_ref [2, rows, D]."""
    planes, _, lanes = resident_ref.shape
    n, ch = kv_hbm.shape[1], stage_ref.shape[1]
    count = n // ch

    def copy(j, slot):
        return pltpu.make_async_copy(kv_hbm.at[batch, pl.ds(j * ch, ch)], stage_ref.at[slot], sems.at[slot])

    copy(0, 0).start()

    def body(j, carry):
        slot = j & 1
        copy(j, slot).wait()

        @pl.when(j + 1 < count)
        def _():
            copy(j + 1, 1 - slot).start()

        words = lax.bitcast_convert_type(stage_ref[slot].astype(jnp.float32), jnp.uint32)  # [ch, D]; exact for bf16
        words = jnp.where((words & EXPONENT) == EXPONENT, words | QUIET, words)
        if bf16:  # a bf16 value's bits are its f32's high half
            half = words.shape[1] // 2
            words = (lax.shift_right_logical(words[:, :half], jnp.uint32(16))
                     | (words[:, half:] & jnp.uint32(0xFFFF0000)))
        start = pl.multiple_of(j * ch, ch)
        for p in range(planes):
            resident_ref[p, pl.ds(start, ch), :] = words[:, p * lanes:(p + 1) * lanes]
        return carry

    lax.fori_loop(0, count, body, 0)


def resident_bytes(num_blocks_padded: int, head_dim: int, dtype) -> int:
    """VMEM of the resident rows and `_pack_resident`'s two staging chunks."""
    isz = jnp.dtype(dtype).itemsize
    return (resident_row_count(num_blocks_padded) + 2 * pack_rows(num_blocks_padded)) * head_dim * isz


def vmem_bytes(cfg: GatherConfig, *, num_heads: int, head_dim: int, num_blocks_padded: int, width_p: int, dtype,
               kl_logits_dtype=None) -> int:
    isz = jnp.dtype(dtype).itemsize
    bq = cfg.block_q
    resident = resident_bytes(num_blocks_padded, head_dim, dtype)
    blocks = 2 * (bq * num_heads * head_dim * isz + 2 * bq * width_p * 4 + 2 * num_heads * max(bq, 128) * 4)
    if kl_logits_dtype is not None:
        blocks += 4 * bq * width_p * jnp.dtype(kl_logits_dtype).itemsize
    scratch = bq * width_p * head_dim * isz + bq * width_p * 4
    # one query's scores and exponentials (the queries of a step run one at a time), its unpacked rows, the epilogue;
    # `_pack_resident`'s f32 chunk and its bits
    temporaries = (6 * num_heads * width_p * 4 + 2 * width_p * head_dim * 4 + 8 * bq * width_p * 4
                   + 3 * pack_rows(num_blocks_padded) * head_dim * 4)
    return resident + blocks + scratch + temporaries


def default_config(*, num_heads: int, head_dim: int, num_blocks_padded: int, width_p: int, dtype,
                   kl_logits_dtype=None, vmem_capacity: int = 64 * MiB) -> Optional[GatherConfig]:
    """8 queries per step; None when the resident rows and the step's buffers do not fit in VMEM."""
    cfg = GatherConfig(8, 0)
    need = vmem_bytes(cfg, num_heads=num_heads, head_dim=head_dim, num_blocks_padded=num_blocks_padded,
                      width_p=width_p, dtype=dtype, kl_logits_dtype=kl_logits_dtype)
    if need > int(0.9 * vmem_capacity):
        return None
    return dataclasses.replace(cfg, vmem_limit_bytes=min(vmem_capacity - 4 * MiB, max(32 * MiB, int(need * 1.2))))


def _kernel(idx_smem, q_ref, kv_hbm, vbits_ref, *refs, mode, scale, width_p, block_q, bf16, normalize,
            unroll_slots: bool, kl: Optional[fused_kl.FusedKL]):
    # the grid ids are read out here: the interpreter resolves them at the kernel's top level only
    batch, first_tile, chunk = pl.program_id(1), pl.program_id(2) == 0, pl.program_id(3)
    last_chunk = chunk == pl.num_programs(3) - 1
    refs = list(refs)
    lse_ref = shift_ref = None
    if mode != "per_head":
        lse_ref, shift_ref = refs.pop(0), refs.pop(0)  # (u or F) - sigma [bq, H]; sigma [8, bq] (row 0)
    rowmax_ref = None
    if kl is None:
        out_ref = refs.pop(0)
        if not normalize:
            rowmax_ref = refs.pop(0)
    else:
        logits_ref, stats_ref = refs.pop(0), refs.pop(0)
        grad_ref = refs.pop(0) if kl.emit_gradient else None
    stage_ref, valid_ref, top_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    shift_col_ref = refs.pop(0) if mode != "per_head" else None
    acc_ref = out_ref if kl is None else refs.pop(0)
    kv_ref, pack_stage_ref, pack_sems = refs  # the resident rows u32 [planes, R, lanes]
    planes, rows, lanes = kv_ref.shape

    @pl.when(jnp.logical_and(first_tile, chunk == 0))  # this core's first step on this batch element
    def _():
        _pack_resident(kv_hbm, kv_ref, pack_stage_ref, pack_sems, batch, bf16=bf16)

    # Gather the chunk's 128 slots of every query; the resident row is index & (R - 1). unroll_slots: Mosaic
    # unrolls the loop with the slot a constant in each copy, so SMEM offsets and staging rows are static (no
    # address arithmetic but the chunk's base); the interpreter runs it as a loop (`runtime.rolled`).
    base = chunk * (LANES // 8)

    for t in range(block_q):
        def gather(j, carry, t=t):
            row = idx_smem[t, j] & (rows - 1)
            tile, sublane = base + lax.shift_right_logical(j, 3), pl.ds(j & 7, 1)
            for p in range(planes):
                stage_ref[t, p, tile, sublane, :] = kv_ref[p, pl.ds(row, 1), :]
            return carry

        lax.fori_loop(0, LANES, gather, 0, unroll=unroll_slots)

    @pl.when(last_chunk)
    def _():
        # One query at a time (a fori_loop: only one query's [H, K_p] temporaries live): V(t), u - sigma and sigma
        # are read as rows of per-step blocks and turned into columns where the heads lie on sublanes.
        valid_ref[...] = selection.expand_bits(vbits_ref, 0, width_p).astype(jnp.int32)  # [bq, K_p]
        if mode != "per_head":
            shift_col_ref[...] = common.rows_to_column(shift_ref[0:1, :])  # [bq, 1]

        def per_query(t, carry):
            q = q_ref[t]  # [H, D]
            z = None
            for p in range(planes):
                words = stage_ref[t, p].reshape(width_p, lanes)  # [K_p, lanes] u32
                if bf16:
                    half = q.shape[1] // 2
                    low = lax.bitcast_convert_type(jnp.left_shift(words, 16), jnp.float32).astype(jnp.bfloat16)
                    high = lax.bitcast_convert_type(words & jnp.uint32(0xFFFF0000), jnp.float32).astype(jnp.bfloat16)
                    parts = ((q[:, p * lanes:(p + 1) * lanes], low),
                             (q[:, half + p * lanes:half + (p + 1) * lanes], high))
                else:
                    parts = ((q[:, p * lanes:(p + 1) * lanes], lax.bitcast_convert_type(words, jnp.float32)),)
                for qp, rows_p in parts:
                    zp = lax.dot_general(qp, rows_p, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                    z = zp if z is None else z + zp
            valid = valid_ref[pl.ds(t, 1), :] > 0  # [1, K_p]
            z = jnp.where(valid, z * (scale * rebase.LOG2E), -jnp.inf)  # [H, K_p], base 2
            seen = jnp.max(valid.astype(jnp.float32), axis=1, keepdims=True) > 0  # [1, 1]
            row_max = jnp.maximum(jnp.max(z, axis=1, keepdims=True), common.STAT_FLOOR)
            total = jnp.sum(jnp.exp2(z - row_max), axis=1, keepdims=True)
            c2 = rebase.compressed_log2_mass(row_max, total, seen)  # [H, 1]; NaN: saw a slot, no finite score
            if mode == "per_head":
                g = rebase.per_head_shift(c2)
                top = jnp.where(seen, 0.0, -jnp.inf)
            else:
                c2_row = common.column_to_rows(c2, 1)  # [1, H]
                lse2 = lse_ref[pl.ds(t, 1), :] * rebase.LOG2E  # [1, H]
                shift2 = shift_col_ref[pl.ds(t, 1), :] * rebase.LOG2E  # [1, 1]
                b = rebase.head_log2_mass(mode, c2_row, lse2, shift2)
                top = jnp.max(b, axis=1, keepdims=True)  # [1, 1]
                g = common.rows_to_column(rebase.exponent_shift(c2_row, b, top))  # [H, 1]
            acc_ref[pl.ds(t, 1), :] = jnp.sum(jnp.exp2(z - g), axis=0, keepdims=True)  # [1, K_p]
            top_ref[pl.ds(t, 1), :] = jnp.broadcast_to(top, (1, 1))
            return carry

        lax.fori_loop(0, block_q, per_query, 0)
        visible_at = lambda start, width: valid_ref[:, pl.ds(start, width)] > 0
        if kl is not None:
            fused_kl.kl_epilogue(kl, acc_ref, logits_ref, stats_ref, grad_ref, mask_target=True,
                                 visible_at=visible_at)
            return
        selection.write_slots(out_ref, acc_ref[...], valid_ref[...] > 0, normalize=normalize, rowmax_ref=rowmax_ref,
                              top_column=None if normalize else top_ref[...])


def sparse_gather_pallas(q, kv, idx, vbits, lse_in, *, mode: str, cfg: GatherConfig, scale: float,
                         normalize: bool = True, kl: Optional[fused_kl.FusedKL] = None, logits=None,
                         interpret=False):
    """Runs the gather teacher on padded, prepared inputs.

    Args:
      q: [B, S_p, H, D] bf16 or f32, S_p a multiple of CORES * cfg.block_q; or a `RowWindow` holding them in place.
      kv: [B, N_p, D] compressed_kv in q's dtype, N_p a multiple of 16, rows holding a non-finite value as given
        (the kernel makes +-inf NaN as it packs its resident rows, `_pack_resident`).
      idx: int32 [B, S_p, K_p] top-k indices (any values: a slot reads row idx & (R - 1)).
      vbits: int32 [B, S_p, K_p / 32] slot bits (`selection.slot_bits`): V(t).
      lse_in: None (per_head) or ((u or F) - sigma as f32 [B, S_p, H], sigma as row statistics [B, nq, 8, bq]).
      normalize, kl, logits: as `teacher.teacher_pallas` (sparse mode).

    Returns:
      as `teacher.teacher_pallas` in sparse mode: P f32 [B, S_p, K_p] in slot order (-1 on empty slots), or
      (head sum, M [B, nq, 8, bq]) with normalize=False, or the fused KL's statistics (and G).
    """
    if mode not in rebase.MODES:
        raise ValueError(f"mode: expected one of {rebase.MODES}, got {mode!r}")
    window = q if isinstance(q, RowWindow) else None
    q = q.rows if window is not None else q
    b, _, h, d = q.shape
    s_p, k_p = idx.shape[1], idx.shape[2]
    chunks = k_p // LANES
    bq = cfg.block_q
    nq = s_p // bq
    if nq % CORES:
        raise ValueError(f"idx: expected a multiple of {CORES * bq} rows (a share of whole query tiles per core), "
                         f"got {s_p}")
    half = nq // CORES
    n_p = kv.shape[1]
    if n_p % 16:
        raise ValueError(f"kv: expected a multiple of 16 blocks (whole DMA chunks of rows), got {n_p}")
    bf16 = q.dtype == jnp.bfloat16
    words = d // 2 if bf16 else d
    planes, lanes = lane_planes(words)
    n_rows = resident_row_count(n_p)
    tile = lambda c, i: c * half + i  # the query tile of core c's i-th step
    row = lambda c, bb, i, k: (bb, tile(c, i), 0)
    tile4 = lambda c, bb, i, k: (bb, tile(c, i), 0, 0)
    in_specs = [
        pl.BlockSpec((None, bq, LANES), lambda c, bb, i, k: (bb, tile(c, i), k), memory_space=pltpu.SMEM),
        pl.BlockSpec((None, bq, h, d), tile4),
        pl.BlockSpec(memory_space=pl.ANY),  # packed into the resident rows by the kernel
        pl.BlockSpec((None, bq, vbits.shape[2]), row),
    ]
    operands = [idx, q, kv, vbits]
    if mode != "per_head":
        in_specs += [pl.BlockSpec((None, bq, h), row),
                     pl.BlockSpec((None, None, common.SUBLANES, bq), tile4)]
        operands += list(lse_in)
    out_specs = pl.BlockSpec((None, bq, k_p), row)
    out_shape = jax.ShapeDtypeStruct((b, s_p, k_p), jnp.float32)
    if kl is None and not normalize:
        out_specs = [out_specs, pl.BlockSpec((None, None, common.SUBLANES, bq), tile4)]
        out_shape = [out_shape, jax.ShapeDtypeStruct((b, nq, common.SUBLANES, bq), jnp.float32)]
    if kl is not None:
        logits_spec, out_specs, out_shape = fused_kl.fused_kl_blocks(kl, logits, row, block_q=bq)
        in_specs.append(logits_spec)
        operands.append(logits)
    scratch = [pltpu.VMEM((bq, planes, k_p // 8, 8, lanes), jnp.uint32), pltpu.VMEM((bq, k_p), jnp.int32),
               pltpu.VMEM((bq, 1), jnp.float32)]
    if mode != "per_head":
        scratch.append(pltpu.VMEM((bq, 1), jnp.float32))
    if kl is not None:
        scratch.append(pltpu.VMEM((bq, k_p), jnp.float32))
    scratch += [pltpu.VMEM((planes, n_rows, lanes), jnp.uint32), pltpu.VMEM((2, pack_rows(n_p), d), kv.dtype),
                pltpu.SemaphoreType.DMA((2,))]
    kernel = functools.partial(_kernel, mode=mode, scale=scale, width_p=k_p, block_q=bq, bf16=bf16,
                               normalize=normalize, unroll_slots=cfg.unroll_slots, kl=kl)
    if window is not None:  # the tile offset is scalar-prefetched: every index map takes its ref
        in_specs = [_prefetching(spec) for spec in in_specs]
        in_specs[1] = pl.BlockSpec((None, bq, h, d), lambda c, bb, i, k, first: (bb, tile(c, i) + first[0], 0, 0))
        out_specs = ([_prefetching(spec) for spec in out_specs] if isinstance(out_specs, list) else
                     _prefetching(out_specs))
        kernel = functools.partial(_drop_prefetch, kernel)
    flops = 2 * b * s_p * k_p * h * d
    kl_bytes = 0 if kl is None else logits.size * logits.dtype.itemsize * (2 if kl.emit_gradient else 1)
    # q once, compressed_kv once per (core, batch element), the indices (SMEM blocks) and slot bits once.
    bytes_accessed = (b * s_p * h * d * q.dtype.itemsize + CORES * kv.size * kv.dtype.itemsize
                      + (idx.size + vbits.size) * 4 + kl_bytes
                      + (0 if lse_in is None else lse_in[0].size * 4) + (0 if kl is not None else b * s_p * k_p * 4))
    grid = dict(grid=(CORES, b, half, chunks), in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch)
    if window is not None:
        grid = dict(grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, **grid))
        operands = [window.first_tile] + operands
    return runtime.pallas_call(
        kernel,
        out_shape=out_shape,
        **grid,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary", "arbitrary"),
                                             vmem_limit_bytes=cfg.vmem_limit_bytes),
        cost_estimate=pl.CostEstimate(flops=flops, transcendentals=2 * b * s_p * k_p * h,
                                      bytes_accessed=bytes_accessed),
        interpret=interpret,
        name=(f"csa_sparse_gather_{mode}_bq{bq}{'' if cfg.unroll_slots else '_looped'}{'_kl' if kl else ''}"
              f"{'_q_in_place' if window is not None else ''}"),
    )(*operands)


def _prefetching(spec: pl.BlockSpec) -> pl.BlockSpec:
    """spec with an index map that also takes (and ignores) the scalar-prefetched ref after the 4 grid ids."""
    if spec.index_map is None:  # an HBM operand (pl.ANY)
        return spec
    return dataclasses.replace(spec, index_map=lambda *ids, f=spec.index_map: f(*ids[:4]))


def _drop_prefetch(kernel, first_ref, *refs):
    del first_ref  # read by the index maps only
    return kernel(*refs)
