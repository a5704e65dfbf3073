"""The fused student's query-chunked scan (SPEC §8, `csa_pallas/fused_student.py`) against the reference.

Per-row losses differentiated through the rematerialised chunks; non-finite compressed_kv blocks, index_k rows and
indexer inputs reaching exactly the rows that read them (SPEC §3, §6) on every student path; sparse chunks on the
gather path sharing one packed copy of the keys, reading q in place and taking the prefix validity of default ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import csa_pallas
from csa_pallas.kernels import student_scores as sk
from csa_pallas.kernels.student_gather import StudentGatherConfig
from student_cases import FAST, check, loss_and_grads, make_student_case


@pytest.mark.parametrize("student, topk", [("pallas", None), ("xla", None),
                                           (sk.StudentKernelConfig(block_q=16, block_k=128), 7)],
                         ids=["pallas", "xla", "sparse_visit"])
def test_per_row_losses_differentiate_through_the_rematerialised_chunks(student, topk):
    """reduction="none" (a cotangent per row) takes the checkpointed scan, not the gradient-in-forward path: its
    rows and the gradients of a weighted sum of them match the reference (sparse_visit: the KL over blocks)."""
    c, kw = make_student_case(13, batch=2, seq=64, num_docs=2, loss_mask=True, topk=topk)
    weights = jnp.asarray(np.random.default_rng(0).random((2, 64)), jnp.float32)

    def weighted(implementation, **options):
        def f(iq, ik, iw):
            rows = csa_pallas.fused_indexer_distill_loss(iq, ik, iw, c["q"], c["compressed_kv"], **kw,
                                                         target="joint", reduction="none",
                                                         implementation=implementation, **options)
            return jnp.sum(rows * weights), rows
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True), compiler_options=FAST)(
            c["index_q"], c["index_k"], c["index_weights"])

    (_, got_rows), got = weighted("pallas", student=student, query_chunk=16)
    (_, want_rows), want = weighted("xla")
    np.testing.assert_allclose(got_rows, want_rows, atol=1e-6, rtol=1e-6)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-6 * float(jnp.max(jnp.abs(b))), rtol=0)


@pytest.mark.parametrize("topk", [None, 6])
@pytest.mark.parametrize("query_chunk", [None, 16])
def test_a_non_finite_key_block_makes_exactly_its_readers_nan(topk, query_chunk):
    """SPEC §3 through the fused op: the rows with a non-finite compressed_kv block in V(t) are NaN, the others
    equal the reference. One chunk NaN-fills the key rows; several chunks in dense mode leave compressed_kv as
    given (no filled copy) and make the readers' query rows NaN; sparse chunks (visit path here) read the filled
    keys: all give the reference's rows."""
    c, kw = make_student_case(21, batch=2, seq=64, topk=topk, num_docs=2, loss_mask=True)
    kv = np.array(c["compressed_kv"])
    kv[0, 3, 1], kv[1, 9, 0], kv[1, 12, 2] = np.nan, -np.inf, np.inf
    c["compressed_kv"] = jnp.asarray(kv)

    def rows(implementation, **options):
        return csa_pallas.fused_indexer_distill_loss(
            c["index_q"], c["index_k"], c["index_weights"], c["q"], c["compressed_kv"], **kw, target="joint",
            reduction="none", implementation=implementation, **options)

    want = np.asarray(rows("xla"))
    got = np.asarray(jax.jit(lambda: rows("pallas", query_chunk=query_chunk), compiler_options=FAST)())
    assert 0 < np.isnan(want).sum() < want.size  # some rows read a bad block, some do not
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), rtol=0, atol=1e-6)


@pytest.mark.parametrize("rows, dk", [(False, False), (True, True)], ids=["copies_and_xla_sums", "in_place"])
def test_the_one_kernel_pass_reads_its_chunks_as_its_config_says(monkeypatch, rows, dk):
    """`StudentGatherConfig.rows_in_place` / `dk_in_place` force how the one-kernel gradient pass takes its chunks
    (index_q's rows and their gradient in place or copied; dk's running sums in the kernel or added in XLA); both
    ways match the oracle. Here the default (None) would take both in place (d_I = 128)."""
    from csa_pallas.kernels import student_gather_kl
    calls, kernel = [], student_gather_kl.loss_and_grads
    monkeypatch.setattr(student_gather_kl, "loss_and_grads", lambda *a, **k: calls.append(
        (k.get("rows_in_place") is not None, k.get("dk_partials") is not None)) or kernel(*a, **k))
    c, kw = make_student_case(29, seq=32, topk=6, num_docs=2, loss_mask=True, index_dim=128)
    check(c, kw, "per_head", implementation="pallas", reduction="sum", query_chunk=16, index_head_chunk=1,
          student=StudentGatherConfig(rows_in_place=rows, dk_in_place=dk))
    assert calls and all(call == (rows, dk) for call in calls), calls


def test_in_place_chunk_operands_forced_where_they_cannot_apply_are_value_errors():
    """A forced rows_in_place / dk_in_place the problem cannot take names the field (traced, before any kernel)."""
    def trace(index_dim, reduction="sum", **fields):
        c, kw = make_student_case(31, seq=32, topk=6, index_dim=index_dim)
        f = lambda iq, ik, iw: jnp.sum(csa_pallas.fused_indexer_distill_loss(
            iq, ik, iw, c["q"], c["compressed_kv"], **kw, reduction=reduction, implementation="pallas",
            query_chunk=16, student=StudentGatherConfig(**fields)))
        jax.eval_shape(jax.grad(f, argnums=(0, 1, 2)), c["index_q"], c["index_k"], c["index_weights"])
    trace(16, rows_in_place=False)  # accepted: the copies
    with pytest.raises(ValueError, match=r"rows_in_place=True needs index_q with d_I a multiple of 128"):
        trace(16, rows_in_place=True)
    with pytest.raises(ValueError, match=r"dk_in_place=True needs fuse_kl=True"):
        trace(128, fuse_kl=False, dk_in_place=True)
    with pytest.raises(ValueError, match=r"rows_in_place=True needs a scalar reduction"):
        trace(128, reduction="none", rows_in_place=True)
    with pytest.raises(ValueError, match=r"dk_in_place: expected None, True or False"):
        StudentGatherConfig(dk_in_place="yes")


@pytest.mark.parametrize("index_dim, q_in_place", [(16, None), (128, False)],
                         ids=["index_q_copied", "index_q_in_place_q_copied"])
def test_query_chunks_on_the_sparse_gather_path_read_the_keys_as_given(monkeypatch, index_dim, q_in_place):
    """Sparse chunks on the gather path (forced by the teacher's `config=`, with looped slots: a small program
    for the interpreter; test_variants covers the unrolled default) hand the teacher compressed_kv as given (its
    kernel packs its resident rows itself, +-inf made NaN: no filled or packed copy in HBM) and read each chunk's q
    rows in place (`Problem.q_window`; `GatherConfig.q_in_place` None) or from a copy (q_in_place=False); the one
    student kernel reads each chunk's index_q rows and writes their gradient in place where d_I is a whole lane
    tile (`student_gather_kl.rows_in_place_ok`), else from a copy; against the oracle (index_k's gradient summed
    over the chunks in the kernel's running partial sums). A non-finite key block still makes exactly its readers
    NaN."""
    from csa_pallas import ops
    from csa_pallas.kernels import sparse_gather, student_gather_kl
    config = {"path": "gather", "unroll_slots": False, "q_in_place": q_in_place}
    fills = []
    real_fill = ops.nan_filled_rows
    monkeypatch.setattr(ops, "nan_filled_rows", lambda x: fills.append(x.shape) or real_fill(x))
    in_place, launch = [], sparse_gather.sparse_gather_pallas

    def spied_launch(q, *args, **kwargs):
        in_place.append(isinstance(q, sparse_gather.RowWindow))
        return launch(q, *args, **kwargs)
    monkeypatch.setattr(sparse_gather, "sparse_gather_pallas", spied_launch)
    student_rows, student = [], student_gather_kl.loss_and_grads
    monkeypatch.setattr(student_gather_kl, "loss_and_grads",
                        lambda *a, **k: student_rows.append(k.get("rows_in_place") is not None) or student(*a, **k))
    c, kw = make_student_case(23, seq=32, topk=6, num_docs=2, loss_mask=True, index_dim=index_dim)
    check(c, kw, "joint", implementation="pallas", reduction="sum", query_chunk=16, index_head_chunk=1,
          config=config)
    assert not fills, fills
    assert in_place and all(used == (q_in_place is None) for used in in_place), in_place
    assert student_rows and all(used == (index_dim == 128) for used in student_rows), student_rows
    if index_dim == 128:
        return  # the non-finite keys below: once

    kv = np.array(c["compressed_kv"])
    kv[0, 2, 0], kv[0, 5, 3], kv[0, 6, 1] = np.nan, np.inf, -np.inf
    c["compressed_kv"] = jnp.asarray(kv)
    rows = lambda implementation, **o: csa_pallas.fused_indexer_distill_loss(
        c["index_q"], c["index_k"], c["index_weights"], c["q"], c["compressed_kv"], **kw, target="per_head",
        reduction="none", implementation=implementation, **o)
    want, got = np.asarray(rows("xla")), np.asarray(rows("pallas", query_chunk=16, config=config))
    assert 0 < np.isnan(want).sum() < want.size
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), rtol=0, atol=1e-6)


def test_sparse_chunks_of_default_ids_take_the_prefix_validity(monkeypatch):
    """Query-row chunks of a default-ids problem keep V(t) a prefix of the blocks (`Problem.default_keys`): the
    slot validity comes from the rows' limits, not from XLA gathers of the blocks' metadata; against the oracle,
    loss_mask included."""
    from csa_pallas import masks
    c, kw = make_student_case(24, seq=64, topk=6)
    kw["loss_mask"] = jnp.asarray(np.random.default_rng(3).random((1, 64)) > 0.3)

    def no_gathers(*args, **kwargs):
        raise AssertionError("slot_visible: the chunks of default ids should not gather block metadata")
    monkeypatch.setattr(masks, "slot_visible", no_gathers)
    check(c, kw, "per_head", implementation="pallas", reduction="sum", query_chunk=16)


@pytest.mark.parametrize("student", ["auto", StudentGatherConfig(fuse_kl=False), "xla"])
def test_a_non_finite_index_k_block_reaches_exactly_the_rows_that_select_it(student):
    """SPEC §3-§4 on the student's side, sparse mode: a NaN index_k block makes NaN exactly the rows that select it
    inside V(t) (their KL and gradients, and dk of the blocks they see). A slot selecting it outside V(t) (a future
    block) and the empty slots that read it through the index mask (N a power of two) change nothing: they once
    made d index_q NaN through 0 * NaN in the products. The kernels' d index_q / d index_k equal the reference's,
    NaN pattern included; d index_weights on the other rows too."""
    c, kw = make_student_case(3, seq=64, topk=6, loss_mask=True)
    n = c["index_k"].shape[1]  # 16 blocks, a power of two: a masked index reads the last block
    idx = np.array(kw["topk_indices"])
    mask = np.asarray(kw["loss_mask"]).copy()
    unseen, seen = n - 1, 6  # block 15 is visible only to t = 63 (masked out); block 6 from t = 27 on
    idx[0, 10, 0] = unseen  # a future block: outside V(10)
    idx[0, 40, 2], idx[0, 50, 3] = seen, seen
    mask[0, 40] = mask[0, 50] = True
    mask[0, 63] = False
    idx[0, 30:40] = np.where(idx[0, 30:40] == seen, -1, idx[0, 30:40])  # rows 30-39 do not select it
    c = dict(c, index_k=c["index_k"].at[0, unseen].set(jnp.nan).at[0, seen].set(jnp.nan))
    kw = dict(kw, topk_indices=jnp.asarray(idx), loss_mask=jnp.asarray(mask))
    rows = np.asarray(csa_pallas.fused_indexer_distill_loss(
        *[c[k] for k in ("index_q", "index_k", "index_weights", "q", "compressed_kv")], **kw, target="per_head",
        reduction="none", implementation="xla"))[0]
    readers = np.isnan(rows)
    assert readers[40] and readers[50] and not readers[30:40].any() and not readers[10]
    want = loss_and_grads(c, kw, target="per_head", reduction="sum", implementation="xla")
    got = loss_and_grads(c, kw, target="per_head", reduction="sum", implementation="pallas", student=student)
    assert np.isnan(float(got[0])) and np.isnan(float(want[0]))
    (dq, dk, dw), (want_dq, want_dk, want_dw) = ([np.asarray(x, np.float64) for x in g] for g in (got[1], want[1]))
    for name, a, b in (("index_q", dq, want_dq), ("index_k", dk, want_dk), ("index_weights", dw, want_dw)):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=name)
        np.testing.assert_allclose(np.nan_to_num(a), np.nan_to_num(b), rtol=0,
                                   atol=1e-6 * np.max(np.abs(np.nan_to_num(b))), err_msg=name)
    # a reader's G is NaN on V(t): its dw on every head (G ReLU(z) over V(t)), its dq where a head's ReLU is active
    assert np.all(np.isnan(dw[0, readers])) and np.all(np.isfinite(dw[0, ~readers]))
    assert np.isnan(dq[0, readers]).any() and np.all(np.isfinite(dq[0, ~readers]))


@pytest.mark.parametrize("topk,student,dtype", [
    (None, "auto", jnp.float32), (None, "auto", jnp.bfloat16), (6, "auto", jnp.float32),
    (6, StudentGatherConfig(fuse_kl=False), jnp.float32)])
def test_non_finite_indexer_inputs_reach_only_their_readers_and_the_kernels_agree(topk, student, dtype):
    """SPEC §6 ("agree on every input") with NaN and +-inf in all three indexer tensors: on rows whose loss reads
    them (NaN rows), on loss-masked rows, and in an index_k block no unmasked row sees. The student kernels' loss
    rows and three gradients equal the reference's, NaN pattern included; the gradients are NaN only through the
    rows whose loss is NaN (a reader's G is NaN on V(t): its d index_weights on every head), so every other row's
    d index_q and d index_weights stay finite, and so does dk without readers. Until this round a masked row's inf
    or a block nobody reads made gradients NaN through 0 x inf in the products, differently in each
    implementation."""
    c, kw = make_student_case(11, seq=64, topk=topk, loss_mask=True, dtype=dtype)
    mask = np.asarray(kw["loss_mask"]).copy()
    readers, masked = [20, 25], [33, 45, 50, 63]
    mask[0, readers], mask[0, masked] = True, False
    kw = dict(kw, loss_mask=jnp.asarray(mask))
    n = c["index_k"].shape[1]
    c = dict(c, index_q=c["index_q"].at[0, 20, 0, 3].set(jnp.nan).at[0, 33, 1, 0].set(jnp.inf)
             .at[0, 45, 2].set(-jnp.inf),
             index_weights=c["index_weights"].at[0, 25, 0].set(jnp.inf).at[0, 50, 2].set(jnp.nan),
             # the last block is visible only to t = 63, which is masked
             index_k=c["index_k"].at[0, n - 1, 5].set(jnp.nan).at[0, n - 1, 6].set(-jnp.inf))
    args = [c[k] for k in ("index_q", "index_k", "index_weights", "q", "compressed_kv")]
    options = dict(target="per_head", reduction="none")
    rows = np.asarray(csa_pallas.fused_indexer_distill_loss(*args, **kw, **options, implementation="xla"))[0]
    got_rows = np.asarray(csa_pallas.fused_indexer_distill_loss(*args, **kw, **options, implementation="pallas",
                                                                student=student))[0]
    assert sorted(np.flatnonzero(np.isnan(rows))) == readers
    np.testing.assert_array_equal(np.isnan(got_rows), np.isnan(rows))
    np.testing.assert_allclose(np.nan_to_num(got_rows), np.nan_to_num(rows), rtol=1e-6, atol=1e-6)
    want = loss_and_grads(c, kw, target="per_head", reduction="sum", implementation="xla")
    got = loss_and_grads(c, kw, target="per_head", reduction="sum", implementation="pallas", student=student)
    (dq, dk, dw), (want_dq, want_dk, want_dw) = ([np.asarray(x, np.float64) for x in g] for g in (got[1], want[1]))
    for name, a, b in (("index_q", dq, want_dq), ("index_k", dk, want_dk), ("index_weights", dw, want_dw)):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=name)
        assert not np.isinf(a).any() and not np.isinf(b).any(), name
        scale = np.max(np.abs(np.nan_to_num(b)))
        tol = 1e-6 if dtype == jnp.float32 else 2.0 ** -8
        np.testing.assert_allclose(np.nan_to_num(a), np.nan_to_num(b), rtol=0, atol=tol * scale, err_msg=name)
    others = np.setdiff1d(np.arange(64), readers)
    assert np.all(np.isnan(want_dw[0, readers])) and np.all(np.isfinite(want_dw[0, others]))
    assert np.all(np.isfinite(want_dq[0, others])) and np.isfinite(want_dk[0, n - 1]).all()
    # the masked rows' gradients are exact zeros, whatever their inputs hold
    for x in (want_dq, want_dw, dq, dw):
        assert not np.any(x[0, masked])


def test_the_teacher_config_reaches_every_chunk(monkeypatch):
    """`config=` on the fused op forces the teacher kernel's variant as on indexer_distill_loss: dense mode in two
    query chunks with scores recomputed (cache_scores=False) and a 16-row query tile; every chunk's launch takes
    the forced fields, and the loss and gradients match the oracle."""
    from csa_pallas.kernels import teacher as teacher_kernel
    configs, launch = [], teacher_kernel.teacher_pallas
    monkeypatch.setattr(teacher_kernel, "teacher_pallas",
                        lambda *a, **k: configs.append(k["cfg"]) or launch(*a, **k))
    c, kw = make_student_case(29, seq=64, num_docs=2, loss_mask=True)
    check(c, kw, "joint", implementation="pallas", query_chunk=32,
          config={"cache_scores": False, "block_q": 16, "walk": "plain"})
    assert configs and all(not cfg.cache_scores and cfg.block_q == 16 for cfg in configs), configs


def test_tile_lists_reach_every_sparse_chunk(monkeypatch):
    """config={"path": "visit", "tile_list": True} on the fused op: every query chunk's teacher walks tile lists
    (a dynamic grid inside the chunks' loop; 3 kv tiles of 128 blocks), and the loss and gradients match the
    oracle."""
    from csa_pallas.kernels import teacher as teacher_kernel
    listed, launch = [], teacher_kernel.teacher_pallas
    monkeypatch.setattr(teacher_kernel, "teacher_pallas",
                        lambda *a, **k: listed.append(k["schedule"].listed) or launch(*a, **k))
    c, kw = make_student_case(31, seq=320, ratio=1, topk=12)
    check(c, kw, "per_head", implementation="pallas", query_chunk=160,
          config={"path": "visit", "tile_list": True, "block_q": 16, "block_k": 128})
    assert listed and all(listed), listed


@pytest.mark.parametrize("change, error, match", [
    (dict(config={"path": "gather", "q_in_place": True}), ValueError,
     r"config: 'q_in_place' True needs query chunks of fused_indexer_distill_loss"),
    (dict(config={"path": "gather", "q_in_place": True}, query_chunk=8), ValueError,
     r"config: 'q_in_place' True needs chunks of whole query tiles of both TensorCores \(2 x block_q = \d+ rows\), "
     r"got chunks of 8"),
    (dict(config={"path": "gather"}, student=sk.StudentKernelConfig()), ValueError,
     "config: path 'gather' cannot feed the visit student"),
    (dict(config={"walk": "plain"}, implementation="xla"), ValueError,
     "config: a kernel variant was given but the call runs the XLA reference"),
    (dict(config="plain"), TypeError, "config: expected None, a TeacherConfig or a dict of its fields, got str"),
    (dict(config={"path": "gather", "q_in_place": "yes"}), ValueError,
     "q_in_place: expected None, True or False, got 'yes'"),
], ids=["q_in_place_one_chunk", "q_in_place_partial_tiles", "gather_teacher_visit_student", "xla", "not_a_config",
        "q_in_place_not_bool"])
def test_teacher_config_errors_name_the_field(change, error, match):
    """Before any kernel runs (traced abstractly)."""
    c, kw = make_student_case(30, seq=64, topk=6)
    options = {"implementation": "pallas", **change}
    loss = lambda iq, ik, iw: csa_pallas.fused_indexer_distill_loss(iq, ik, iw, c["q"], c["compressed_kv"], **kw,
                                                                    target="per_head", reduction="sum", **options)
    with pytest.raises(error, match=match):
        jax.eval_shape(jax.value_and_grad(loss, argnums=(0, 1, 2)), c["index_q"], c["index_k"], c["index_weights"])


@pytest.mark.parametrize("student, topk, reduction", [
    ("xla", None, "sum"), ("xla", 7, "mean_all"), ("pallas", None, "sum"),
    (StudentGatherConfig(block_q=8), 7, "sum")], ids=["xla", "xla_sparse", "kernels", "gather"])
def test_bf16_index_k_gradient_sums_over_the_chunks_in_f32(student, topk, reduction):
    """bf16 indexer inputs over eight query chunks: index_k's cotangent is summed over the chunks in f32 and rounded
    to bf16 once (`student.with_f32_keys`), so it is within one rounding of the oracle (`check`). Until this round
    the XLA student rounded each chunk's d index_k to bf16 and summed the chunks in bf16 (SPEC §6: all
    accumulation in f32): 7.6e-3 of the gradient's max off at S = 112 in chunks of 8 (a randomised sweep)."""
    c, kw = make_student_case(21, batch=1, seq=64, index_heads=2, topk=topk, dtype=jnp.bfloat16)
    check(c, kw, "per_head", implementation="pallas", reduction=reduction, student=student, query_chunk=8)


@pytest.mark.parametrize("student", ["xla", "pallas"])
def test_bf16_index_k_gradient_of_per_row_losses_sums_over_the_chunks_in_f32(student):
    """reduction="none" through the rematerialised scan: index_k's cotangent accumulates over the chunks in f32
    (the scan's carry of a closed-over f32 index_k), one rounding to bf16 at the end, as the reference."""
    c, kw = make_student_case(22, batch=1, seq=64, index_heads=2, dtype=jnp.bfloat16)
    weights = jnp.asarray(np.random.default_rng(0).random((1, 64)), jnp.float32)

    def grad_k(implementation, **options):
        def f(ik):
            rows = csa_pallas.fused_indexer_distill_loss(c["index_q"], ik, c["index_weights"], c["q"],
                                                         c["compressed_kv"], **kw, target="per_head",
                                                         reduction="none", implementation=implementation, **options)
            return jnp.sum(rows * weights)
        return np.asarray(jax.jit(jax.grad(f), compiler_options=FAST)(c["index_k"]), np.float64)

    got, want = grad_k("pallas", student=student, query_chunk=8), grad_k("xla")
    # both the f32 sum rounded once: at most one bf16 ulp apart (the f32 sums differ by their own roundings)
    assert np.all(np.abs(got - want) <= 2.0 ** -7 * np.abs(want) + 1e-6 * np.max(np.abs(want)))
