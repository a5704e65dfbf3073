"""Which (query tile, kv tile) steps of the student kernels compute, and over how many leading 128-block parts of
the kv tile: from a scalar-prefetched table (`skip_table`, any ids) or, for default ids, from the grid itself
(`Skip.causal_ratio`; the static estimator then sees the trip counts). Query tiles are zig-zagged over the grid
(`query_tile`) so that the two TensorCores, which split the leading parallel axis in halves, get equal causal work."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax.numpy as jnp
from jax.experimental import pallas as pl

from csa_pallas.kernels import common
from csa_pallas.kernels.student_config import StudentKernelConfig

# The skip table is scalar-prefetched whole; SMEM holds ~200K int32 (pallas-notes §2.3).
MAX_TABLE_ENTRIES = 1 << 17


def query_tile(p, nq: int):
    """Grid index p over (batch, query tiles) -> (b, query tile), the tiles zig-zagged so that the two
    TensorCores, which split the leading parallel axis in halves, get equal causal work."""
    return common.index_div(p, nq), common.zigzag(common.index_rem(p, nq), nq)


def visible_parts(table_ref, skip: "Skip"):
    """How many leading parts of this grid step's kv tile some query of the query tile may see (0: skip the step):
    from the table, or for one document at positions 0..S-1 from the grid (a part is needed when its first block
    ends by the tile's last query)."""
    (b, i), j = query_tile(pl.program_id(0), skip.nq), pl.program_id(1)
    if skip.causal_ratio is None:
        return table_ref[(b * skip.nq + i) * skip.nk + j]
    m, last = skip.causal_ratio, i * skip.block_q + (skip.block_q - 1)
    count = jnp.int32(0)
    for c in range(skip.parts):
        first_end = j * (skip.block_k * m) + (c * skip.part * m + m - 1)
        count = count + jnp.where(first_end <= last, 1, 0).astype(jnp.int32)
    return count


@dataclasses.dataclass(frozen=True)
class Skip:
    """The (query tile, kv tile) steps of one grid, and which of them compute."""

    nq: int
    nk: int
    block_q: int
    block_k: int
    causal_ratio: Optional[int]  # m: default ids, the schedule from the grid; None: the scalar-prefetched table
    parts: int = 1  # StudentKernelConfig.parts

    @property
    def part(self) -> int:
        return self.block_k // self.parts

    def causal_parts(self, i: int, j: int) -> int:
        """Visible parts of kv tile j for query tile i with default ids (what `visible_parts` reads off the grid)."""
        m, last = self.causal_ratio, i * self.block_q + self.block_q - 1
        return sum(1 for c in range(self.parts) if (j * self.block_k + c * self.part) * m + m - 1 <= last)

    def active_steps(self) -> int:
        """(query tile, kv tile) steps that compute, per batch row: counted for the causal schedule; every step for
        the table (data-dependent: an upper bound)."""
        if self.causal_ratio is None:
            return self.nq * self.nk
        return sum(1 for i in range(self.nq) for j in range(self.nk) if self.causal_parts(i, j))

    def active_parts(self) -> int:
        """Parts computed per batch row (the MXU work, in parts of `part` blocks): as `active_steps`."""
        if self.causal_ratio is None:
            return self.nq * self.nk * self.parts
        return sum(self.causal_parts(i, j) for i in range(self.nq) for j in range(self.nk))


def by_visible_parts(table_ref, skip: "Skip", body):
    """Runs body(cols) for this step's visible prefix: cols = visible parts x part blocks (0: a skipped step)."""
    visible = visible_parts(table_ref, skip)
    for count in range(skip.parts + 1):
        pl.when(visible == count)(functools.partial(body, count * skip.part))


def skip_table(positions, block_end, padded_rows: int, padded_blocks: int, cfg: StudentKernelConfig):
    """int32 [B * nq * nk]: per (query tile, kv tile) the number of leading parts of the kv tile (cfg.parts of them)
    up to the last one some query of the tile may see (a part's earliest block end <= the tile's latest position;
    segments are not consulted, so the table is a superset); 0: the step is skipped.
    positions int32 [B, S]; block_end int32 [B, N] (masks.block_keys)."""
    b, s = positions.shape
    n = block_end.shape[1]
    low, high = jnp.iinfo(jnp.int32).min, jnp.iinfo(jnp.int32).max
    pos = jnp.pad(positions.astype(jnp.int32), ((0, 0), (0, padded_rows - s)), constant_values=low)
    end = jnp.pad(block_end.astype(jnp.int32), ((0, 0), (0, padded_blocks - n)), constant_values=high)
    latest = jnp.max(pos.reshape(b, -1, cfg.block_q), axis=2)  # [B, nq]
    earliest = jnp.min(end.reshape(b, -1, cfg.block_k // cfg.parts), axis=2)  # [B, nk * parts]
    seen = (earliest[:, None, :] <= latest[:, :, None]).reshape(b, latest.shape[1], -1, cfg.parts)
    ordinal = jnp.arange(1, cfg.parts + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(seen, ordinal, 0), axis=3).astype(jnp.int32).reshape(-1)
