"""Each query's top-k slots (row indices, dk targets) at static SMEM addresses for the per-slot loops of the
sparse student's gather kernels (`student_gather`, `student_gather_kl`).

The scalar unit bounds those loops: per slot an SMEM load of the index, the VMEM address of its row, a load and a
store (a read-modify-write for dk). The final bundles issue at most two scalar ALU ops and one SMEM load each, and an
SMEM load addresses an immediate or base + register. Read from a pipelined SMEM block (double-buffered, so its base
is dynamic), every slot also needs a register for its offset; from a scratch row its address is an immediate. So a
DMA copies the next query's slots from the block into the other of two static scratch rows while this query runs.

Static v5p estimates (`tpu_estimate`) of a gather micro-kernel, K = 512 rows of 128 f32 lanes per query, 8 queries
per grid step: 2.15 cycles per row indexed as idx_ref[t, k] with t a loop variable (an add per slot, and spills),
1.53 through the block's row view idx_ref.at[t], 1.19 from the copied row (1.03 with the whole block at a static
address, `pl.Buffered(1)`, whose fetch would then wait at every grid step). Read-modify-writes: 3.0 / 2.4 / 2.0.
The fused sparse op at S = 32K, K = 512: 42.7 -> 39.8 ms (two-kernel route 50.4 -> 44.5). The sparse teacher
(`sparse_gather`, static query and slot offsets already, two staging stores per row) lost with it: 39.8 -> 40.3.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def scratch(width: int, arrays: int) -> list:
    """The scratch of `for_each_query`: two static SMEM rows per slot array, int32 [arrays, 2, width], and their
    DMA semaphores."""
    return [pltpu.SMEM((arrays, 2, width), jnp.int32), pltpu.SemaphoreType.DMA((arrays, 2))]


def for_each_query(slot_refs: Sequence, buf_ref, sem_ref, body: Callable):
    """body(t, *rows) for every query t of the tile, rows[i] holding slot_refs[i][t] (int32 [bq, width] SMEM
    blocks, bq even) in a static row of buf_ref (`scratch`): query t reads row t % 2 while a DMA fills the other
    row with query t + 1's slots; a loop over query pairs, one query per row (t traced)."""
    bq, arrays = slot_refs[0].shape[0], len(slot_refs)

    def copies(t, row):
        return [pltpu.make_async_copy(ref.at[t], buf_ref.at[i, row], sem_ref.at[i, row])
                for i, ref in enumerate(slot_refs)]

    def start(t, row):
        for c in copies(t, row):
            c.start()

    def finish(t, row):
        for c in copies(t, row):
            c.wait()
        body(t, *[buf_ref.at[i, row] for i in range(arrays)])

    if bq % 2:
        raise ValueError(f"block_q: expected an even number of queries per tile, got {bq}")
    start(0, 0)

    def pair(p, carry):
        t = 2 * p
        start(t + 1, 1)
        finish(t, 0)

        @pl.when(t + 2 < bq)
        def _():
            start(t + 2, 0)

        finish(t + 1, 1)
        return carry

    lax.fori_loop(0, bq // 2, pair, 0)
