"""Sparse mode's two paths and their shared selection (interpret mode on CPU, against the reference).

* the selection build (`kernels.selection`): block bits and per-tile tables against a NumPy count;
* the dispatch rule between the visit path (the teacher kernel reading the selection) and the K-proportional
  gather path, and forcing either through config "path";
* both paths on the selection patterns of the sparse issue (uniform, local-heavy, banded) and adversarial ones
  (every query the same block, distinct far blocks), with kv tiles the visit path skips;
* duplicates on some query tiles only (the exact-count branch next to the bits), the unnormalised head sums the
  heads-sharded loss combines, the gather kernel's own packing of the keys (non-finite blocks make their readers
  NaN), and a race / out-of-bounds checking interpreter run of the gather kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import csa_pallas
from csa_pallas import ops_sparse, reference, validation
from csa_pallas.kernels import runtime, selection

from kernel_cases import make_case

FAST = {"xla_backend_optimization_level": 0}


@pytest.mark.parametrize("num_blocks, width", [(100, 40), (1024, 300), (6000, 256)])
def test_block_bits_and_tile_tables_match_a_direct_count(num_blocks, width):
    rng = np.random.default_rng(num_blocks)
    s_p, block_q, block_k = 256, 64, 256 if num_blocks > 128 else 128
    n_p = -(-num_blocks // block_k) * block_k
    k_p = -(-width // 128) * 128
    idx = rng.integers(0, num_blocks, (2, s_p, k_p)).astype(np.int32)
    idx[rng.random(idx.shape) < 0.3] = -1
    idx[:, :, width:] = -1
    idx[0, 5, :10] = 7  # a duplicated index
    idx[1, 70:80, :] = -1  # rows without a slot
    idx[1, 128:192, :] = rng.integers(0, min(num_blocks, block_k), (64, k_p))  # one kv tile only
    raw = np.where(rng.random(idx.shape) < 0.5, idx, rng.integers(-5, 2 * num_blocks, idx.shape)).astype(np.int32)
    valid = (raw == idx) & (idx >= 0)  # the slots whose raw index is kept: the rest are empty whatever they hold
    limit = rng.integers(0, num_blocks + 1, (2, 1, s_p)).astype(np.int32)
    # Slot bits, from a validity array and from per-row limits.
    vbits = np.asarray(selection.slot_bits_pallas(jnp.asarray(raw), valid=jnp.asarray(valid.astype(np.int8)),
                                                  interpret=True)).view(np.uint32)
    lbits = np.asarray(selection.slot_bits_pallas(jnp.asarray(raw), limit=jnp.asarray(limit),
                                                  interpret=True)).view(np.uint32)

    def pack(v):
        words = np.zeros(v.shape[:2] + (v.shape[2] // 32,), np.uint32)
        for b, t, k in zip(*np.nonzero(v)):
            words[b, t, k >> 5] |= np.uint32(1) << np.uint32(k & 31)
        return words

    np.testing.assert_array_equal(vbits, pack(valid))
    np.testing.assert_array_equal(lbits, pack((raw >= 0) & (raw < limit[:, 0, :, None])))
    # Block bits of the valid slots.
    bits = np.asarray(selection.block_bits_pallas(jnp.asarray(raw), jnp.asarray(vbits.view(np.int32)), n_p,
                                                  interpret=True)).view(np.uint32)
    want = np.zeros((2, s_p, bits.shape[2]), np.uint32)
    for b, t, k in zip(*np.nonzero(valid)):
        s = idx[b, t, k]
        want[b, t, s >> 5] |= np.uint32(1) << np.uint32(s & 31)
    np.testing.assert_array_equal(bits, want)
    idx = np.where(valid, idx, -1)
    nk = n_p // block_k
    table, active = selection.tile_tables(jnp.asarray(bits.view(np.int32)), jnp.asarray(vbits.view(np.int32)),
                                          block_q=block_q, block_k=block_k, num_kv_tiles=nk)
    table = np.asarray(table).reshape(2, s_p // block_q, -1)
    sel = idx.reshape(2, s_p // block_q, block_q * k_p)
    for b in range(2):
        for qi in range(s_p // block_q):
            tiles = set((sel[b, qi][sel[b, qi] >= 0] // block_k).tolist())
            flags = [bool((table[b, qi, 1 + kt // 32] >> (kt % 32)) & 1) for kt in range(nk)]
            assert flags == [kt in tiles for kt in range(nk)] == list(np.asarray(active)[b, qi])
            rows = idx[b, qi * block_q:(qi + 1) * block_q]
            dup = any(len(set(r[r >= 0].tolist())) < int((r >= 0).sum()) for r in rows)
            assert table[b, qi, 0] == int(dup)


def problem_for(seq, width, num_blocks_ratio=1, heads=2, head_dim=32):
    a = make_case(0, seq=seq, ratio=num_blocks_ratio, heads=heads, head_dim=head_dim)
    idx = jnp.zeros((1, seq, width), jnp.int32)
    return validation.validate(a["q"], a["compressed_kv"], topk_indices=idx, compress_ratio=num_blocks_ratio,
                               window_kv=a["window_kv"])


def _abstract_layout(seq, heads, width, head_dim=512):
    s = jax.ShapeDtypeStruct
    return ops_sparse.abstract_layout(s((1, seq, heads, head_dim), jnp.bfloat16),
                                      s((1, seq // 4, head_dim), jnp.bfloat16), s((1, seq, width), jnp.int32),
                                      kl_logits_dtype=jnp.float32)


@pytest.mark.parametrize("seq, heads, width, path", [
    (4096, 64, 512, "visit"), (16384, 64, 512, "visit"), (32768, 64, 512, "gather"), (131072, 64, 512, "gather"),
    (16384, 128, 1024, "visit"), (32768, 128, 1024, "gather"), (131072, 128, 1024, "gather"),
    (32768, 8, 512, "visit"),  # 8 local heads (a head-sharded Flash layer): visiting is 8x cheaper
    (131072, 16, 512, "gather"),
])
def test_dispatch_at_deepseek_v4_shapes(seq, heads, width, path):
    assert _abstract_layout(seq, heads, width).path == path


def test_dispatch_rule_and_forced_paths():
    # gather once N H >= 600 K (the uniform-selection crossover of the static estimates), visit below.
    assert ops_sparse.GATHER_HEAD_BLOCKS_PER_SLOT == 600
    assert ops_sparse.sparse_layout(problem_for(256, 16, heads=64)).path == "gather"  # 256 * 64 >= 600 * 16
    assert ops_sparse.sparse_layout(problem_for(256, 16, heads=32)).path == "visit"  # 256 * 32 < 600 * 16
    assert ops_sparse.sparse_layout(problem_for(256, 64, heads=64)).path == "visit"  # 256 * 64 < 600 * 64
    assert ops_sparse.sparse_layout(problem_for(256, 64), {"path": "gather"}).path == "gather"
    assert ops_sparse.sparse_layout(problem_for(256, 16), {"path": "visit", "block_q": 32}).cfg.block_q == 32
    layout = ops_sparse.sparse_layout(problem_for(256, 16), {"path": "gather", "block_q": 16})
    assert layout.path == "gather" and layout.cfg.block_q == 16
    with pytest.raises(ValueError, match="'path' expected one of"):
        ops_sparse.sparse_layout(problem_for(256, 16), {"path": "scatter"})
    with pytest.raises(ValueError, match="unknown field 'walk' for path 'gather'"):
        ops_sparse.sparse_layout(problem_for(256, 16), {"path": "gather", "walk": "plain"})
    # The gather path's resident rows must fit in VMEM: 2M blocks of D = 512 bf16 (2 GiB) do not.
    def big_layout(cfg=None):
        s = jax.ShapeDtypeStruct
        return ops_sparse.abstract_layout(s((1, 8, 2, 512), jnp.bfloat16), s((1, 1 << 21, 512), jnp.bfloat16),
                                          s((1, 8, 64), jnp.int32), cfg, kv_segment_ids=s((1, 1 << 23), jnp.int32),
                                          kv_positions=s((1, 1 << 23), jnp.int32))

    assert big_layout().path == "visit"
    with pytest.raises(ValueError, match="path 'gather' needs the compressed KV"):
        big_layout({"path": "gather"})


def test_tile_lists_must_fit_in_smem():
    """The lists are B x nq x nk scalar-prefetched words: S = 32K at 256-block tiles (64K words) is the largest
    compiled for v5p (benchmarks); 64K queries at those tiles (256K words) is a ValueError naming tile_list."""
    s = jax.ShapeDtypeStruct

    def layout(seq, cfg):
        return ops_sparse.abstract_layout(s((1, seq, 64, 512), jnp.bfloat16), s((1, seq // 4, 512), jnp.bfloat16),
                                          s((1, seq, 512), jnp.int32), cfg, kl_logits_dtype=jnp.float32)

    cfg = {"path": "visit", "tile_list": True, "block_q": 16, "block_k": 256}
    assert ops_sparse.MAX_LIST_WORDS == 64 * 1024 == layout(32768, cfg).schedule.nq * 32
    assert layout(32768, cfg).schedule.listed
    with pytest.raises(ValueError, match="^tile_list: the lists take B \\* nq \\* nk = 262144 words"):
        layout(65536, cfg)


def config_for(path: str) -> dict:
    """Small visit tiles (several kv tiles to skip; "visit_list": the visit path walking lists of the selected
    tiles, `TeacherConfig.tile_list`); the gather path's slot loop (a small interpreted program: the unrolled
    default is tested in test_variants and compiled for v5p)."""
    if path == "gather":
        return {"path": path, "unroll_slots": False}
    return {"path": "visit", "block_q": 16, "block_k": 128, **({"tile_list": True} if path == "visit_list" else {})}


def pattern_indices(pattern: str, seq: int, width: int, rng):
    """[1, S, K] top-k indices (m = 1: block t is complete at t): the patterns of the sparse issue."""
    t = np.arange(seq)[:, None]
    visible = t + 1  # blocks 0..t
    if pattern == "uniform":
        idx = (rng.random((seq, width)) * visible).astype(np.int64)
    elif pattern == "local_heavy":  # the K/2 most recent visible blocks + K/2 uniform
        recent = t - np.arange(width // 2)[None, :]
        far = (rng.random((seq, width - width // 2)) * visible).astype(np.int64)
        idx = np.concatenate([recent, far], axis=1)
    elif pattern == "banded":  # all K within the 2K most recent visible blocks
        idx = t - (rng.random((seq, width)) * np.minimum(2 * width, visible)).astype(np.int64)
    elif pattern == "same_block":  # every query picks block 0 in every slot
        idx = np.zeros((seq, width), np.int64)
    elif pattern == "distinct_far":  # distinct blocks, the oldest first
        idx = np.broadcast_to(np.arange(width)[None, :], (seq, width)).copy()
    idx = np.where(idx < 0, -1, idx)
    idx[np.where(idx > t, True, False)] = -1
    return jnp.asarray(idx[None].astype(np.int32))


@functools.lru_cache(maxsize=None)
def pattern_program(path, target):
    def run(a, idx):
        kw = dict(topk_indices=idx, compress_ratio=1, window_size=16, target=target, implementation="pallas",
                  config=config_for(path))
        if target == "joint":
            kw.update(window_kv=a["window_kv"], sinks=a["sinks"])
        loss = lambda x: csa_pallas.indexer_distill_loss(x, a["q"], a["compressed_kv"], **kw)
        value, grad = jax.value_and_grad(loss)(a["logits"])
        return value, grad, csa_pallas.teacher_distribution(a["q"], a["compressed_kv"], **kw)
    return jax.jit(run, compiler_options=FAST)


@pytest.mark.parametrize("pattern", ["uniform", "local_heavy", "banded", "same_block", "distinct_far"])
@pytest.mark.parametrize("path", ["visit", "visit_list", "gather"])
def test_selection_patterns_on_both_paths(pattern, path):
    seq, width = (128 if path == "gather" else 512), 24  # visit: 4 kv tiles of 128 (banded skips some)
    rng = np.random.default_rng(len(pattern))
    a = make_case(3, seq=seq, ratio=1, heads=2, head_dim=32)
    idx = pattern_indices(pattern, seq, width, rng)
    a["logits"] = jnp.asarray(rng.standard_normal((1, seq, width)) * 2.0, jnp.float32)
    target = "joint" if pattern in ("uniform", "banded") else "per_head"
    value, grad, p = pattern_program(path, target)({k: a[k] for k in ("q", "compressed_kv", "window_kv", "sinks",
                                                                      "logits")}, idx)
    kw = dict(topk_indices=idx, compress_ratio=1, window_size=16, target=target)
    if target == "joint":
        kw.update(window_kv=a["window_kv"], sinks=a["sinks"])
    problem = validation.validate(a["q"], a["compressed_kv"], **kw)
    want_p = reference.teacher(problem)[0]
    want_value, want_grad = jax.value_and_grad(lambda x: reference.indexer_distill_loss(x, problem))(a["logits"])
    np.testing.assert_allclose(np.asarray(p), np.asarray(want_p), atol=1e-6)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    scale = float(np.max(np.abs(want_grad)))
    np.testing.assert_allclose(np.asarray(grad) / scale, np.asarray(want_grad) / scale, atol=1e-5)
    if path != "gather" and pattern == "banded":  # the pattern leaves kv tiles no query of a tile selected
        layout = ops_sparse.sparse_layout(problem, config_for(path))
        sel = ops_sparse.selection_inputs(problem, layout)
        _, active = selection.tile_tables(sel.bits, sel.vbits, block_q=16, block_k=128,
                                          num_kv_tiles=layout.schedule.nk)
        causal = np.array([[kt <= (qi * 16 + 15) // 128 for kt in range(4)] for qi in range(seq // 16)])
        assert np.asarray(active)[0].sum() < causal.sum()
        if path == "visit_list":  # the grid walks the longest list (2 tiles: the band spans 48 blocks), not 4
            assert layout.schedule.listed and int(np.asarray(sel.counts)[-1]) == 2


def test_duplicates_on_some_query_tiles_only():
    """Tiles holding a duplicated index take the exact slot counts, their neighbours the bits; both exact."""
    seq, width = 128, 20
    a = make_case(4, seq=seq, ratio=1, heads=2, head_dim=32)
    rng = np.random.default_rng(4)
    idx = np.full((1, seq, width), -1, np.int32)
    for t in range(seq):  # distinct picks among the visible blocks 0..t
        picks = rng.permutation(t + 1)[:width]
        idx[0, t, :picks.size] = picks
    idx[0, 40:44, 5] = idx[0, 40:44, 6]  # query tile 2 (of 16 rows) only
    idx[0, 100, :] = 3  # query tile 6: one block in every slot
    kw = dict(topk_indices=jnp.asarray(idx), compress_ratio=1, window_size=16, window_kv=a["window_kv"],
              sinks=a["sinks"])
    problem = validation.validate(a["q"], a["compressed_kv"], **kw)
    layout = ops_sparse.sparse_layout(problem, {"path": "visit", "block_q": 16, "block_k": 128})
    sel = ops_sparse.selection_inputs(problem, layout)
    dup_flags = np.asarray(sel.tables).reshape(seq // 16, -1)[:, 0]
    assert dup_flags.tolist() == [int(i in (2, 6)) for i in range(seq // 16)]
    logits = jnp.asarray(rng.standard_normal((1, seq, width)), jnp.float32)
    for path in ("visit", "gather"):
        config = config_for(path)
        got = csa_pallas.teacher_distribution(a["q"], a["compressed_kv"], implementation="pallas", config=config,
                                              **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(reference.teacher(problem)[0]), atol=1e-6)
        value = csa_pallas.indexer_distill_loss(logits, a["q"], a["compressed_kv"], implementation="pallas",
                                                config=config, **kw)
        np.testing.assert_allclose(float(value), float(reference.indexer_distill_loss(logits, problem)), rtol=1e-5)


def test_unnormalised_head_sums_agree_across_paths():
    """normalize=False (heads sharded over devices): the head sum and the rows' M of both paths give the same P."""
    a = make_case(5, seq=64, ratio=1, heads=4, head_dim=32)
    idx = pattern_indices("local_heavy", 64, 16, np.random.default_rng(5))
    problem = validation.validate(a["q"], a["compressed_kv"], topk_indices=idx, compress_ratio=1, window_size=16,
                                  window_kv=a["window_kv"], sinks=a["sinks"] * 30.0)
    out = {}
    for path in ("visit", "gather"):
        layout = ops_sparse.sparse_layout(problem, config_for(path))
        head_sum, rowmax = ops_sparse.teacher_padded(problem, layout, normalize=False)
        out[path] = (np.asarray(ops_sparse.normalize_slots(head_sum))[:, :64, :16], np.asarray(rowmax)[:, :64])
        assert np.all(np.isfinite(out[path][0])) and not np.any(np.isnan(out[path][1])), path
    np.testing.assert_allclose(out["visit"][0], out["gather"][0], atol=1e-6)
    np.testing.assert_allclose(out["visit"][1], out["gather"][1], rtol=1e-6)
    want = np.asarray(reference.teacher(problem)[0])
    np.testing.assert_allclose(np.maximum(out["gather"][0], 0.0), want, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gather_path_packs_the_keys_itself_and_non_finite_blocks_make_their_readers_nan(dtype):
    """The gather kernel packs its resident rows from compressed_kv as given (`sparse_gather._pack_resident`: 48
    padded blocks in three double-buffered DMA chunks of 16 rows; f32 rows as their bits, bf16 two features per
    word; +-inf made NaN), and a block holding a NaN, +inf or -inf makes exactly the rows that read it NaN
    (SPEC §3; the -inf is where an unfilled value would drop its slot silently), as the reference's P."""
    a = make_case(8, seq=40, ratio=1, heads=2, head_dim=32, dtype=dtype)
    kv = np.array(a["compressed_kv"].astype(jnp.float32))
    kv[0, 3, 5], kv[0, 17, 0], kv[0, 30, 31] = np.nan, np.inf, -np.inf
    kv = jnp.asarray(kv, dtype)
    idx = pattern_indices("uniform", 40, 12, np.random.default_rng(8))
    kw = dict(topk_indices=idx, compress_ratio=1, window_size=8, window_kv=a["window_kv"], sinks=a["sinks"])
    problem = validation.validate(a["q"], kv, **kw)
    assert ops_sparse.sparse_layout(problem, config_for("gather")).padded_blocks == 48
    got = np.asarray(csa_pallas.teacher_distribution(a["q"], kv, implementation="pallas",
                                                     config=config_for("gather"), **kw))
    want = np.asarray(reference.teacher(problem)[0])
    rows_nan = np.isnan(want).any(axis=-1)
    assert 0 < rows_nan.sum() < rows_nan.size  # some rows read a bad block, some do not
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), atol=1e-6)


def test_gather_path_under_the_race_and_out_of_bounds_checking_interpreter():
    a = make_case(6, seq=16, ratio=1, heads=2, head_dim=32)  # 2 grid steps: the interpreter runs ~1K row loads each
    idx = pattern_indices("uniform", 16, 12, np.random.default_rng(6))
    kw = dict(topk_indices=idx, compress_ratio=1, window_size=8, window_kv=a["window_kv"], sinks=a["sinks"])
    problem = validation.validate(a["q"], a["compressed_kv"], **kw)
    params = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise", num_cores_or_threads=2)
    with runtime.interpret_override(params):
        got = csa_pallas.teacher_distribution(a["q"], a["compressed_kv"], implementation="pallas",
                                              config=config_for("gather"), **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference.teacher(problem)[0]), atol=1e-6)


def test_gather_path_reads_a_query_chunk_in_place_under_the_race_and_out_of_bounds_checking_interpreter():
    """`Problem.q_window` (the fused op's query chunks): the gather kernel reads the chunk's q rows from the whole
    q through a scalar-prefetched tile offset (`sparse_gather.RowWindow`), with the same P as from a copy of the
    rows; a chunk off the query tile, or q not in the compute dtype, keeps the copy."""
    from csa_pallas import fused_student
    a = make_case(7, seq=32, ratio=1, heads=2, head_dim=32)
    idx = pattern_indices("uniform", 32, 12, np.random.default_rng(7))
    problem = validation.validate(a["q"], a["compressed_kv"], topk_indices=idx, compress_ratio=1, window_size=8,
                                  target="per_head")

    def chunk(start, rows):
        part = {name: getattr(problem, name)[:, start:start + rows]
                for name in ("q", "segment_ids", "positions", "topk_indices")}
        return fused_student._chunk_problem(problem, part)

    shard = chunk(16, 16)
    layout = ops_sparse.sparse_layout(shard, config_for("gather"))
    windowed = dataclasses.replace(shard, q_window=(problem.q, jnp.int32(16)))
    assert ops_sparse.in_place_rows(windowed, layout)
    params = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise", num_cores_or_threads=2)
    with runtime.interpret_override(params):
        got = ops_sparse.teacher_padded(windowed, layout)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ops_sparse.teacher_padded(shard, layout)))
    odd = chunk(8, 4)  # 4 rows: padded to the 8-row query tile
    assert not ops_sparse.in_place_rows(dataclasses.replace(odd, q_window=(problem.q, jnp.int32(8))),
                                        ops_sparse.sparse_layout(odd, config_for("gather")))
    other_dtype = (problem.q.astype(jnp.bfloat16), jnp.int32(16))  # the kernels' compute dtype is f32 here
    assert not ops_sparse.in_place_rows(dataclasses.replace(shard, q_window=other_dtype), layout)


def test_packed_documents_slot_validity_in_row_chunks(monkeypatch):
    """Packed documents: the slot validity gathers each slot's block keys in XLA in chunks of rows
    (`ops_sparse.packed_validity_chunk`: 8 MiB per gathered [B, chunk, K_p] int32 array, 4,096 rows at K = 512;
    over the whole sequence the gathers were 512 MiB of temp at S = 128K). Forced down to 128-row chunks (4 of
    the 512 rows), the slot bits are the whole-sequence validity packed (loss_mask and cross-document,
    straddling, future, -1 and out-of-range slots included), and both paths give the reference's loss and
    gradient."""
    assert ops_sparse.packed_validity_chunk(1, 131072, 512, 128) == 4096
    assert ops_sparse.packed_validity_chunk(2, 384, 512, 128) == 384  # the whole (short) sequence: no loop
    assert ops_sparse.packed_validity_chunk(1, 640, 8192, 128) == 128  # 256 rows fit 8 MiB but do not divide 640
    monkeypatch.setattr(ops_sparse, "PACKED_VALIDITY_CHUNK_BYTES", 1)
    seq, width = 512, 24
    a = make_case(6, seq=seq, ratio=4, heads=2, head_dim=32, num_docs=4)
    rng = np.random.default_rng(6)
    idx = jnp.asarray(rng.integers(-2, seq // 4 + 3, (1, seq, width)), jnp.int32)
    loss_mask = jnp.asarray(rng.random((1, seq)) > 0.2)
    kw = dict(topk_indices=idx, compress_ratio=4, window_size=16, target="per_head", loss_mask=loss_mask,
              segment_ids=a["segment_ids"], positions=a["positions"])
    problem = validation.validate(a["q"], a["compressed_kv"], **kw)
    layout = ops_sparse.sparse_layout(problem, config_for("gather"))
    assert ops_sparse.packed_validity_chunk(1, layout.padded_seq, layout.padded_width, 128) == 128
    bits = np.asarray(ops_sparse.padded_slot_bits(problem, layout)).view(np.uint32)
    valid = np.asarray(ops_sparse.slot_validity(problem))
    assert 0 < valid.sum() < valid.size
    want = np.zeros(bits.shape, np.uint32)
    for b, t, k in zip(*np.nonzero(valid)):
        want[b, t, k >> 5] |= np.uint32(1) << np.uint32(k & 31)
    np.testing.assert_array_equal(bits, want)
    logits = jnp.asarray(rng.standard_normal((1, seq, width)) * 2.0, jnp.float32)
    want_value, want_grad = jax.value_and_grad(lambda x: reference.indexer_distill_loss(x, problem))(logits)
    for path in ("visit", "gather"):
        value, grad = jax.jit(jax.value_and_grad(lambda x: csa_pallas.indexer_distill_loss(
            x, a["q"], a["compressed_kv"], implementation="pallas", config=config_for(path), **kw)),
            compiler_options=FAST)(logits)
        np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
        scale = float(np.max(np.abs(want_grad)))
        np.testing.assert_allclose(np.asarray(grad) / scale, np.asarray(want_grad) / scale, atol=1e-5)
