"""Shared by the AOT tests: libtpu is required (a missing libtpu fails them, it does not skip them); the sparse
loss program and its input structs (test_aot_sparse.py, test_aot_chips.py); the program's large constants."""

import math
import os
import re

import jax
import jax.numpy as jnp
import pytest

from csa_pallas import aot, ops_sparse, validation


def require_libtpu():
    if not aot.libtpu_available():
        if os.environ.get("CSA_PALLAS_ALLOW_NO_LIBTPU") == "1":
            pytest.skip("libtpu not installed and CSA_PALLAS_ALLOW_NO_LIBTPU=1")
        pytest.fail("libtpu is required for the v5p AOT tests: pip install 'jax[tpu]==0.10.2'")


def large_constants(hlo_text: str, min_bytes: int = 1 << 20) -> list:
    """The compiled program's constants of at least `min_bytes` ("s32[1,32768,128]", ...): literals of the
    executable, in HBM beside the program and outside `memory_analysis()`'s temp (what XLA folds from arrays built
    of static values, e.g. metadata of default ids). An element's bytes come from its HLO type's bit width (s32,
    bf16, f8e4m3fn, ...; pred is a byte)."""
    found = []
    for dtype, dims in re.findall(r"= (\w+)\[([0-9,]+)\]\S* constant\(", hlo_text):
        bits = re.search(r"\d+", dtype)
        size = math.prod(int(d) for d in dims.split(",")) * (int(bits.group()) // 8 if bits else 1)
        if size >= min_bytes:
            found.append(f"{dtype}[{dims}]")
    return found


def sparse_program(target, head_chunk=None, *, window=128, ratio=4, cfg=None, expect_path=None):
    """The sparse loss + gradient on `sparse_input_structs`' arrays (plus int32 [B, S] segment ids and positions
    when the structs end with them: packed documents)."""
    def program(logits, q, compressed_kv, topk, window_kv, sinks, segment_ids=None, positions=None):
        def loss(x):
            kwargs = dict(window_kv=window_kv, sinks=sinks) if target == "joint" else {}
            if segment_ids is not None:
                kwargs.update(segment_ids=segment_ids, positions=positions)
            problem = validation.validate(q, compressed_kv, topk_indices=topk, target=target, window_size=window,
                                          compress_ratio=ratio, head_chunk=head_chunk, implementation="pallas",
                                          **kwargs)
            if expect_path is not None:
                assert ops_sparse.sparse_layout(problem, cfg).path == expect_path
            return ops_sparse.indexer_distill_loss(x, problem, cfg=cfg)
        return jax.value_and_grad(loss)(logits)
    return program


def sparse_input_structs(seq, *, width=512, batch=1, heads=64, head_dim=512, ratio=4, dtype=jnp.bfloat16,
                         packed=False):
    n = seq // ratio
    ids = (aot.struct((batch, seq), jnp.int32),) * 2 if packed else ()
    return (aot.struct((batch, seq, width), jnp.float32), aot.struct((batch, seq, heads, head_dim), dtype),
            aot.struct((batch, n, head_dim), dtype), aot.struct((batch, seq, width), jnp.int32),
            aot.struct((batch, seq, head_dim), dtype), aot.struct((heads,), jnp.float32)) + ids
