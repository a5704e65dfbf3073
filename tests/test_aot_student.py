"""The fused student (SPEC §8) compiled for one v5p chip at long context: Mosaic kernels present, no array with
the [B, S, N] shape's size indexed by blocks anywhere in the program (arguments, outputs or temps), and the temp
HBM of `memory_analysis()` within the query-chunked path's budget.

Flash widths (H = 64, D = 512, m = 4), indexer H_I = 64, d_I = 128, bf16, dense per_head, forward + backward wrt
the three indexer tensors, default chunks (the student kernels; query chunks of 256 rows at 32K, 64 at 128K; one
chunk at 4K, where the unchunked program fits). The student kernels alone compile at S = 4096 for every tile and
operand variant.
"""

import re

import jax
import jax.numpy as jnp
import pytest

import csa_pallas
from aot_cases import require_libtpu
from csa_pallas import aot, ops_sparse
from csa_pallas.kernels import student_gather, student_gather_kl, student_scores

MiB = 1 << 20
B, H, D, H_I, D_I = 1, 64, 512, 64, 128
# The sharded compiles force the kernels' quickest-compiling tiles (7 s against the default's 23): what they test is
# the partitioning; the default tiles compile in the unsharded tests.
LIGHT_TILES = student_scores.StudentKernelConfig(block_q=128, block_k=256)


def _compile(seq: int, topk=None):
    n = seq // 4
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    extra = [] if topk is None else [jax.ShapeDtypeStruct((B, seq, topk), jnp.int32)]

    def fused(iq, ik, iw, q, kv, topk_indices=None):
        return jax.value_and_grad(lambda *x: csa_pallas.fused_indexer_distill_loss(
            *x, q, kv, topk_indices=topk_indices, target="per_head"), argnums=(0, 1, 2))(iq, ik, iw)
    return aot.compile_for_tpu(fused, bf16(B, seq, H_I, D_I), bf16(B, n, D_I), bf16(B, seq, H_I), bf16(B, seq, H, D),
                               bf16(B, n, D), *extra)


def block_indexed_arrays(hlo_text: str, seq: int, num_blocks: int) -> list:
    """Shapes in the program with a blocks dimension (N, or N padded to 128 lanes) and >= B * S * N elements."""
    padded = -(-num_blocks // 128) * 128
    out = []
    for dims in set(re.findall(r"\[([0-9,]+)\]", hlo_text)):
        sizes = [int(d) for d in dims.split(",") if d]
        count = 1
        for d in sizes:
            count *= d
        if (num_blocks in sizes or padded in sizes) and count >= B * seq * num_blocks:
            out.append(sizes)
    return out


@pytest.mark.parametrize("seq, topk, temp_mib", [(32768, None, 50), (131072, None, 66), (32768, 512, 16),
                                                (131072, 512, 66)])
def test_no_scores_sized_array_at_long_context(seq, topk, temp_mib):
    require_libtpu()
    compiled = _compile(seq, topk)
    text = compiled.as_text()
    assert "tpu_custom_call" in text  # the teacher + fused KL kernels, compiled by Mosaic
    if topk is None:  # dense: the tiled student kernels
        assert "csa_student_scores" in text and "csa_student_grads" in text
    else:  # sparse: the one gather kernel of scores, KL and gradients (index_k resident in VMEM)
        assert "csa_student_gather_kl_grads" in text and "csa_student_gather_scores" not in text
        # the gather teacher reads each chunk's q rows in place (`Problem.q_window`): no [B, chunk, H, D] copy
        chunk_copies = [rows for rows in re.findall(rf"bf16\[{B},(\d+),{H},{D}\]", text) if int(rows) < seq]
        assert chunk_copies == [], chunk_copies
        # ... and the student kernel each chunk's index_q rows, and writes their gradient, in place
        # (`student_gather_kl.rows_in_place_ok`): no [chunk, H_I, d_I] copy in either layout
        index_copies = [rows for rows in re.findall(rf"bf16\[(?:{B},)?(\d+),{H_I},{D_I}\]", text) if int(rows) < seq]
        assert index_copies == [], index_copies
    assert block_indexed_arrays(text, seq, seq // 4) == []
    report = aot.memory_report(compiled)
    # Dense: 32K 45.8 MiB measured (256-row chunks), 128K 63.4 MiB (64 rows): the bound (dense warm-up)
    # is 64 MiB + the row statistics (per-row KL f32 and non-empty flags stacked over the chunks, 1 MiB each at
    # 128K), asserted as 66 MiB; compressed_kv is read as given (the chunks make the readers of a non-finite block
    # NaN through their query rows), no NaN-filled copy (32 MiB at 128K). Sparse K = 512 (the student's gather
    # kernels, chunks of 512 rows): 32K 12.7 MiB, 128K 53.9 MiB, within the dense bound too (the student's
    # resident f32 keys, 16 MiB, and the two TensorCores' running dk sums, 2 x 16 MiB, which the student kernel
    # adds to in place, as it reads a chunk's index_q rows and writes their gradient in place; the teacher's
    # kernel packs its resident rows itself. 20.8 / 101.9 MiB with the resident rows packed once in HBM, 32 MiB
    # at 128K, and a chunk's index_q rows and their gradient copied, 8 MiB each; 32.9 / 123.5 while each chunk's
    # q rows were copied, [chunk, H, D], and each chunk's dk partial sums added in XLA; the XLA student took
    # 67.9 / 95.2; issue 16's sparse bound at 128K is 1.25 [B, S, K] f32 + 64 MiB = 384 MiB).
    # One [B, S, N] f32: 1 / 16 GiB.
    assert 0 < report.temp_bytes <= temp_mib * MiB, report


@pytest.mark.parametrize("topk, temp_mib", [(None, 44), (512, 56)], ids=["dense", "sparse_k512"])
def test_short_context_runs_in_one_query_chunk(topk, temp_mib):
    """S = 4096 with default chunks is one query chunk (`student_plan.default_query_chunk`): no chunk's copy of
    q's rows ([B, chunk, H, D], chunk < S) in the program, and the unchunked program's temp (measured 40.4 MiB
    dense; sparse 52.9 with the visit student, whose [S, N] arrays are dense mode's plus the block-order target
    and the duplicate counts' branch, 22.6 with the gather student; the two dense chunks it used to take needed
    184.0 MiB, the eight sparse ones 42.4). The default student tiles with the causal schedule from the grid (sparse:
    the visit student, `student_plan.visit_rule`, with the teacher's block-order target and the KL over blocks),
    and, dense, index_q and its gradient pass between the program and the kernels as bitcasts (no relayout copy of
    an index_q-sized array; the [B, S, H_I * d_I] lane layout cost two, 48.5 us each at this shape)."""
    require_libtpu()
    seq = 4096
    compiled = _compile(seq, topk)
    text = compiled.as_text()
    chunk_copies = [rows for rows in re.findall(rf"bf16\[{B},(\d+),{H},{D}\]", text) if int(rows) < seq]
    assert chunk_copies == [], chunk_copies
    assert 0 < aot.memory_report(compiled).temp_bytes <= temp_mib * MiB
    assert "csa_student_scores" in text and "csa_student_grads" in text
    if topk is None:  # sparse "mean" divides by a data-dependent row count: one scaling pass over the gradient
        assert _relayouts(text, seq) == []
    else:
        assert re.search(r"csa_sparse_teacher_\w*_blocks", text) and "csa_kl_fwd" in text and "csa_kl_bwd" in text
        assert "csa_student_gather" not in text


@pytest.mark.parametrize("target, head_chunk, config", [
    ("joint", None, {"cache_scores": False}),  # pass 2 recomputes the scores and each tile's slot counts
    ("per_head", 16, None),  # head chunks: the block sums rescaled across chunks
])
def test_block_order_teacher_variants_compile(target, head_chunk, config):
    """The visit student's block-order target (`sparse_blocks.block_target`) in the variants the fused op's 4K
    default does not take, Flash widths, S = 2048, K = 512 (N = 512)."""
    require_libtpu()
    from csa_pallas import sparse_blocks, validation
    seq, k = 2048, 512

    def target_of(q, kv, topk, window_kv, sinks):
        extra = dict(window_kv=window_kv, sinks=sinks) if target == "joint" else {}
        problem = validation.validate(q, kv, topk_indices=topk, target=target, head_chunk=head_chunk,
                                      window_size=128, implementation="pallas", **extra)
        layout = ops_sparse.sparse_layout(problem, dict(config or {}, path="visit"))
        return sparse_blocks.block_target(problem, layout)[0]
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    compiled = aot.compile_for_tpu(target_of, bf16(B, seq, H, D), bf16(B, seq // 4, D),
                                   jax.ShapeDtypeStruct((B, seq, k), jnp.int32), bf16(B, seq, D),
                                   jax.ShapeDtypeStruct((H,), jnp.float32))
    assert re.search(r"csa_sparse_teacher_\w*_blocks", compiled.as_text())


_QUICK = student_scores.StudentKernelConfig(block_q=64, block_k=256)


@pytest.mark.parametrize("config, q_dtype, k_dtype, causal", [
    (student_scores.StudentKernelConfig(block_q=64, block_k=256, trim_kv_tile=False), jnp.bfloat16, jnp.bfloat16,
     None),
    (_QUICK, jnp.float32, jnp.float32, 4),
    (_QUICK, jnp.bfloat16, jnp.float32, 4),  # bf16 head pairs, f32 operands
    (_QUICK, jnp.float32, jnp.bfloat16, None)])
def test_student_kernels_compile(config, q_dtype, k_dtype, causal):
    """Forward and backward kernels at S = 4096, N = 1024, H_I = 64, d_I = 128 (bf16: one MXU pass forward, hi + lo
    backward; f32 or mixed: HIGHEST), the skipped tiles and trimmed prefixes from the table or (causal=m) from the
    grid, kv tiles trimmed or whole. The default tiles compile inside the fused op: their table schedule in the
    32K test above (query chunks), the grid's causal schedule in test_short_context_runs_in_one_query_chunk."""
    require_libtpu()
    seq, n = 4096, 1024
    struct = lambda dtype, *shape: jax.ShapeDtypeStruct(shape, dtype)

    def grads(iq, ik, iw, g):
        pos = jnp.arange(seq, dtype=jnp.int32)[None]
        end = (jnp.arange(n, dtype=jnp.int32) * 4 + 3)[None]
        run = lambda *x: student_scores.scores(*x, pos, end, config, causal_ratio=causal)
        return jax.value_and_grad(lambda *x: jnp.sum(run(*x) * g), argnums=(0, 1, 2))(iq, ik, iw)
    compiled = aot.compile_for_tpu(grads, struct(q_dtype, B, seq, H_I, D_I), struct(k_dtype, B, n, D_I),
                                   struct(q_dtype, B, seq, H_I),
                                   jax.ShapeDtypeStruct((B, seq, n), jnp.float32))
    text = compiled.as_text()
    assert "csa_student_scores" in text and "csa_student_grads" in text
    assert _relayouts(text, seq) == []


def _relayouts(hlo_text: str, seq: int) -> list:
    """(op, dims) of the XLA ops that write an index_q-sized array other than by a bitcast."""
    return [(op, dims) for dims, op in re.findall(r"= \w+\[([0-9,]+)\]\{[^}]*\} ([\w-]+)\(", hlo_text)
            if _count(dims) == B * seq * H_I * D_I and op not in _BITCAST_OPS]


_BITCAST_OPS = ("parameter", "bitcast", "custom-call", "get-tuple-element")


def _count(dims: str) -> int:
    count = 1
    for d in dims.split(","):
        count *= int(d)
    return count


@pytest.mark.parametrize("axes, batch, temp_mib", [({"seq": 8}, 1, 60), ({"data": 2, "heads": 4}, 2, 2100)],
                         ids=["seq8", "data2_heads4"])
def test_sharded_fused_op_compiles_on_a_v5p_slice(axes, batch, temp_mib):
    """`sharded_fused_indexer_distill_loss` on v5p:2x2x2 (8 chips) at S = 32768: Mosaic student kernels on every
    device. seq8 (the query-chunked path per device): no array of one batch row's [S, N] size indexed by blocks.
    data2_heads4: the attention heads' teacher sums are reduce-scattered over the head axis (as in the plain
    sharded loss), so one device-local [1, S, N] f32 head sum exists; the student scores only its owned rows."""
    require_libtpu()
    from jax.sharding import PartitionSpec as P
    seq, topology = 32768, "v5p:2x2x2"
    n = seq // 4
    mesh = aot.tpu_mesh(topology, axes)
    b = ("data",) if "data" in axes else None
    s_ax = "seq" if "seq" in axes else None
    h_ax = "heads" if "heads" in axes else None
    st = lambda shape, spec: aot.sharded_struct(shape, jnp.bfloat16, mesh, spec)

    def program(iq, ik, iw, q, kv):
        loss = lambda *x: csa_pallas.sharded_fused_indexer_distill_loss(
            mesh, *x, q, kv, batch_axes=b, head_axis=h_ax, seq_axis=s_ax, target="per_head", student=LIGHT_TILES)
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(iq, ik, iw)
    compiled = aot.compile_for_tpu(
        program, st((batch, seq, H_I, D_I), P(b, s_ax, None, None)), st((batch, n, D_I), P(b, None, None)),
        st((batch, seq, H_I), P(b, s_ax, None)), st((batch, seq, H, D), P(b, s_ax, h_ax, None)),
        st((batch, n, D), P(b, None, None)), topology=topology)
    text = compiled.as_text()
    assert "csa_student_scores" in text and "csa_student_grads" in text
    found = block_indexed_arrays(text, seq, n)
    assert found == ([] if h_ax is None else [[1, seq, n]]), found
    # seq8: 53.4 MiB measured (256-row chunks); data2_heads4: 2,049 MiB (the [1, S, N] f32 head sum and its
    # reduce-scatter, 1 GiB each - the plain sharded loss's cost of head sharding at 32K).
    assert 0 < aot.memory_report(compiled).temp_bytes <= temp_mib * MiB


@pytest.mark.parametrize("rows, dk", [(False, False), (True, True)], ids=["copies_and_xla_sums", "in_place"])
def test_the_one_kernel_pass_compiles_with_its_chunk_operands_either_way(rows, dk):
    """Sparse K = 512 at S = 8192 in 4 query chunks with `StudentGatherConfig(rows_in_place, dk_in_place)` and the
    gather teacher's `q_in_place` (`config=`) forced both ways (the defaults take all three in place): the one
    kernel and the teacher compile with and without their in-place operands (each in-place variant's name
    present exactly when forced)."""
    require_libtpu()
    from csa_pallas.kernels.student_gather import StudentGatherConfig
    seq, k = 8192, 512
    n = seq // 4
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)

    def fused(iq, ik, iw, q, kv, topk):
        return jax.value_and_grad(lambda *x: csa_pallas.fused_indexer_distill_loss(
            *x, q, kv, topk_indices=topk, target="per_head", query_chunk=seq // 4,
            student=StudentGatherConfig(rows_in_place=rows, dk_in_place=dk),
            config={"path": "gather", "q_in_place": rows}), argnums=(0, 1, 2))(iq, ik, iw)
    text = aot.compile_for_tpu(fused, bf16(B, seq, H_I, D_I), bf16(B, n, D_I), bf16(B, seq, H_I),
                               bf16(B, seq, H, D), bf16(B, n, D), jax.ShapeDtypeStruct((B, seq, k), jnp.int32)
                               ).as_text()
    assert ("csa_student_gather_kl_grads_bq8_in_place" in text) == rows
    assert "csa_student_gather_kl_grads_bq8" in text
    assert ("csa_sparse_gather_per_head_bq8_q_in_place" in text) == rows, re.findall(r"csa_sparse_gather\w*", text)


def test_head_sharded_sparse_fused_op_compiles_with_the_one_kernel_gradient_pass():
    """Sparse K = 512 at S = 4096 on v5p:2x2x2 with data 2 x heads 4: each head shard's owned rows run
    `student_gather_kl` (scores, KL against the reduce-scattered P, gradients) inside shard_map."""
    require_libtpu()
    from jax.sharding import PartitionSpec as P
    seq, k, topology, axes = 4096, 512, "v5p:2x2x2", {"data": 2, "heads": 4}
    n = seq // 4
    mesh = aot.tpu_mesh(topology, axes)
    st = lambda shape, spec, dtype=jnp.bfloat16: aot.sharded_struct(shape, dtype, mesh, spec)

    def program(iq, ik, iw, q, kv, topk):
        loss = lambda *x: csa_pallas.sharded_fused_indexer_distill_loss(
            mesh, *x, q, kv, topk_indices=topk, batch_axes=("data",), head_axis="heads", target="per_head")
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(iq, ik, iw)
    compiled = aot.compile_for_tpu(
        program, st((2, seq, H_I, D_I), P("data", None, None, None)), st((2, n, D_I), P("data", None, None)),
        st((2, seq, H_I), P("data", None, None)), st((2, seq, H, D), P("data", None, "heads", None)),
        st((2, n, D), P("data", None, None)), st((2, seq, k), P("data", None, None), jnp.int32), topology=topology)
    text = compiled.as_text()
    assert "csa_student_gather_kl_grads" in text and "csa_student_gather_scores" not in text


def test_sequence_sharded_sparse_fused_op_compiles_with_the_visit_student():
    """Sparse K = 512 at S = 4096 on v5p:2x2x2 with the sequence over 8 chips: each device's 512 query rows run the
    visit student (`student_plan.visit_rule` on the local problem) inside shard_map."""
    require_libtpu()
    from jax.sharding import PartitionSpec as P
    seq, k, topology, axes = 4096, 512, "v5p:2x2x2", {"seq": 8}
    n = seq // 4
    mesh = aot.tpu_mesh(topology, axes)
    st = lambda shape, spec, dtype=jnp.bfloat16: aot.sharded_struct(shape, dtype, mesh, spec)

    def program(iq, ik, iw, q, kv, topk):
        loss = lambda *x: csa_pallas.sharded_fused_indexer_distill_loss(
            mesh, *x, q, kv, topk_indices=topk, seq_axis="seq", target="per_head")
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(iq, ik, iw)
    compiled = aot.compile_for_tpu(
        program, st((B, seq, H_I, D_I), P(None, "seq", None, None)), st((B, n, D_I), P(None, None, None)),
        st((B, seq, H_I), P(None, "seq", None)), st((B, seq, H, D), P(None, "seq", None, None)),
        st((B, n, D), P(None, None, None)), st((B, seq, k), P(None, "seq", None), jnp.int32), topology=topology)
    text = compiled.as_text()
    assert "csa_student_scores" in text and "csa_student_grads" in text and "csa_student_gather" not in text
    assert re.search(r"csa_sparse_teacher_\w*_blocks", text)


@pytest.mark.parametrize("q_dtype, k_dtype, config", [
    (jnp.bfloat16, jnp.bfloat16, None), (jnp.float32, jnp.float32, None),
    (jnp.bfloat16, jnp.float32, None),  # bf16 queries, f32 operands
    (jnp.bfloat16, jnp.bfloat16, student_gather.StudentGatherConfig(block_q=16))])
def test_sparse_student_gather_kernels_compile(q_dtype, k_dtype, config):
    """The gather kernels alone, S = 4096, K = 512, N = 1024, H_I = 64, d_I = 128, in one program: the scores
    kernel and its gradient kernel, and the one-kernel scores + KL + gradients (`student_gather_kl`); bf16 (one
    MXU pass forward, hi + lo backward), f32 or mixed (HIGHEST), a forced taller query tile."""
    require_libtpu()
    seq, n, k = 4096, 1024, 512
    operand = student_scores.operand_dtype(q_dtype, k_dtype)

    def grads(iq, ik, iw, topk, g):
        run = lambda q, kk, w: student_gather.scores(q, student_gather.resident_keys(kk), w, topk, operand, config)
        two_kernels = jax.value_and_grad(lambda *x: jnp.sum(run(*x) * g), argnums=(0, 1, 2))(iq, ik, iw)
        one_kernel = student_gather_kl.loss_and_grads(iq, student_gather.resident_keys(ik), iw, topk, g, operand,
                                                      config)
        return two_kernels, one_kernel
    struct = lambda dtype, *shape: jax.ShapeDtypeStruct(shape, dtype)
    compiled = aot.compile_for_tpu(grads, struct(q_dtype, B, seq, H_I, D_I), struct(k_dtype, B, n, D_I),
                                   struct(q_dtype, B, seq, H_I), jax.ShapeDtypeStruct((B, seq, k), jnp.int32),
                                   jax.ShapeDtypeStruct((B, seq, k), jnp.float32))
    text = compiled.as_text()
    assert "csa_student_gather_scores" in text and "csa_student_gather_grads" in text
    assert "csa_student_gather_kl_grads" in text
