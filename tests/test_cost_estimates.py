"""Every compiled kernel declares its HBM traffic: `CostEstimate.bytes_accessed` is at least each blocked operand's
and each result's bytes once (every kernel reads its blocked inputs whole at least once and writes its outputs
whole), for every kernel variant of `test_variants` (joint target: window LSE, teacher, selection builds), the
fused student's kernels, and the KL-of-a-given-target kernels of the heads-sharded loss (dense target with
packed ids, sparse target). Operands left in HBM (`pl.ANY`: placeholders never read, or rows a kernel DMAs
itself, whose bytes each kernel adds by hand) and the scalar prefetches are outside the bound.

Trace-only (`jax.make_jaxpr`): no kernel runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import csa_pallas
import student_cases
import test_sharding
import test_variants as variants
from csa_pallas import sharding
from csa_pallas.kernels import kl_of_target
from csa_pallas.kernels import schedule as schedule_lib
from kernel_cases import compiled_pallas_calls


def _blocked_bytes(eqn) -> int:
    """Bytes of every operand and result the pipeline moves through VMEM blocks (memory space not ANY)."""
    return sum(bm.array_aval.size * bm.array_aval.dtype.itemsize
               for bm in eqn.params["grid_mapping"].block_mappings
               if str(getattr(bm.transformed_block_aval, "memory_space", "")) != "any")


def _check_declared_bytes(jaxpr, *, at_least: int = 1) -> list:
    names = []
    for eqn in compiled_pallas_calls(jaxpr):
        name = eqn.params["name"]
        estimate = eqn.params.get("cost_estimate")
        assert estimate is not None, f"{name}: no CostEstimate"
        assert estimate.bytes_accessed >= _blocked_bytes(eqn), (name, estimate.bytes_accessed, _blocked_bytes(eqn))
        assert estimate.flops >= 0 and estimate.transcendentals >= 0, name
        names.append(name)
    assert len(names) >= at_least, names
    return names


@pytest.mark.parametrize("name", sorted(variants.VARIANTS))
def test_every_variant_declares_at_least_its_operands_once(name):
    jaxpr = jax.make_jaxpr(variants.loss_and_grad(name))(variants.arrays_for(name)).jaxpr
    names = _check_declared_bytes(jaxpr, at_least=2)
    assert any("window_lse" in n for n in names) and any("teacher" in n or "gather" in n for n in names), names


@pytest.mark.parametrize("topk", [None, 8])
def test_fused_student_kernels_declare_at_least_their_operands_once(topk):
    c, kw = student_cases.make_student_case(0, seq=64, topk=topk, num_docs=2, loss_mask=True)

    def loss(iq, ik, iw):
        return csa_pallas.fused_indexer_distill_loss(iq, ik, iw, c["q"], c["compressed_kv"], **kw,
                                                     implementation="pallas")
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(
        c["index_q"], c["index_k"], c["index_weights"]).jaxpr
    names = _check_declared_bytes(jaxpr, at_least=3)
    assert any("teacher" in n or "gather" in n for n in names), names


@pytest.mark.parametrize("target_mask", [False, True])
def test_kl_of_a_given_target_declares_at_least_its_operands_once(target_mask):
    """The heads-sharded loss's KL kernels (forward and backward), traced directly: a dense target read with the
    ids' metadata (table schedule) or a sparse one masked by its -1 slots."""
    b, bq, bk, nq, nk = 2, 16, 128, 4, 2
    s_p, n_p = nq * bq, nk * bk
    schedule = schedule_lib.TileSchedule(causal=False, nq=nq, nk=nk, block_q=bq, block_k=bk, ratio=1,
                                         num_blocks=n_p)
    target = jnp.zeros((b, s_p, n_p), jnp.float32)
    logits = jnp.zeros((b, s_p, n_p), jnp.bfloat16)
    qmeta = None if target_mask else jnp.zeros((b, s_p, 128), jnp.int32)
    kmeta = None if target_mask else jnp.zeros((b, 8, n_p), jnp.int32)
    firsts = jnp.zeros((b * nq,), jnp.int32)
    counts = jnp.full((b * nq,), nk, jnp.int32)

    def run(target, logits):
        stats = kl_of_target.kl_forward_pallas(target, logits, qmeta, kmeta, firsts, counts, schedule=schedule,
                                               target_mask=target_mask)
        grad = kl_of_target.kl_backward_pallas(target, logits, qmeta, kmeta, firsts, counts, stats,
                                               schedule=schedule, target_mask=target_mask)
        return stats, grad
    names = _check_declared_bytes(jax.make_jaxpr(run)(target, logits).jaxpr, at_least=2)
    assert sorted(n.split("_bq")[0] for n in names) == ["csa_kl_bwd", "csa_kl_fwd"]


@pytest.mark.parametrize("sparse, target, packed", [(False, "joint", True), (True, "per_head", False)],
                         ids=["dense_joint_packed", "sparse_per_head"])
def test_heads_sharded_loss_kernels_declare_at_least_their_operands_once(sparse, target, packed):
    """The heads-sharded loss (`sharding`, heads over 4 devices): the teacher's unnormalised head sums and row
    maxima (normalize=False), then the KL of the reduced target (`kl_of_target`), forward and backward."""
    axes = {"data": 2, "heads": 4}
    mesh = test_sharding.mesh_of(axes)
    logits, arrays, teacher = test_sharding.inputs(0, sparse=sparse, target=target, packed=packed)

    def run(x):
        loss = lambda y: sharding.sharded_indexer_distill_loss(mesh, y, arrays["q"], arrays["compressed_kv"],
                                                               **test_sharding.axis_kwargs(axes), **teacher)
        return jax.value_and_grad(loss)(x)
    names = _check_declared_bytes(jax.make_jaxpr(run)(logits).jaxpr, at_least=3)
    assert any("teacher" in n for n in names) and any(n.startswith("csa_kl_fwd") for n in names), names
