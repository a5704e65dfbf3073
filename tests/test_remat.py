"""The ops under `jax.checkpoint` (MaxText's remat policies): the kernels' forward passes name what they give the
backward `csa_pallas.RESIDUAL_NAME` (G, the heads-sharded loss's P, the fused op's indexer gradients, and the
kernels' row statistics). A policy that saves or offloads that name keeps them and the backward launches no kernel
of the forward again; any other policy recomputes the loss's kernels in the backward. Either way the values and
gradients are the unrematted ones, bit for bit."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import csa_pallas
from csa_pallas import aot
from jax.sharding import PartitionSpec as P

import platform_select
from aot_cases import require_libtpu

B, S, H, D, M, K, W = 1, 64, 2, 16, 4, 8, 16
N = S // M
HI, DI = 2, 16
SAVE = jax.checkpoint_policies.save_only_these_names(csa_pallas.RESIDUAL_NAME)
POLICIES = {"unrematted": "none", "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
            "residuals_saved": SAVE}


def _loss(kind: str):
    """(loss function of (student, *teacher), the student's argnums): the plain op, dense or sparse (joint target:
    the window kernel too), or the fused op (its three indexer tensors differentiated)."""
    if kind.startswith("fused"):
        sparse = kind == "fused_sparse"

        def fused(iq, ik, iw, q, kv, window, sinks, topk):
            return csa_pallas.fused_indexer_distill_loss(
                iq, ik, iw, q, kv, window_kv=window, sinks=sinks, window_size=W,
                topk_indices=topk if sparse else None, student="pallas")
        return fused, (0, 1, 2)

    def plain(logits, q, kv, window, sinks, topk):
        return csa_pallas.indexer_distill_loss(
            logits, q, kv, window_kv=window, sinks=sinks, window_size=W,
            topk_indices=topk if kind == "sparse" else None, implementation="pallas")
    return plain, (0,)


def _rematted_value_and_grad(loss, argnums, policy):
    """value_and_grad of 3 x loss under `jax.checkpoint(policy=policy)` ("none": no checkpoint). A cotangent other
    than 1, so the backward really multiplies the saved residuals."""
    if policy != "none":
        loss = jax.checkpoint(loss, policy=policy)
    return jax.value_and_grad(lambda *a: 3.0 * loss(*a), argnums=argnums)


def _value_and_grad(kind: str, policy):
    return _rematted_value_and_grad(*_loss(kind), policy)


def _inputs(kind: str, seed=0):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    teacher = [normal(B, S, H, D), normal(B, N, D), normal(B, S, D), normal(H),
               jnp.asarray(rng.integers(-1, N, (B, S, K)), jnp.int32)]
    if kind.startswith("fused"):
        return [normal(B, S, HI, DI), normal(B, N, DI), normal(B, S, HI)] + teacher
    return [normal(B, S, K if kind == "sparse" else N)] + teacher


@pytest.mark.parametrize("kind", ["dense", "sparse", "fused_dense", "fused_sparse"])
def test_rematted_losses_equal_the_unrematted_bit_for_bit(kind):
    args = _inputs(kind)
    options = platform_select.bit_exact_compiler_options()
    results = {name: jax.jit(_value_and_grad(kind, policy), compiler_options=options)(*args)
               for name, policy in POLICIES.items()}
    want = jax.tree.leaves(results.pop("unrematted"))
    for name, got in results.items():
        for g, w in zip(jax.tree.leaves(got), want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


def _kernel_launches(compiled) -> collections.Counter:
    """{kernel family (its name up to the tile sizes): Mosaic calls in the compiled program}."""
    calls = [line for line in compiled.as_text().splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    families = (re.sub(r"_(bq|b)$", "", re.search(r"csa_[a-z_]+", line).group(0)) for line in calls)
    return collections.Counter(families)


OFFLOAD = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=[csa_pallas.RESIDUAL_NAME], offload_src="device",
    offload_dst="pinned_host")


def _sharded_over_heads(kind: str, structs, policy):
    """The program of `kind` on a v5p:2x2x1 mesh {"heads": 4} through the sharded entry points (the plain loss's
    head sums reduce-scattered into the stand-alone KL kernels; the fused op's owned rows in one gradient pass),
    with structs placed by their specs."""
    mesh = aot.tpu_mesh("v5p:2x2x1", {"heads": 4})
    fused = kind.startswith("fused")
    specs = ([P(), P(), P()] if fused else [P()]) + [P(None, None, "heads", None), P(), P(), P("heads"), P()]
    placed = [aot.sharded_struct(x.shape, x.dtype, mesh, spec) for x, spec in zip(structs, specs)]
    common = dict(head_axis="heads", window_size=W, target="joint")

    def loss(*args):
        if fused:
            iq, ik, iw, q, kv, window, sinks, topk = args
            return csa_pallas.sharded_fused_indexer_distill_loss(
                mesh, iq, ik, iw, q, kv, window_kv=window, sinks=sinks, topk_indices=topk, **common)
        logits, q, kv, window, sinks, topk = args
        return csa_pallas.sharded_indexer_distill_loss(mesh, logits, q, kv, window_kv=window, sinks=sinks,
                                                       topk_indices=topk, implementation="pallas", **common)
    program = _rematted_value_and_grad(loss, (0, 1, 2) if fused else (0,), policy)
    return aot.compile_for_tpu(program, *placed, topology="v5p:2x2x1")


@pytest.mark.parametrize("kind", ["dense", "sparse", "fused_sparse", "sharded_heads_sparse",
                                  "fused_sharded_heads_sparse"])
def test_residuals_saved_by_name_compiles_for_v5p_with_each_kernel_launched_once(kind):
    """S = 512, H = 8, D = 128, K = 128, bf16 (small: what is checked is the program's structure), compiled for
    v5p: nothing_saveable launches the forward's kernels again in the backward; the name saved (in HBM) or
    offloaded (pinned host memory, S(5) in the program) does not."""
    require_libtpu()
    seq, heads, dim, n, width, hi, di = 512, 8, 128, 128, 128, 8, 128
    bf16 = jnp.bfloat16
    teacher = [aot.struct((B, seq, heads, dim), bf16), aot.struct((B, n, dim), bf16), aot.struct((B, seq, dim), bf16),
               aot.struct((heads,), jnp.float32), aot.struct((B, seq, width), jnp.int32)]
    student = ([aot.struct((B, seq, hi, di), bf16), aot.struct((B, n, di), bf16), aot.struct((B, seq, hi), bf16)]
               if kind.startswith("fused") else
               [aot.struct((B, seq, width if kind.endswith("sparse") else n), jnp.float32)])
    launches, hlo = {}, {}
    for name, policy in [("nothing", jax.checkpoint_policies.nothing_saveable), ("saved", SAVE),
                         ("offloaded", OFFLOAD)]:
        if "sharded" in kind:
            compiled = _sharded_over_heads(kind, student + teacher, policy)
        else:
            compiled = aot.compile_for_tpu(_value_and_grad(kind, policy), *student, *teacher)
        launches[name], hlo[name] = _kernel_launches(compiled), compiled.as_text()
    forward = "csa_window_lse"  # the joint target's first kernel, a forward-only one
    assert launches["nothing"][forward] == 2, launches
    for name in ("saved", "offloaded"):
        assert all(count == 1 for count in launches[name].values()), (name, launches)
        assert set(launches[name]) == set(launches["nothing"]), launches
    assert "S(5)" in hlo["offloaded"] and "S(5)" not in hlo["saved"]
