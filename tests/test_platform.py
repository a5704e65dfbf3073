"""The kernels' mode follows the platform a program is lowered for (issue 14, item 1).

MaxText's AOT flow compiles for a TPU topology on a CPU host with a plain `jax.jit(f).lower(<structs on TPU
devices>).compile()`. That must give real Mosaic kernels (not the CPU interpreter) with no csa_pallas context, and
the same jitted function must still interpret on CPU, whichever of the two is lowered first (jit caches one
jaxpr for both: `kernels.runtime.pallas_call` stages both modes in one call, tracing the kernel once, and each
form is lowered for its own platforms only, so `jax.export` can also hold both).
"""

import contextlib
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import NamedSharding, PartitionSpec

import csa_pallas
from csa_pallas import aot
from csa_pallas.kernels import runtime
import platform_select
from aot_cases import require_libtpu

MiB = 1 << 20
MOSAIC_CALL = "tpu_custom_call"


def _on_one_chip(*structs):
    sharding = NamedSharding(aot.single_chip_mesh(), PartitionSpec())
    return [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in structs]


def _loss_and_grad(sparse: bool):
    def program(logits, q, kv, topk):
        loss = lambda x: csa_pallas.indexer_distill_loss(  # noqa: E731
            x, q, kv, topk_indices=topk if sparse else None, target="per_head", implementation="pallas")
        return jax.value_and_grad(loss)(logits)
    return program


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse_k256"])
def test_plain_jit_compile_for_v5p_from_a_cpu_host_gets_mosaic_kernels(sparse):
    """Flash widths at S = 2048 (K = 256), forward + backward, no context: Mosaic calls present, temp HBM within
    1/2 of one [B, S, N] f32 array (at S = 4096 the interpreter lowering needed 564 MiB; the Flash-shape 4K
    programs and their memory bounds are test_aot_kernels' and test_aot_sparse's, so this test stays small)."""
    require_libtpu()
    assert runtime.interpret_mode() is runtime.FOLLOW_PLATFORM  # nothing pinned
    seq, heads, dim, width = 2048, 64, 512, 256
    n = seq // 4
    structs = _on_one_chip(
        jax.ShapeDtypeStruct((1, seq, width if sparse else n), jnp.float32),
        jax.ShapeDtypeStruct((1, seq, heads, dim), jnp.bfloat16), jax.ShapeDtypeStruct((1, n, dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, seq, width), jnp.int32))
    if not sparse:
        structs[3] = None
    compiled = jax.jit(_loss_and_grad(sparse)).lower(*structs).compile()
    text = compiled.as_text()
    assert text.count(MOSAIC_CALL) >= (3 if sparse else 1), text.count(MOSAIC_CALL)
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert 0 < temp <= seq * n * 4 // 2, temp / MiB
    if not sparse:
        # The KL is fused into the teacher and the forward saves only G, pre-scaled by the static row weight
        # (default ids, "mean") and updated in place into the gradient: no XLA op reads or writes a [B, S, N]
        # array after the kernel.
        full_pass = re.compile(rf"= f32\[1,{seq},{n}\]\S* fusion\(")
        passes = [line for line in text.splitlines() if full_pass.search(line)]
        assert not passes, passes


def _small_problem(sparse: bool, seed: int):
    """(logits, q, kv, top-k indices or None) at S = 256, H = 4, D = 128, K = 16: f32 logits, bf16 q / kv."""
    b, s, h, d, k = 1, 256, 4, 128, 16
    n = s // 4
    keys = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(keys[0], (b, s, k if sparse else n), jnp.float32),
            jax.random.normal(keys[1], (b, s, h, d), jnp.bfloat16),
            jax.random.normal(keys[2], (b, n, d), jnp.bfloat16),
            jax.random.randint(keys[3], (b, s, k), -1, n, jnp.int32) if sparse else None)


def _on_one_chip_like(args):
    """Structs of `args` placed on one v5p chip (a None stays None)."""
    structs = iter(_on_one_chip(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args if a is not None)))
    return [None if a is None else next(structs) for a in args]


def _doubling_program(on_trace=lambda: None):
    """x -> 2 x through one `runtime.pallas_call` in the mode `runtime.interpret_mode()` gives; on_trace runs each
    time the kernel body is traced."""
    def double(x_ref, o_ref):
        on_trace()
        o_ref[...] = x_ref[...] * 2.0

    def program(x):
        return runtime.pallas_call(double, interpret=runtime.interpret_mode(),
                                   out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    return program


@pytest.mark.parametrize("order", ["cpu_then_tpu", "tpu_then_cpu"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_one_jitted_function_interprets_on_cpu_and_compiles_for_tpu_in_either_order(order, sparse):
    require_libtpu()
    args = logits, q, kv, _ = _small_problem(sparse, seed=7)
    jitted = jax.jit(_loss_and_grad(sparse))

    def on_cpu():
        value, grad = jitted(*args)
        ref_value, ref_grad = jax.value_and_grad(lambda x: csa_pallas.indexer_distill_loss(
            x, q, kv, topk_indices=args[3], target="per_head", implementation="xla"))(logits)
        np.testing.assert_allclose(float(value), float(ref_value), rtol=2e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(grad), np.asarray(ref_grad), rtol=2e-5, atol=1e-7)
        cpu_text = jitted.lower(*args).as_text()
        assert MOSAIC_CALL not in cpu_text  # only the interpreter branch is lowered for CPU

    def for_tpu():
        compiled = jitted.lower(*_on_one_chip_like(args)).compile()
        assert MOSAIC_CALL in compiled.as_text()

    steps = (on_cpu, for_tpu) if order == "cpu_then_tpu" else (for_tpu, on_cpu)
    for step in steps:
        step()


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_jax_export_for_tpu_for_cpu_and_for_both_in_one_artifact(sparse):
    """`jax.export` from this CPU host: for TPU (the Mosaic kernels), for CPU (the interpreter, run here and equal
    to the jitted function bit for bit) and for both at once, whose CPU half runs here and whose TPU half compiles
    for v5p. Both at once failed while the calls were staged with `lax.platform_dependent`, whose branches are
    lowered for every platform ("Only interpret mode is supported on CPU backend"); `runtime._per_platform_p`
    lowers each kernel call's two forms for their own platforms only."""
    require_libtpu()
    from jax import export
    args = _small_problem(sparse, seed=3)
    options = platform_select.bit_exact_compiler_options()
    program = jax.jit(_loss_and_grad(sparse), compiler_options=options)
    want = program(*args)
    exported = {platforms: export.export(program, platforms=platforms)(*args)
                for platforms in [("tpu",), ("cpu",), ("cpu", "tpu")]}
    for platforms, exp in exported.items():
        assert (MOSAIC_CALL in exp.mlir_module()) == ("tpu" in platforms), platforms
        if "cpu" in platforms:
            got = jax.jit(exp.call, compiler_options=options)(*args)
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    compiled = jax.jit(exported[("cpu", "tpu")].call).lower(*_on_one_chip_like(args)).compile()
    assert MOSAIC_CALL in compiled.as_text()


def test_a_kernel_call_differentiated_directly_says_what_to_differentiate():
    """The ops carry their gradients in custom_vjps; a kernel call itself has no derivative (loud, not Pallas's
    attempt to differentiate a kernel body)."""
    x = jnp.ones((8, 128), jnp.float32)
    with pytest.raises(NotImplementedError, match="differentiate the public ops"):
        jax.jvp(_doubling_program(), (x,), (x,))


def test_pinned_modes_still_pin():
    """`interpret_override` (the tests' race-checking interpreter) and `compiling_for_tpu` fix the mode of the
    calls traced inside; outside, the lowering platform decides."""
    with runtime.interpret_override(True):
        assert runtime.interpret_mode() is True
    with runtime.compiling_for_tpu():
        assert runtime.interpret_mode() is False
    assert runtime.interpret_mode() is runtime.FOLLOW_PLATFORM


def test_a_kernel_body_is_traced_once_for_both_platforms():
    """Staging both modes traces the kernel once: the interpreted branch is the compiled call's jaxpr with
    `interpret` set. The one trace then runs on CPU (the interpreter) and compiles for v5p (Mosaic)."""
    require_libtpu()
    traced = []
    jitted = jax.jit(_doubling_program(lambda: traced.append(1)))
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    np.testing.assert_array_equal(np.asarray(jitted(x)), np.asarray(x) * 2.0)
    assert len(traced) == 1
    structs = _on_one_chip(jax.ShapeDtypeStruct(x.shape, x.dtype))
    assert MOSAIC_CALL in jitted.lower(*structs).compile().as_text()
    assert len(traced) == 2  # jit traces again for the chip-placed inputs: once, again


@pytest.mark.parametrize("mode", ["follow_platform", "pinned_race_checking"])
def test_interpreted_kernels_keep_their_unrolled_loops_rolled(mode):
    """A `fori_loop(..., unroll=True)` in a kernel (how the gather kernels write their per-slot loads, which Mosaic
    must see straight-line) stays unrolled in the compiled kernel and runs as a loop in the interpreted one
    (`runtime.rolled`: unrolling is code generation only); both give the same result, and the compiled one
    compiles for v5p."""
    require_libtpu()
    from jax.experimental.pallas import tpu as pltpu

    def running_sums(x_ref, o_ref):
        def add_row(i, acc):
            acc = acc + x_ref[pl.ds(i, 1), :]
            o_ref[pl.ds(i, 1), :] = acc
            return acc
        jax.lax.fori_loop(0, 16, add_row, jnp.zeros((1, 128), jnp.float32), unroll=True)

    def program(x):
        return runtime.pallas_call(running_sums, interpret=runtime.interpret_mode(),
                                   out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 128)), jnp.float32)
    params = pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise")
    with runtime.interpret_override(params) if mode == "pinned_race_checking" else contextlib.nullcontext():
        jaxpr = jax.make_jaxpr(program)(x).jaxpr
        got = jax.jit(program)(x)
    np.testing.assert_allclose(np.asarray(got), np.cumsum(np.asarray(x), axis=0), rtol=1e-6, atol=1e-6)
    calls = [eqn for eqn in _walk(jaxpr) if eqn.primitive.name == "pallas_call"]
    unrolls = {"compiled" if call.params["interpret"] is False else "interpreted":
               [eqn.params["unroll"] for eqn in _walk(call.params["jaxpr"]) if eqn.primitive.name == "scan"]
               for call in calls}
    assert unrolls["interpreted"] == [1]  # a loop
    if mode == "follow_platform":
        assert unrolls["compiled"] == [16]  # staged beside it: unrolled
        structs = _on_one_chip(jax.ShapeDtypeStruct(x.shape, x.dtype))
        assert MOSAIC_CALL in jax.jit(program).lower(*structs).compile().as_text()
    else:
        assert "compiled" not in unrolls  # pinned: the interpreter only


def _walk(jaxpr):
    """Every equation of `jaxpr`, nested jaxprs' included, in program order."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in (value if isinstance(value, (tuple, list)) else (value,)):
                if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                    yield from _walk(getattr(sub, "jaxpr", sub))
