"""The student kernels' tiles (`StudentKernelConfig`) and the heuristic that picks them (`default_config`)."""

from __future__ import annotations

import dataclasses

from csa_pallas.kernels import common

# Blocks per part of a kv tile that trim_kv_tile distinguishes: one lane width of the scores tile.
PART_BLOCKS = 128


@dataclasses.dataclass(frozen=True)
class StudentKernelConfig:
    """Tiles of the student kernels. block_q: query rows per tile (multiple of 16); block_k: compressed blocks per
    kv tile (multiple of 128); trim_kv_tile: a computing tile's products cover only its visible prefix of
    128-block parts (one kernel body per prefix length; False: every computing tile is computed whole);
    vmem_limit_bytes: Mosaic's scoped-VMEM limit for both kernels."""

    block_q: int = 128
    block_k: int = 256
    trim_kv_tile: bool = True
    vmem_limit_bytes: int = 48 * common.MiB

    @property
    def parts(self) -> int:
        """Parts of a kv tile the schedule distinguishes (1: the tile is computed whole or skipped)."""
        return self.block_k // PART_BLOCKS if self.trim_kv_tile else 1

    def __post_init__(self):
        if self.block_q < 16 or self.block_q % 16:
            raise ValueError(f"block_q: expected a positive multiple of 16, got {self.block_q}")
        if self.block_k < 128 or self.block_k % 128:
            raise ValueError(f"block_k: expected a positive multiple of 128, got {self.block_k}")
        if self.vmem_limit_bytes < common.MiB:
            raise ValueError(f"vmem_limit_bytes: expected at least 1 MiB, got {self.vmem_limit_bytes}")


def default_config(*, seq_len: int, num_blocks: int) -> StudentKernelConfig:
    """Query tiles of 128 rows (at most the query rows rounded up to 16), kv tiles of 512 blocks (at most N rounded
    up to 128), trimmed to their visible prefix. v5p at S = 4096, N = 1024, H_I = 64, d_I = 128, bf16, default ids
    (static estimates of the forward + backward kernels, us; v5p compile of both, s; index_q in row order):

        128 x 256 whole   106.3 + 556.4   3.9 s
        128 x 256 trimmed 102.6 + 519.1   5.7 s   (a trimmed step still pays its per-step work whole)
        256 x 256 trimmed  96.5 + 483.0  11.1 s
        128 x 512 trimmed  94.1 + 484.8  14.6 s   <- default: -12.6%
        256 x 512 trimmed  90.9 + 477.9  35.2 s   (-14.2%; 2.4x the compile for 1.7 points more)

    Trimmed, every shape computes the same 144 parts of 128 x 128 (the causal triangle at 128-block granularity);
    larger tiles pay fewer per-step costs (the dq accumulator update, bf16's doubled cotangent rows and folded
    partial sums), and compile longer (one body per prefix length). The backward holds dq as
    [H_p / pack, pack * block_q, d_p] f32 (4 MiB at H_I = 64, d_I = 128) plus, for bf16, its packed u32 rows
    [block_q * H_p / 2, d_p] (2 MiB) for the finalize; ~30 us of the default's backward at this shape is that
    finalize (strided stores back into the row order), against 97 us of XLA relayouts it replaced."""
    block_q = min(128, common.round_up(seq_len, 16))
    block_k = min(512, common.round_up(num_blocks, PART_BLOCKS))
    return StudentKernelConfig(block_q=block_q, block_k=block_k)
