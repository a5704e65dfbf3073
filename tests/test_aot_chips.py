"""The long-context programs compiled for the TPUs after v5p: v6e (Trillium, topology 'v6e:2x2') and TPU7x (Ironwood,
'tpu7x:2x2x1', one device per TensorCore), through libtpu's real compilers on a CPU host, as the v5p tests do.

The kernels' configurations come from the v5p heuristics (`kernels.teacher_config.CHIPS` has one entry; the
estimates are v5p's): these compiles check that Mosaic for the newer chips accepts, with them, the kernels the
long-context defaults run (the dense teacher with the fused KL; the window LSE; the sparse visit path's block and
slot bits and its teacher; the sparse gather teacher; the fused student's tiled kernels and its one gather kernel)
and that no program keeps a scores-sized array, within the bounds of the v5p tests. The other variants compile for
v5p (`test_variants.py`, the other test_aot_* files). Shapes: DeepSeek-V4-Flash (B=1, H=64, D=512, m=4, W=128,
bf16; K=512; indexer H_I=64, d_I=128), forward + backward.
"""

import re

import jax
import jax.numpy as jnp
import pytest

import csa_pallas
from aot_cases import require_libtpu, sparse_input_structs, sparse_program
from csa_pallas import aot
from csa_pallas.kernels import student_scores

MiB = 1 << 20
B, H, D, W, K, H_I, D_I = 1, 64, 512, 128, 512, 64, 128
CHIPS = pytest.mark.parametrize("topology", ["v6e:2x2", "tpu7x:2x2x1"], ids=["v6e", "tpu7x"])
# The tiled student kernels' quickest-compiling tiles (the default tiles take ~35 s more per chip; they compile for
# v5p in test_aot_student.py): what is checked here is that the kernel family compiles for the chip.
LIGHT_TILES = student_scores.StudentKernelConfig(block_q=128, block_k=256)


def _structs(*shapes_and_dtypes):
    return [aot.struct(shape, dtype) for shape, dtype in shapes_and_dtypes]


def _fused_program(target: str, student):
    def program(iq, ik, iw, q, kv, window_kv, sinks, topk=None):
        extra = dict(window_kv=window_kv, sinks=sinks, window_size=W) if target == "joint" else {}
        loss = lambda *x: csa_pallas.fused_indexer_distill_loss(  # noqa: E731
            *x, q, kv, topk_indices=topk, target=target, student=student, **extra)
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(iq, ik, iw)
    return program


def _fused_inputs(seq: int, sparse: bool):
    n, bf16 = seq // 4, jnp.bfloat16
    structs = _structs(((B, seq, H_I, D_I), bf16), ((B, n, D_I), bf16), ((B, seq, H_I), bf16),
                       ((B, seq, H, D), bf16), ((B, n, D), bf16), ((B, seq, D), bf16), ((H,), jnp.float32))
    return structs + (_structs(((B, seq, K), jnp.int32)) if sparse else [])


# (program, inputs, kernels that must be in it, working-HBM bound in bytes). The fused op holds the loss's kernels and
# the student's: dense, the joint teacher with the fused KL, the window LSE and the tiled student kernels; sparse at
# 32K, the gather teacher and the one student gather kernel. The bounds: the fused op's 64 MiB + the row statistics
# (test_aot_student.py); the sparse loss's 1.25 x one f32 [B, S, K] + 64 MiB (test_aot_sparse.py, whose program this
# is).
CASES = {
    "fused_dense_joint_32k": (_fused_program("joint", LIGHT_TILES), _fused_inputs(32768, False),
                              ("csa_teacher_joint", "csa_window_lse", "csa_student_scores", "csa_student_grads"),
                              66 * MiB),
    "fused_sparse_joint_32k": (_fused_program("joint", "auto"), _fused_inputs(32768, True),
                               ("csa_sparse_gather", "csa_window_lse", "csa_student_gather_kl_grads"), 66 * MiB),
    "sparse_16k_visit": (sparse_program("per_head", expect_path="visit"), sparse_input_structs(16384),
                         ("csa_block_bits", "csa_sparse_teacher"), 1.25 * 16384 * K * 4 + 64 * MiB),
}


@CHIPS
@pytest.mark.parametrize("case", list(CASES))
def test_long_context_programs_compile_for_newer_chips(topology, case):
    require_libtpu()
    program, inputs, kernels, bound = CASES[case]
    compiled = aot.compile_for_tpu(program, *inputs, topology=topology)
    text = compiled.as_text()
    missing = [name for name in kernels if name not in text]
    assert not missing, (missing, sorted(set(re.findall(r"csa_\w+", text))))
    report = aot.memory_report(compiled)
    print(f"{topology} {case}: {report}")
    # working (>= temp), not temp: v6e's temp leaves out working buffers that its own peak counts (`aot.MemoryReport`)
    assert report.working_bytes <= bound, (report, bound)
