"""Dense block-compressed teacher P (SPEC §3) as one Pallas TPU kernel.

Grid (B*nq "parallel", H/hc "arbitrary", passes*nk "arbitrary"):
  * axis 0 walks (batch, query tile) pairs; query tiles are visited in zig-zag order so the two TensorCores of a
    v5p chip get the same causal work;
  * axis 1 walks head chunks of `head_chunk` heads (MaxText's `mla_qk_head_chunk_size` as a VMEM tile);
  * axis 2 walks the kv tiles a query tile needs (per-query-tile kv ranges via scalar prefetch, splash style: tiles
    no query of the tile can see are neither fetched nor computed; sparse mode with `tile_list`: a list of the
    tiles the tile's queries selected, the axis as long as the longest list), once for the log-sum-exp (pass 1)
    and once for the probabilities (pass 2). With `full_lse` given there is only pass 2; with `cache_scores` pass 2
    re-reads the masked scores pass 1 left in VMEM instead of a second matmul, all of them in one step after pass
    1, whose last step already computed F. Causal cached runs with one head chunk walk query tiles in pairs
    (qi, nq-1-qi) on axis 0 instead, the pair's steps back to back: every pair has the same number of steps, so
    none idles.

Per step the hc heads of bq queries form R = hc*bq rows [R, D] (head-major) against one kv tile [bk, D]: one MXU
call, f32 accumulation (with the causal schedule, a diagonal kv tile only up to its last visible 128-lane chunk).
Scores are kept in base 2 (times log2 e, exp2). Running max/sum are kept per lane ([hc, bq, 128]); the first
pass-2 step reduces them across lanes into F, held replicated over lanes ([*view, 128]) for the later steps.
The head-summed probabilities accumulate in the resident output block [bq, N_p] (f32); after the last head chunk
the block is L1-normalised in place. No [B, H, S, N] tensor ever exists, in HBM or VMEM.

This module launches the kernel (block specs, scratch, cost estimate); its body is `teacher_phases`, its variant
family (`TeacherConfig`, heuristics, VMEM calculator) `teacher_config`.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from csa_pallas.kernels import common, fused_kl, rebase, runtime, selection, slot_counts, teacher_phases
from csa_pallas.kernels import schedule as schedule_lib
from csa_pallas.kernels.teacher_config import (TeacherConfig, resolve_row_layout, resolve_straight_pass2,
                                               resolve_tile_list, resolve_walk)

MODES = rebase.MODES
EMPTY_SLOT = selection.EMPTY_SLOT  # sparse mode: the value of empty slots in P


def normalize_rows(head_sum: jax.Array) -> jax.Array:
    """The kernel's final L1 normalisation, in XLA, for head sums built from several shards: f32 [..., N]."""
    total = jnp.sum(head_sum, axis=-1, keepdims=True)
    return head_sum / jnp.maximum(total, common.F32_TINY)


def teacher_pallas(q, kv, qmeta, kmeta, firsts, counts, lse_in, *, mode: str, cfg: TeacherConfig, scale: float,
                   schedule: schedule_lib.TileSchedule, normalize: bool = True,
                   kl: Optional[fused_kl.FusedKL] = None, logits=None, seq_len: Optional[int] = None,
                   picks=None, block_order: bool = False, interpret=False):
    """Runs the dense teacher kernel on padded, prepared inputs.

    Args:
      q: [B, S_p, H, D] (bf16/f32), S_p a multiple of cfg.block_q.
      kv: [B, N_p, D] same dtype as q, N_p a multiple of cfg.block_k.
      qmeta: int32 [B, S_p, 128]; kmeta: int32 [B, 8, N_p] (see `common`); not read when schedule.causal (masks
        from iota positions) or with picks.
      firsts, counts: per-query-tile kv-tile ranges from `common.tile_ranges` (ignored when schedule.causal), or
        with schedule.listed the tile lists and counts of `selection.tile_lists`.
      lse_in: None (per_head), or (u - sigma, sigma) (joint) / (F - sigma, sigma) (full_lse), each f32 in the row
        layout's HBM form (`common.row_layout(...).stats_to_hbm`); sigma is a per-row shift (`rebase`).
      mode: "per_head" | "joint" | "full_lse".
      normalize: False returns the head sum unnormalised and the rows' max head weight M (heads sharded over
        devices: the caller rescales the shards' sums to a common M, adds them and normalises once).
      kl, logits: the fused KL (the loss path): logits I [B, S_p, N_p] (any float dtype, padding anything).
      seq_len: the real query rows S (default S_p; rows past it are padding, 0 in P).
      picks: sparse mode, (idx, vbits, bits, tables) from `selection`: the top-k indices int32 [B, S_p, K_p] (any
        values), the slot bits int32 [B, S_p, K_p / 32] (V(t)), the block bits int32 [B, S_p, W_p], the
        per-query-tile flags; cfg.block_k a multiple of 128 dividing 4096. The kernel then reads V(t) from them
        (qmeta/kmeta are not read) and P is in slot order.
      block_order: sparse mode without `kl`, normalize=True: P in block order [B, S_p, N_p], each block weighted
        by its slot count among the row's valid slots (sum over slots, so rows still sum to 1; 0 on unselected
        blocks), for a KL over blocks (`ops_sparse.block_target`).

    Returns:
      P, f32 [B, S_p, N_p] (sparse: [B, S_p, K_p], EMPTY_SLOT on empty slots), rows L1-normalised (0 outside
      V(t) and on empty rows, NaN on rows that read a non-finite input). normalize=False: (head sum f32
      [B, S_p, N_p], M f32 [B, nq, 8, bq] in row 0, base 2).
      With `kl`: the KL statistics f32 [B, nq, 8, bq] (row 0 KL, row 1 student lse, row 2 sum P, row 3
      non-empty; 0 on empty and padding rows) and, with kl.emit_gradient, G = softmax_V(I) * sum P - P in the
      logits' dtype [B, S_p, N_p] (0 outside V).
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    b, s_p, h, d = q.shape
    n_p = kv.shape[1]
    bq, bk, hc = cfg.block_q, cfg.block_k, cfg.head_chunk
    nq, nk, nh = s_p // bq, n_p // bk, h // hc
    group = common.head_group(h, hc, q.dtype)
    layout = resolve_row_layout(cfg, h, q.dtype)
    if not layout.token_major and group != hc and hc % common.sublane_multiple(q.dtype) == 0:
        group = hc  # a forced head-major copy of a legal chunk reads the chunk itself
    cached = cfg.cache_scores
    seq_len = s_p if seq_len is None else seq_len
    if kl is not None:
        seq_len = kl.seq_len
    # Causal cached single-chunk runs walk query tiles in pairs (qi, nq-1-qi), each pair with the same number of
    # steps, instead of nk + 1 steps per tile of which the early tiles leave most idle (~200 bundles each).
    if resolve_tile_list(cfg, sparse=picks is not None) != schedule.listed:
        raise ValueError(f"tile_list: the config says {cfg.tile_list}, the schedule listed={schedule.listed}")
    kind = resolve_walk(cfg, schedule, cached=cached, num_chunks=nh, normalize=normalize or kl is not None,
                        sparse=picks is not None)
    walk = schedule_lib.TeacherWalk(schedule, kind=kind, cached_pass2=cached or kind != "plain")
    straight_pass2 = resolve_straight_pass2(cfg, schedule, cached)
    maps = walk.index_maps(head_chunk=hc, group=group)
    sel = None
    width_p = n_p
    if picks is not None:
        idx, vbits, bits, tables = picks
        width_p = idx.shape[2]
        if bk % common.LANES or 4096 % bk:
            raise ValueError(f"block_k: sparse mode needs a multiple of {common.LANES} dividing 4096, got {bk}")
        can_fold = slot_counts.slot_fold_width(bq) if bk % (slot_counts.COUNTER_FIELDS * common.SUBLANES) == 0 else 0
        if cfg.slot_fold and not can_fold:
            raise ValueError(f"slot_fold: the transposed counts need block_q ({bq}) to divide or be a multiple of "
                             f"128 and block_k ({bk}) a multiple of {slot_counts.COUNTER_FIELDS * common.SUBLANES}")
        sel = selection.SlotSelection(width_p=width_p, table_words=1 + common.cdiv(nk, selection.WORD_BITS),
                                      fold=can_fold if cfg.slot_fold is None or cfg.slot_fold else 0,
                                      block_order=block_order)
        if block_order:
            if kl is not None or not normalize:
                raise ValueError("block_order: the block-order target is normalised and takes no fused KL")
            width_p = n_p  # the output's width; sel.width_p stays K_p (the slots)
        # a third scalar prefetch (the tables): the walk's maps take the first two
        maps = {name: (lambda m: lambda p, c, step, firsts_ref, counts_ref, tables_ref: m(
            p, c, step, firsts_ref, counts_ref))(m) for name, m in maps.items()}
    elif block_order:
        raise ValueError("block_order: needs the selection (picks)")

    in_specs = [
        pl.BlockSpec((None, bq, group, d), maps["q"]),
        pl.BlockSpec((None, bk, d), maps["kv"]),
        pl.BlockSpec((None, bq, common.LANES), maps["row"]),
        pl.BlockSpec((None, common.SUBLANES, bk), maps["kmeta"]),
    ]
    if schedule.causal or sel is not None:  # masks from iota positions or the selection: no metadata blocks
        in_specs[2:4] = [pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
        # Never read: a placeholder left in HBM. Passing the real qmeta here kept it alive for nothing; with
        # default ids XLA folded it into a constant of the executable (int32 [B, S_p, 128]: 64 MiB at S = 128K).
        qmeta = kmeta = jnp.zeros((1, common.SUBLANES, common.LANES), jnp.int32)
    operands = [q, kv, qmeta, kmeta]
    if sel is not None:
        nw = vbits.shape[2]
        k_p = sel.width_p
        in_specs += [pl.BlockSpec((None, bq, k_p), maps["row"]), pl.BlockSpec((None, bq, k_p), maps["qrow"]),
                     pl.BlockSpec((None, bq, nw), maps["row"]), pl.BlockSpec((None, bq, nw), maps["qrow"]),
                     pl.BlockSpec((None, bq, bits.shape[2]), maps["qrow"])]
        operands += [idx, idx, vbits, vbits, bits]
    if mode != "per_head":
        in_specs += [pl.BlockSpec((None, None, None, *layout.view), maps["lse"]),
                     pl.BlockSpec((None, None, common.SUBLANES, bq), maps["qstats"])]
        operands += list(lse_in)
    out_specs = pl.BlockSpec((None, bq, width_p), maps["row"])
    out_shape = jax.ShapeDtypeStruct((b, s_p, width_p), jnp.float32)
    batch_of = lambda p, *_: common.index_div(p, walk.rows)
    krow = (pl.BlockSpec(memory_space=pl.ANY) if schedule.causal
            else pl.BlockSpec((None, common.SUBLANES, n_p), lambda *ids: (batch_of(*ids), 0, 0)))
    if kl is None and not normalize:
        out_specs = [out_specs, pl.BlockSpec((None, None, common.SUBLANES, bq), maps["stats"])]
        out_shape = [out_shape, jax.ShapeDtypeStruct((b, nq, common.SUBLANES, bq), jnp.float32)]
    elif kl is None:
        in_specs.append(krow if sel is None else pl.BlockSpec(memory_space=pl.ANY))
        operands.append(kmeta)
    if kl is not None:
        logits_spec, out_specs, out_shape = fused_kl.fused_kl_blocks(kl, logits, maps["row"], block_q=bq)
        in_specs += [logits_spec, krow if sel is None else pl.BlockSpec(memory_space=pl.ANY)]
        operands += [logits, kmeta]
    lanes = min(common.LANES, bk)
    scratch = [
        pltpu.VMEM((*layout.view, lanes), jnp.float32),
        pltpu.VMEM((*layout.view, lanes), jnp.float32),
        pltpu.VMEM((*layout.view, common.LANES), jnp.float32),  # G, replicated over lanes: no per-step broadcast
    ]
    if not layout.token_major:
        scratch.append(pltpu.VMEM((hc * bq, d), q.dtype))
    if cached:
        scratch.append(pltpu.VMEM((nk, *layout.view, bk), jnp.float32))
    if kl is not None:
        scratch.append(pltpu.VMEM((bq, width_p), jnp.float32))
    if not schedule.causal and sel is None:
        scratch.append(pltpu.VMEM((bq, 1), jnp.float32))  # rows that saw a block
    if nh > 1 or (kl is None and not normalize):
        scratch.append(pltpu.VMEM((bq, common.LANES), jnp.float32))  # running M over head chunks
    if sel is not None:
        scratch.append(pltpu.VMEM((bq, bk), jnp.float32))  # exact slot weights of a tile with duplicates
        if sel.fold:
            scratch.append(pltpu.VMEM((sel.width_p // sel.fold, sel.fold * bq), jnp.int32))
    kernel = functools.partial(teacher_phases.kernel, mode=mode, walk=walk, nh=nh, layout=layout, group=group,
                               scale=scale, normalize=normalize, straight_pass2=straight_pass2, kl=kl,
                               seq_len=seq_len, sel=sel)
    order = "tok" if layout.token_major else "head"

    def grid_spec(firsts, counts, *rest):  # listed: the step extent is read from the counts (a dynamic grid)
        return pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2 if sel is None else 3,
                                            grid=(b * walk.rows, nh, walk.grid_steps(counts)),
                                            in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch)
    return runtime.pallas_call(
        kernel,
        grid_spec=grid_spec if schedule.listed else grid_spec(firsts, counts),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=cfg.vmem_limit_bytes),
        # Outputs: P, and with normalize=False the rows' maxima [B, nq, 8, bq] too (fused KL: counted by `kl`).
        cost_estimate=cost_estimate(q, kv, schedule, batch=b, head_chunk=hc, matmuls=1 if cached else 2,
                                    lse_inputs=0 if mode == "per_head" else 1, kl=kl, logits=logits,
                                    output_bytes=0 if kl is not None else
                                    b * s_p * (width_p + (0 if normalize else common.SUBLANES)) * 4,
                                    extra_bytes=0 if sel is None else 2 * (idx.size + vbits.size) * 4
                                    + bits.size * 4,
                                    metadata=not schedule.causal and sel is None,
                                    key_row=not schedule.causal and sel is None and (kl is not None or normalize)),
        interpret=interpret,
        name=f"csa_{'sparse_' if sel else ''}teacher_{mode}_bq{bq}_bk{bk}_hc{hc}_{order}_{kind}"
             f"{'_cached' if cached else ''}{'_listed' if schedule.listed else ''}{'_kl' if kl else ''}"
             f"{'_blocks' if block_order else ''}",
    )(firsts, counts, *([] if sel is None else [tables]), *operands)


def cost_estimate(q, kv, schedule: schedule_lib.TileSchedule, *, batch: int, head_chunk: int, matmuls: int,
                  lse_inputs: int, kl, logits, output_bytes: int, extra_bytes: int = 0, metadata: bool = False,
                  key_row: bool = False) -> pl.CostEstimate:
    """HBM bytes and flops of a teacher launch: q once per query tile, each visited kv tile once per (head chunk,
    walked pass), the statistics inputs, logits in and G out (fused KL) or P out, plus extra_bytes (e.g. top-k
    indices). metadata: the masks read the ids (int32 qmeta [B, S_p, 128] once per (query tile, head chunk), an
    upper bound, and an int32 [8, block_k] kmeta block with each visited kv tile); key_row: the epilogue also
    reads a batch element's whole kmeta row [8, N_p]. Causal schedules are exact; table schedules count every
    tile (an upper bound)."""
    _, s_p, h, d = q.shape
    nh = h // head_chunk
    tiles = schedule.visited_tiles(batch)
    rows = schedule.block_q * h  # all chunks of a query tile
    flops = 2 * rows * schedule.block_k * d * tiles * matmuls
    kv_bytes = tiles * nh * matmuls * schedule.block_k * d * kv.dtype.itemsize
    meta_bytes = 0
    if metadata:
        meta_bytes = common.ids_metadata_bytes(nh * batch * s_p, nh * tiles * matmuls, schedule.block_k)
    if key_row:
        meta_bytes += 4 * batch * common.SUBLANES * schedule.nk * schedule.block_k
    stats_bytes = lse_inputs * batch * s_p * (h + common.SUBLANES) * 4  # the rebased LSE input and its row shift
    kl_bytes = 0
    if kl is not None:
        kl_bytes = logits.size * logits.dtype.itemsize * (2 if kl.emit_gradient else 1) + batch * s_p * 8 * 4
    return pl.CostEstimate(flops=flops, transcendentals=rows * schedule.block_k * tiles * 2,
                           bytes_accessed=q.size * q.dtype.itemsize + kv_bytes + meta_bytes + stats_bytes
                           + kl_bytes + output_bytes + extra_bytes)
