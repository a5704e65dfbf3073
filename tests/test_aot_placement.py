"""v5p:2x2x2 AOT compiles of the *plain* op on sharded structs by plain `jax.jit(...).lower(...).compile()` (no
csa_pallas context, no mesh argument): the layout comes from `activation_sharding`, Flax rules or Explicit axes
(`csa_pallas.placement`), the program has Mosaic kernels, and the per-device temp HBM stays within the single-chip
bound / 8 + 64 MiB at the DeepSeek-V4-Flash shape (S=4096, H=64, D=512, bf16); plus the scanned, rematted
two-layer example model (examples/sharded_aot.py)."""

import os
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import csa_pallas
from csa_pallas import aot
from aot_cases import require_libtpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `examples`
from examples import sharded_aot  # noqa: E402

MiB = 1 << 20
TOPOLOGY = "v5p:2x2x2"
S, H, D, M, W, K = 4096, 64, 512, 4, 128, 512
N = S // M

CASES = {  # mesh axes, (batch, seq, heads) of q, batch size, sparse
    "data_fsdp_tensor-dense": ({"data": 2, "fsdp": 2, "tensor": 2}, (("data", "fsdp"), None, "tensor"), 4, False),
    "fsdp_context-sparse": ({"fsdp": 2, "context": 4}, (("fsdp",), "context", None), 2, True),
    "data_tensor_context-sparse": ({"data": 2, "tensor": 2, "context": 2}, (("data",), "context", "tensor"), 2,
                                   True),
}


def flash_structs(mesh, layout, batch, sparse):
    b, seq, heads = layout
    st = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
    args = [st((batch, S, K if sparse else N), jnp.float32, P(b, seq, None)),
            st((batch, S, H, D), jnp.bfloat16, P(b, seq, heads, None)), st((batch, N, D), jnp.bfloat16, P(b)),
            st((batch, S, D), jnp.bfloat16, P(b, seq, None)), st((H,), jnp.float32, P())]
    if sparse:
        args.append(st((batch, S, K), jnp.int32, P(b, seq, None)))
    return args


def program(logits, q, compressed_kv, window_kv, sinks, topk_indices=None):
    loss = lambda x: csa_pallas.indexer_distill_loss(x, q, compressed_kv, window_kv=window_kv, sinks=sinks,
                                                     topk_indices=topk_indices, compress_ratio=M, window_size=W,
                                                     target="joint", implementation="pallas")
    return jax.value_and_grad(loss)(logits)


def check_compiled(compiled, batch, sparse):
    report = aot.memory_report(compiled)
    single_chip_bound = 1.25 * batch * S * (K if sparse else N) * 4 + 64 * MiB
    print(f"per-device HBM: temp {report.temp_bytes / MiB:.1f} MiB, arguments {report.argument_bytes / MiB:.1f} MiB")
    assert 0 < report.temp_bytes <= single_chip_bound / 8 + 64 * MiB, report
    assert "tpu_custom_call" in compiled.as_text()  # Mosaic kernels, not the interpreter


@pytest.mark.parametrize("name", list(CASES))
def test_plain_op_with_declared_layout_compiles_for_v5p(name):
    require_libtpu()
    axes, layout, batch, sparse = CASES[name]
    mesh = aot.tpu_mesh(TOPOLOGY, axes)
    b, seq, heads = layout

    def declared(*args):
        with csa_pallas.activation_sharding(batch=b, heads=heads, seq=seq):
            return program(*args)
    check_compiled(jax.jit(declared).lower(*flash_structs(mesh, layout, batch, sparse)).compile(), batch, sparse)


def test_plain_op_on_an_explicit_mesh_compiles_for_v5p():
    require_libtpu()
    devices = aot.tpu_devices(TOPOLOGY)
    mesh = jax.make_mesh((2, 2, 2), ("data", "heads", "seq"), axis_types=(AxisType.Explicit,) * 3, devices=devices)
    layout = (("data",), "seq", "heads")
    with jax.set_mesh(mesh):
        compiled = jax.jit(program).lower(*flash_structs(mesh, layout, 2, True)).compile()
    check_compiled(compiled, 2, True)


def test_plain_op_on_a_mesh_mixing_explicit_and_auto_axes_compiles_for_v5p():
    """"data" Explicit (q's type), "heads" and "seq" Auto (declared): the sharded path's Mosaic calls on v5p."""
    require_libtpu()
    devices = aot.tpu_devices(TOPOLOGY)
    mesh = jax.make_mesh((2, 2, 2), ("data", "heads", "seq"),
                         axis_types=(AxisType.Explicit, AxisType.Auto, AxisType.Auto), devices=devices)
    layout = (("data",), "seq", "heads")
    with jax.set_mesh(mesh), csa_pallas.activation_sharding(batch="data", heads="heads", seq="seq"):
        compiled = jax.jit(program).lower(*flash_structs(mesh, layout, 2, True)).compile()
    check_compiled(compiled, 2, True)


@pytest.mark.parametrize("remat_policy", ["full", "save_proj", "offload_proj"])
def test_scanned_rematted_model_example_compiles_for_v5p_by_the_plain_path(remat_policy):
    """MaxText's remat policies by name: nothing saved, the named projections and the loss's residuals
    (`csa_pallas.RESIDUAL_NAME`) saved, or offloaded to pinned host memory (the compiled program then holds
    host-memory buffers, memory space S(5)). Saved or offloaded, the backward launches no teacher again: one teacher
    launch per KL backward launch (the layer scan may be unrolled), two when the layer is recomputed."""
    require_libtpu()
    shape = sharded_aot.Shape(batch=8, seq=1024, embed=128, heads=8, head_dim=128, indexer_dim=32)
    compiled = sharded_aot.compile_for_slice(shape, TOPOLOGY, remat_policy=remat_policy)
    hlo = compiled.as_text()
    assert hlo.count("tpu_custom_call") >= 2  # the loss kernels, inside the scanned layer body
    assert ("S(5)" in hlo) == (remat_policy == "offload_proj")
    calls = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    teacher, kl_backward = (sum(name in line for line in calls) for name in ("csa_teacher_joint", "csa_kl_bwd"))
    assert kl_backward >= 1 and teacher == kl_backward * (2 if remat_policy == "full" else 1), (teacher, kl_backward)
    report = aot.memory_report(compiled)
    assert 0 < report.temp_bytes < 256 * MiB, report
