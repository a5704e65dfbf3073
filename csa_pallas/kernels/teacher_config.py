"""The teacher kernel's configuration family: `TeacherConfig` (every variant a field), the heuristics that fill
it per chip (`default_config`), the VMEM calculator they use, and the resolvers that turn "auto" fields into the
variant a problem runs (and reject a forced variant the problem cannot run, naming the field).

Kept apart from the kernel body (`teacher.py`), tokamax-style: a config is validated data, the heuristics are
separate functions, and tests or users force any field through the public `config=`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

from csa_pallas.kernels import common, fused_kl, selection
from csa_pallas.kernels import schedule as schedule_lib

MiB = common.MiB

WALK_CHOICES = ("auto",) + schedule_lib.WALKS
ROW_ORDERS = (None, "token", "head")


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
    """Tiling and variant of the dense (and sparse) teacher kernel. Every variant choice is a field: `default_config`
    fills them from heuristics, a test or a user can force any of them (a forced variant that cannot run on the
    problem raises ValueError naming the field when the kernel is built).

    block_q: queries per tile (multiple of 16). block_k: compressed blocks per kv tile (multiple of 128, or the
    whole padded N when N <= 128). head_chunk: heads per step (divisor of H). cache_scores: keep pass-1 scores in
    VMEM (one matmul instead of two) - only when they fit. vmem_limit_bytes: Mosaic scoped-VMEM limit.
    walk: "auto", "plain", "pairs" or "merged" (`schedule.TeacherWalk`; the pair walks need the causal schedule,
    cached scores and one head chunk). straight_pass2: None (auto: causal, cached, <= STRAIGHT_PASS2_MAX_TILES kv
    tiles), True (a straight-line cached pass 2 per tile count; causal and cached only) or False (a loop).
    row_order: None (auto), "token" (the q block reshaped in place; head_chunk a multiple of the sublane tile) or
    "head" (the chunk's heads copied into head-major rows). kl_chunk: lanes per fused-KL epilogue sweep (one sweep
    when the padded width fits; None: `fused_kl.FusedKL.chunk`). Sparse mode only: slot_fold, the layout of the
    exact slot counts of a query tile with a duplicated index (`slot_counts`; None: transposed when the query tile
    folds into 128 lanes; False: the row-major loop). tile_list: the walk over a list of each query tile's selected
    kv tiles only, the grid's step axis as long as the longest list (a dynamic grid: `schedule.TileSchedule.listed`)
    instead of every causally visible kv tile with the unselected ones skipped (each still a grid step); None: off
    (a static estimator cannot follow a dynamic grid, so its gain is derived, not measured: README, "Sparse mode");
    True needs the plain walk.
    """

    block_q: int
    block_k: int
    head_chunk: int
    cache_scores: bool
    vmem_limit_bytes: int
    walk: str = "auto"
    straight_pass2: Optional[bool] = None
    row_order: Optional[str] = None
    kl_chunk: Optional[int] = None
    slot_fold: Optional[bool] = None
    tile_list: Optional[bool] = None

    def __post_init__(self):
        if self.block_q < 16 or self.block_q % 16:
            raise ValueError(f"block_q: expected a positive multiple of 16, got {self.block_q}")
        if self.block_k < 1 or (self.block_k > 128 and self.block_k % 128):
            raise ValueError(f"block_k: expected a multiple of 128 (or <= 128), got {self.block_k}")
        if self.head_chunk < 1:
            raise ValueError(f"head_chunk: expected >= 1, got {self.head_chunk}")
        if self.walk not in WALK_CHOICES:
            raise ValueError(f"walk: expected one of {WALK_CHOICES}, got {self.walk!r}")
        if self.row_order not in ROW_ORDERS:
            raise ValueError(f"row_order: expected one of {ROW_ORDERS}, got {self.row_order!r}")
        for name in ("straight_pass2", "slot_fold", "tile_list"):
            if not common.is_optional_bool(getattr(self, name)):
                raise ValueError(f"{name}: expected None, True or False, got {getattr(self, name)!r}")
        if self.kl_chunk is not None and (self.kl_chunk < 128 or self.kl_chunk % 128):
            raise ValueError(f"kl_chunk: expected None or a positive multiple of 128, got {self.kl_chunk}")


def with_overrides(cfg: TeacherConfig, overrides) -> TeacherConfig:
    """cfg with the fields of `overrides` (a Mapping of TeacherConfig field names, or None) replaced; an unknown
    field is a ValueError naming it."""
    if not overrides:
        return cfg
    fields = {f.name for f in dataclasses.fields(TeacherConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"config: unknown field {unknown[0]!r}; expected some of {sorted(fields)}")
    return dataclasses.replace(cfg, **overrides)


def resolve_row_layout(cfg: TeacherConfig, num_heads: int, dtype) -> common.RowLayout:
    """The row layout of `cfg.row_order` (auto: token-major whenever it is legal)."""
    auto = common.row_layout(num_heads, cfg.head_chunk, cfg.block_q, dtype)
    if cfg.row_order is None:
        return auto
    if cfg.row_order == "token" and not auto.token_major:
        raise ValueError(f"row_order: 'token' needs head_chunk ({cfg.head_chunk}) to be a multiple of the sublane "
                         f"tile ({common.sublane_multiple(dtype)}) or all {num_heads} heads")
    return common.RowLayout(cfg.block_q, cfg.head_chunk, cfg.row_order == "token")


def resolve_walk(cfg: TeacherConfig, schedule: schedule_lib.TileSchedule, *, cached: bool, num_chunks: int,
                 normalize: bool, sparse: bool = False) -> str:
    """The walk of `cfg.walk` (auto: merged pairs, else pairs, else plain; sparse mode: plain). The pair walks need
    the causal schedule, cached scores and one head chunk (a chunk would revisit an output block after the other
    tile of the pair), and a normalised or fused output (the unnormalised head sum's row max is written per output
    tile). Sparse mode defaults to the plain walk: the pairs' ~1% (dense mode) is not worth a kernel whose extra
    scalar state a static estimator can no longer follow (measured: the pairs' path is not resolvable there)."""
    can_pair = cached and num_chunks == 1 and normalize and schedule.pairs_fit()
    if cfg.walk == "auto":
        return ("merged" if schedule.pairs_merge() else "pairs") if can_pair and not sparse else "plain"
    if cfg.walk != "plain" and not can_pair:
        raise ValueError(f"walk: {cfg.walk!r} needs the causal schedule (default ids), cache_scores, one head chunk "
                         f"and an even number of query tiles each of whose second tiles sees a block")
    return cfg.walk


def resolve_tile_list(cfg: TeacherConfig, *, sparse: bool) -> bool:
    """Whether the walk follows per-query-tile lists of the selected kv tiles (`TeacherConfig.tile_list`)."""
    if not cfg.tile_list:
        return False
    if not sparse:
        raise ValueError("tile_list: True needs sparse mode (topk_indices): the lists are of the selected kv tiles")
    if cfg.walk not in ("auto", "plain"):
        raise ValueError(f"tile_list: True needs the plain walk, got walk={cfg.walk!r}")
    return True


def resolve_straight_pass2(cfg: TeacherConfig, schedule: schedule_lib.TileSchedule, cached: bool) -> bool:
    if cfg.straight_pass2 is None:
        return cached and schedule.causal and schedule.nk <= STRAIGHT_PASS2_MAX_TILES
    if cfg.straight_pass2 and not (cached and schedule.causal):
        raise ValueError("straight_pass2: True needs cached scores and the causal schedule (default ids)")
    return cfg.straight_pass2


@dataclasses.dataclass(frozen=True)
class ChipBudget:
    """Per-generation VMEM budget used by the config heuristics."""

    name: str
    vmem_bytes: int
    target_rows: int  # R = hc * bq rows per MXU call that the v5p estimate liked best


# Only the chip the heuristics were measured on: another generation gets its entry with its own measurements.
CHIPS = {
    "v5p": ChipBudget("v5p", vmem_bytes=64 * MiB, target_rows=4096),
}
DEFAULT_CHIP = "v5p"
# The calculator is an upper estimate (bq64 x hc64 cached: 55 MiB estimated, compiles under a 60 MiB limit).
USABLE_VMEM_FRACTION = 0.94
VMEM_HEADROOM = 4 * MiB  # left to Mosaic's internal scratch above the scoped limit
# Sparse mode (v5p, measured): bq64/bk256 at S = 4K and bq16/bk1024 at 32K (the calculator says 60.6 MiB for both:
# full-width score temporaries that diagonal tiles do not use) compile under the 60 MiB limit.
SPARSE_USABLE_VMEM_FRACTION = 0.96


def padded_blocks(num_blocks: int, block_k: int) -> int:
    return common.round_up(max(num_blocks, 1), block_k)


def vmem_bytes(cfg: TeacherConfig, *, num_heads: int, head_dim: int, num_blocks: int, dtype, mode: str,
               kl_logits_dtype=None, width: Optional[int] = None) -> int:
    """Upper estimate of the kernel's VMEM use: double-buffered blocks, scratch and f32 temporaries.
    kl_logits_dtype: the fused-KL variant (`fused_kl.FusedKL`) with logits of that dtype. width: sparse mode's K
    (the output, logits and G rows are K_p wide; plus the slot indices, the block bits and the slot gather)."""
    isz = jnp.dtype(dtype).itemsize
    bq, bk, hc = cfg.block_q, cfg.block_k, cfg.head_chunk
    g = common.head_group(num_heads, hc, dtype)
    n_p = padded_blocks(num_blocks, bk)
    w_p = n_p if width is None else common.round_up(width, common.LANES)  # the output row
    rows = hc * bq
    lanes = min(common.LANES, bk)
    blocks = 2 * (bq * common.round_up(g, 16) * head_dim * isz + bk * head_dim * isz + bq * common.LANES * 4
                  + common.SUBLANES * max(bk, 128) * 4 + bq * w_p * 4)
    if width is not None:  # two slot-index blocks and the bits; weights, transposed indices, gather temporaries
        blocks += 2 * (2 * bq * w_p * 4 + bq * selection.word_count(n_p) * 4)
    if mode != "per_head":  # (u or F) - sigma and sigma blocks
        blocks += 2 * 2 * common.round_up(hc, 8) * max(bq, 128) * 4
    # rows copy (head-major scratch, or the token-major reshape's materialised copy), per-lane max/sum, G (all
    # lanes), the seen rows and the running row max.
    scratch = rows * head_dim * isz + 2 * rows * max(lanes, 128) * 4 + rows * 128 * 4 + 2 * bq * 128 * 4
    if cfg.cache_scores:
        scratch += rows * n_p * 4
    # f32 score-sized temporaries live at once in Mosaic's allocation: scores, masked scores, exp, chunks (~5),
    # plus the identity-mask conversion of the stats block.
    temporaries = 5 * rows * max(bk, 128) * 4 + 2 * hc * bq * max(bq, 128) * 4
    if width is not None:
        scratch += bq * bk * 4 + w_p * bq * 4
        temporaries += 4 * bq * w_p * 4
    if kl_logits_dtype is not None:
        # f32 accumulator in scratch instead of the output block; logits in, G out (double-buffered), the key
        # metadata row, and ~8 f32 [bq, chunk] epilogue temporaries.
        lsz = jnp.dtype(kl_logits_dtype).itemsize
        blocks += -2 * bq * w_p * 4 + 4 * bq * w_p * lsz + 2 * common.SUBLANES * n_p * 4
        scratch += bq * w_p * 4
        temporaries = max(temporaries, 8 * bq * fused_kl.kl_chunk(w_p, fused_kl.FusedKL.chunk) * 4)
    return blocks + scratch + temporaries


def sparse_block_k(num_blocks: int) -> int:
    """Sparse mode's kv tile: a power of two >= N / 8, from 256 to 1024 blocks (128 when N <= 128). With a selection
    every tile is masked, so wider tiles cost no MXU work (diagonal tiles still stop at their last visible 128-lane
    chunk) and halve the grid steps, whose scalar overhead (~350 bundles each) is a fifth of the 32K kernel at 256
    (measured, v5p estimates, Flash shape K = 512: S = 32K 32.2 / 28.0 / 26.0 ms at 256 / 512 / 1024; S = 4K 470 /
    493 us at 256 / 512)."""
    if num_blocks <= 128:
        return 128
    return min(1024, max(256, 1 << (common.cdiv(num_blocks, 8) - 1).bit_length()))


def default_config(*, num_heads: int, head_dim: int, seq_len: int, num_blocks: int, dtype, mode: str,
                   head_chunk: Optional[int] = None, chip: str = DEFAULT_CHIP, kl_logits_dtype=None,
                   width: Optional[int] = None) -> TeacherConfig:
    """Tiles for one problem: R = hc*bq near the chip's target, kv tiles of 256, cached scores when they fit.
    width: sparse mode's K (kv tiles then a multiple of 128: the slot gather works per 128-lane chunk)."""
    budget = CHIPS[chip]
    usable = int(budget.vmem_bytes * (USABLE_VMEM_FRACTION if width is None else SPARSE_USABLE_VMEM_FRACTION))
    bq = min(64, common.round_up(max(seq_len, 1), 16))
    n16 = common.round_up(max(num_blocks, 1), 16)
    bk = (n16 if n16 <= 128 else 256) if width is None else sparse_block_k(num_blocks)
    if head_chunk is None:
        head_chunk = max(d for d in range(1, num_heads + 1)
                         if num_heads % d == 0 and d * bq <= budget.target_rows)
    # One matmul (cached scores) beats a larger query tile: try every tile with the cache first. Sparse mode also
    # narrows its (wide) kv tile before giving the cache up (S = 32K: bk 1024 cached 26.0 ms, uncached 40.7 ms).
    # (A taller query tile before a wider kv tile was tried: S = 16K bq32/bk256 7.18 ms vs bq16/bk512 7.17 ms.)
    widths = [bk] if width is None else [w for w in (bk, bk // 2, bk // 4) if w >= min(bk, 256)]
    for cache in (True, False):
        for block_k in widths:
            for block_q in (bq, bq // 2, bq // 4):
                if block_q < 16:
                    continue
                cfg = TeacherConfig(block_q, block_k, head_chunk, cache, 0)
                need = vmem_bytes(cfg, num_heads=num_heads, head_dim=head_dim, num_blocks=num_blocks, dtype=dtype,
                                  mode=mode, kl_logits_dtype=kl_logits_dtype, width=width)
                if need <= usable:
                    limit = min(max(int(need * 1.25) + 4 * MiB, 32 * MiB), budget.vmem_bytes - VMEM_HEADROOM)
                    return dataclasses.replace(cfg, vmem_limit_bytes=limit)
    return TeacherConfig(16, bk, head_chunk, False, budget.vmem_bytes - VMEM_HEADROOM)


# Causal schedules with at most this many kv tiles run the cached pass 2 as straight-line code, one variant per
# tile count and last width (code size grows with the square of the tile count; longer walks use a loop).
STRAIGHT_PASS2_MAX_TILES = 4
