"""Which compressed blocks, top-k slots and window keys a query may see (SPEC §2).

Everything here is plain JAX on small integer arrays ([B, S], [B, N], [B, S, K]); it is shared by the reference
and by the wrappers that prepare kernel inputs, so both see exactly the same masks.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

# End position given to invalid blocks: no query position (an int32) is >= it, so an invalid block is never visible
# and no separate validity flag has to travel with the block keys.
INVALID_BLOCK_END = jnp.iinfo(jnp.int32).max


def block_keys(kv_segment_ids: jnp.ndarray, kv_positions: jnp.ndarray, compress_ratio: int, num_blocks: int):
    """Per-block (segment, end position) keys.

    Args:
      kv_segment_ids, kv_positions: int32 [B, S_kv], the key-side tokens.
      compress_ratio: m, tokens per block.
      num_blocks: N (== S_kv // m).

    Returns:
      (block_segment, block_end), both int32 [B, N]. Block s covers key tokens [s*m, (s+1)*m); it is valid when
      all m tokens share one segment, and then its end is the position of its last token. Invalid blocks (a block
      straddling two documents) get end INVALID_BLOCK_END.
    """
    m = compress_ratio
    # Strided slices, not a [B, N, m] reshape: on a TPU that array pads its m lanes to 128 (a 32x temp for m = 4).
    token = lambda x, i: x[:, i: num_blocks * m: m]  # [B, N]: token i of every block
    block_segment = token(kv_segment_ids, 0).astype(jnp.int32)
    valid = functools.reduce(jnp.logical_and, [token(kv_segment_ids, i) == block_segment for i in range(1, m)],
                             jnp.ones(block_segment.shape, bool))
    block_end = jnp.where(valid, token(kv_positions, m - 1), INVALID_BLOCK_END).astype(jnp.int32)
    return block_segment, block_end


def block_visible(segment_ids, positions, block_segment, block_end):
    """Dense visibility V(t): bool [B, S, N]; query t sees block s iff same segment and e(s) <= positions[t]."""
    return (block_segment[:, None, :] == segment_ids[:, :, None]) & (block_end[:, None, :] <= positions[:, :, None])


def slot_blocks(topk_indices, num_blocks: int):
    """Clamp top-k indices into [0, N) so a gather never reads out of bounds; returns (safe_index, in_range)."""
    in_range = (topk_indices >= 0) & (topk_indices < num_blocks)
    return jnp.where(in_range, topk_indices, 0).astype(jnp.int32), in_range


def slot_visible(topk_indices, segment_ids, positions, block_segment, block_end):
    """Sparse V(t): bool [B, S, K]; slot k is valid iff its index is in [0, N) and that block is visible to t."""
    num_blocks = block_segment.shape[1]
    safe, in_range = slot_blocks(topk_indices, num_blocks)
    take = lambda keys: jnp.take_along_axis(keys[:, None, :], safe, axis=2)  # [B,1,N] x [B,S,K] -> [B,S,K]
    seg = take(block_segment)
    end = take(block_end)
    return in_range & (seg == segment_ids[:, :, None]) & (end <= positions[:, :, None])


def window_visible(segment_ids, positions, kv_segment_ids, kv_positions, window_size: int):
    """Win(t) as bool [B, S, S_kv]: same segment and 0 <= positions[t] - kv_positions[j] < W."""
    delta = positions[:, :, None] - kv_positions[:, None, :]
    same = segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    return same & (delta >= 0) & (delta < window_size)


def window_layout_ok(segment_ids, positions, xp=jnp):
    """bool scalar: every segment occupies one contiguous run of the sequence and positions strictly increase inside
    it (MaxText packing). Then a window key of query t lies in the index range [t - W + 1, t], the band the
    window-LSE kernel visits (its contract). segment_ids, positions: int [B, S]; xp: jnp (traceable, e.g. under
    checkify) or numpy (concrete ids, at trace time)."""
    same = segment_ids[:, 1:] == segment_ids[:, :-1]
    increasing = xp.all(xp.where(same, positions[:, 1:] > positions[:, :-1], True))
    # A segment id that starts a second run: sort the ids of the run starts and look for equal neighbours.
    b = segment_ids.shape[0]
    low = np.iinfo(np.int32).min
    starts = xp.concatenate([xp.ones((b, 1), bool), ~same], axis=1)
    ordered = xp.sort(xp.where(starts, segment_ids, low), axis=1)
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] != low)
    return increasing & ~xp.any(repeated)
