"""v5p AOT compiles of the sharded loss on an 8-chip topology (v5p:2x2x2), forward + backward at the
DeepSeek-V4-Flash shape (H=64, D=512, m=4, W=128, bf16, S=4096): per-device temp HBM <= the single-chip bound
divided by the number of devices + 64 MiB, and the head shards' teacher sums are the only [B, S, N]-sized collective."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from csa_pallas import aot, sharding
from aot_cases import require_libtpu

MiB = 1 << 20
TOPOLOGY = "v5p:2x2x2"
S, H, D, M, W, K = 4096, 64, 512, 4, 128, 512
N = S // M


def compile_sharded(axes: dict, batch: int, sparse: bool):
    mesh = aot.tpu_mesh(TOPOLOGY, axes)
    b = ("data",) if "data" in axes else None
    seq = "seq" if "seq" in axes else None
    heads = "heads" if "heads" in axes else None
    width = K if sparse else N
    st = lambda shape, dtype, spec: aot.sharded_struct(shape, dtype, mesh, spec)
    args = [st((batch, S, width), jnp.float32, P(b, seq, None)),
            st((batch, S, H, D), jnp.bfloat16, P(b, seq, heads, None)),
            st((batch, N, D), jnp.bfloat16, P(b, None, None)), st((batch, S, D), jnp.bfloat16, P(b, seq, None)),
            st((H,), jnp.float32, P(heads))]
    if sparse:
        args.append(st((batch, S, K), jnp.int32, P(b, seq, None)))

    def program(logits, q, compressed_kv, window_kv, sinks, topk_indices=None):
        loss = lambda x: sharding.sharded_indexer_distill_loss(
            mesh, x, q, compressed_kv, batch_axes=b, head_axis=heads, seq_axis=seq, window_kv=window_kv, sinks=sinks,
            topk_indices=topk_indices, compress_ratio=M, window_size=W, target="joint", implementation="pallas")
        return jax.value_and_grad(loss)(logits)
    return aot.compile_for_tpu(program, *args, topology=TOPOLOGY)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse_k512"])
@pytest.mark.parametrize("axes,batch", [({"data": 2, "heads": 4}, 2), ({"seq": 8}, 1)], ids=["data2_heads4", "seq8"])
def test_flash_shape_sharded_forward_backward_compiles_within_per_device_bound(axes, batch, sparse):
    require_libtpu()
    compiled = compile_sharded(axes, batch, sparse)
    report = aot.memory_report(compiled)
    one_target = batch * S * (K if sparse else N) * 4
    single_chip_bound = 1.25 * one_target + 64 * MiB
    devices = 8
    assert 0 < report.temp_bytes <= single_chip_bound / devices + 64 * MiB, (report, single_chip_bound)
    hlo = compiled.as_text()
    if "heads" in axes:
        # One [B/2, S, N|K] f32 reduction of the head sums in the forward (XLA may lower the reduce-scatter as an
        # all-reduce + slice); the student's gradient is row-sharded, so the backward reduces nothing that size.
        big = f"f32[{batch // 2},{S},"
        reductions = [line for line in hlo.splitlines()
                      if re.search(r" (all-reduce|reduce-scatter)\(", line) and big in line.split("=", 1)[1][:40]]
        assert len(reductions) == 1 and "csa_kl_bwd" not in reductions[0], [r[:160] for r in reductions]
    if "seq" in axes:
        assert "collective-permute" in hlo  # the window halo
