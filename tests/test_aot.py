"""Ahead-of-time compile of the reference loss + its gradient for TPU v5p (no TPU needed, libtpu is).

libtpu is a test dependency (CI installs `jax[tpu]`), so a missing libtpu FAILS these tests instead of skipping them,
unless CSA_PALLAS_ALLOW_NO_LIBTPU=1 is set (then they skip).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest

import csa_pallas
from csa_pallas import aot

B, S, H, D, M, W, K = 1, 256, 4, 32, 4, 32, 16
N = S // M
TOPOLOGY = "v5p:2x2x1"


@pytest.fixture(scope="module", autouse=True)
def require_libtpu():
    if not aot.libtpu_available():
        if os.environ.get("CSA_PALLAS_ALLOW_NO_LIBTPU") == "1":
            pytest.skip("libtpu not available and CSA_PALLAS_ALLOW_NO_LIBTPU=1")
        pytest.fail("libtpu is not available, so the TPU AOT tests cannot run: install it with "
                    "pip install 'jax[tpu]==0.10.2' (or set CSA_PALLAS_ALLOW_NO_LIBTPU=1 to skip them)",
                    pytrace=False)


def _loss(logits, q, ckv, extra, *, target, reduction="mean"):
    return csa_pallas.indexer_distill_loss(logits, q, ckv, **extra, compress_ratio=M, window_size=W, target=target,
                                           reduction=reduction, implementation="xla")


CONFIGS = {  # name -> (target, sparse)
    "joint-dense": ("joint", False),
    "per_head-dense": ("per_head", False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_reference_value_and_grad_compiles_for_v5p(name):
    target, sparse = CONFIGS[name]
    width = K if sparse else N
    logits = aot.struct((B, S, width), jnp.float32)
    q = aot.struct((B, S, H, D), jnp.bfloat16)
    ckv = aot.struct((B, N, D), jnp.bfloat16)
    extra = {}
    if target == "joint":
        extra.update(window_kv=aot.struct((B, S, D), jnp.bfloat16), sinks=aot.struct((H,), jnp.float32))
    if sparse:
        extra["topk_indices"] = aot.struct((B, S, K), jnp.int32)

    fn = jax.value_and_grad(_loss)  # wrt indexer_logits
    compiled = aot.compile_for_tpu(fn, logits, q, ckv, extra, topology=TOPOLOGY, static_kwargs=dict(target=target))
    assert isinstance(compiled, jax.stages.Compiled)
    assert compiled.as_text()  # the optimized TPU HLO exists
    (value, grad) = compiled.out_info
    assert value.shape == () and value.dtype == jnp.float32
    assert grad.shape == (B, S, width) and grad.dtype == jnp.float32

    report = aot.memory_report(compiled)
    for field in ("argument_bytes", "output_bytes", "temp_bytes"):
        value_ = getattr(report, field)
        assert isinstance(value_, int) and value_ > 0, (field, value_)
    assert isinstance(report.alias_bytes, int) and report.alias_bytes >= 0
    assert report.peak_bytes > 0
    raw_args = (B * S * width * 4 + B * S * H * D * 2 + B * N * D * 2
                + (B * S * D * 2 + H * 4 if target == "joint" else 0) + (B * S * K * 4 if sparse else 0))
    assert report.argument_bytes >= raw_args  # TPU layouts only pad
    assert report.output_bytes >= 4 + B * S * width * 4


def test_compile_memory_helper():
    """`compile_memory` = compile + memory report, here for the per-head loss alone."""
    report = aot.compile_memory(_loss, aot.struct((B, S, N), jnp.float32), aot.struct((B, S, H, D), jnp.bfloat16),
                                aot.struct((B, N, D), jnp.bfloat16), {}, topology=TOPOLOGY,
                                static_kwargs=dict(target="per_head", reduction="none"))
    assert isinstance(report, aot.MemoryReport)
    assert report.argument_bytes >= B * S * N * 4 + B * S * H * D * 2 + B * N * D * 2
    assert report.output_bytes >= B * S * 4
    assert report.temp_bytes > 0 and report.peak_bytes > 0
    assert report.compiler_peak_bytes > 0  # libtpu reports XLA's own peak
    assert report.peak_bytes >= report.compiler_peak_bytes and report.working_bytes >= report.temp_bytes


def test_memory_report_peak_is_the_larger_of_the_sum_and_the_compilers_peak():
    sums = aot.MemoryReport(argument_bytes=100, output_bytes=40, alias_bytes=10, temp_bytes=5, compiler_peak_bytes=120)
    assert (sums.peak_bytes, sums.working_bytes) == (135, 5)
    # the compiler counts more than temp (v6e's working buffers, an executable's constants): its peak stands
    more = aot.MemoryReport(argument_bytes=100, output_bytes=40, alias_bytes=10, temp_bytes=0, compiler_peak_bytes=147)
    assert (more.peak_bytes, more.working_bytes) == (147, 17)
    assert aot.MemoryReport(1, 2, 0, 3).peak_bytes == 6  # not reported: the sum
