"""The teacher kernel's refs by name: what `teacher.teacher_pallas` passes (scalar prefetch, inputs, outputs, scratch)
in its order, read back once per grid step for `teacher_phases.TeacherStep`.

The launch appends each ref only for the variants that need it, so the names below follow the same conditions;
a ref a variant does not have is None.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class TeacherRefs:
    """The refs of one teacher kernel variant (None where the variant has none)."""
    firsts_ref: Any = None  # scalar prefetch: the walk's tables (`schedule.TileSchedule`)
    counts_ref: Any = None
    tables_ref: Any = None  # `selection.tile_tables` (sparse visit path)
    q_ref: Any = None
    kv_ref: Any = None
    qmeta_ref: Any = None
    kmeta_ref: Any = None
    idx_ref: Any = None  # top-k indices of the output tile and of the pass-1 tile
    idxq_ref: Any = None
    vbits_ref: Any = None  # slot bits of the output tile and of the pass-1 tile
    vbitsq_ref: Any = None
    bits_ref: Any = None  # block bits of the pass-1 tile
    lse_ref: Any = None  # (u or F) - sigma and sigma, see `rebase`
    shift_ref: Any = None
    krow_ref: Any = None  # the whole row of key metadata: V(t) at the end
    out_ref: Any = None  # the head sum's accumulator: the output block, or scratch when the KL is fused
    rowmax_ref: Any = None  # the rows' M (base 2): shards of the heads combine their sums with it
    logits_ref: Any = None  # fused KL: the student's logits, KL stats and G
    stats_ref: Any = None
    grad_ref: Any = None
    m_ref: Any = None  # pass-1 running max and sum, and G replicated over lanes
    l_ref: Any = None
    f_ref: Any = None
    rows_ref: Any = None  # head-major rows of the query tile
    cache_ref: Any = None  # the cached score tiles
    seen_ref: Any = None  # [bq, 1]: rows that saw a block (metadata masks)
    top_ref: Any = None  # running M over head chunks [bq, 128]
    weight_ref: Any = None  # [bq, bk] exact slot weights (duplicates)
    idx_t_ref: Any = None  # transposed indices for them


def unpack(refs, *, mode: str, kl, sel, normalize: bool, token_major: bool, cached: bool, causal: bool,
           nh: int) -> TeacherRefs:
    """Names `refs` (the kernel's positional refs) for the variant: mode ("per_head" / "joint" / "full_lse"), kl
    (`fused_kl.FusedKL` or None), sel (the selection or None), normalize, token_major (the layout), cached (the
    score cache), causal (the schedule), nh (head chunks)."""
    refs, r = list(refs), TeacherRefs()
    r.firsts_ref, r.counts_ref = refs.pop(0), refs.pop(0)
    r.tables_ref = refs.pop(0) if sel is not None else None
    r.q_ref, r.kv_ref, r.qmeta_ref, r.kmeta_ref = refs.pop(0), refs.pop(0), refs.pop(0), refs.pop(0)
    if sel is not None:
        r.idx_ref, r.idxq_ref, r.vbits_ref, r.vbitsq_ref, r.bits_ref = [refs.pop(0) for _ in range(5)]
    if mode != "per_head":
        r.lse_ref, r.shift_ref = refs.pop(0), refs.pop(0)
    if kl is None:
        r.krow_ref = refs.pop(0) if normalize else None
        r.out_ref = refs.pop(0)  # the head sum accumulates in the resident output block
        if not normalize:
            r.rowmax_ref = refs.pop(0)
    else:
        r.logits_ref, r.krow_ref, r.stats_ref = refs.pop(0), refs.pop(0), refs.pop(0)
        r.grad_ref = refs.pop(0) if kl.emit_gradient else None
    r.m_ref, r.l_ref, r.f_ref, *extra = refs
    r.rows_ref = None if token_major else extra.pop(0)
    r.cache_ref = extra.pop(0) if cached else None
    if kl is not None:
        r.out_ref = extra.pop(0)  # f32 head-sum accumulator [bq, N_p] in scratch: outputs are KL stats, dI
    r.seen_ref = None if (causal or sel is not None) else extra.pop(0)
    r.top_ref = extra.pop(0) if (nh > 1 or r.rowmax_ref is not None) else None
    r.weight_ref = extra.pop(0) if sel is not None else None
    r.idx_t_ref = extra.pop(0) if sel is not None and sel.fold else None
    if extra:
        raise AssertionError(f"teacher kernel: {len(extra)} refs left unnamed")
    return r
