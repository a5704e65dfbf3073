"""v5p AOT compiles of the sparse (top-k) kernels (real Mosaic + XLA:TPU compilers on a CPU host).

Forward + backward at the DeepSeek-V4-Flash shape (B=1, H=64, D=512, m=4, W=128, K=512, bf16) for S=4096 (N=1024,
the visit path), S=32768 (N=8192) and S=131072 (N=32768) (the gather path), both targets, plus the visit path
forced at 32K (also walking tile lists) and V4-Pro widths (H=128, K=1024): the program must compile and its temp
HBM must stay <= 1.25 x one [B, S, K] f32 array + 64 MiB (the valid-slot index array, the selection's bits and the
gather path's resident rows included).
"""

import pytest

from csa_pallas import aot

from aot_cases import large_constants, require_libtpu, sparse_input_structs, sparse_program

MiB = 1 << 20


# per_head at S = 4096 (the visit path) is compiled by tests/test_platform.py, within a tighter bound.
@pytest.mark.parametrize("target, seq", [("joint", 4096), ("per_head", 32768), ("joint", 32768),
                                         ("per_head", 131072), ("joint", 131072)])
def test_sparse_flash_shape_forward_backward_compiles_within_memory_bound(target, seq):
    require_libtpu()
    path = "visit" if seq == 4096 else "gather"
    compiled = aot.compile_for_tpu(sparse_program(target, expect_path=path), *sparse_input_structs(seq))
    report = aot.memory_report(compiled)
    one_target = seq * 512 * 4
    bound = 1.25 * one_target + 64 * MiB
    print(f"sparse AOT S={seq} {target}: {report}")
    assert 0 < report.temp_bytes <= bound, (report, bound)
    assert large_constants(compiled.as_text()) == []  # no folded metadata in the executable (test_aot_kernels)


@pytest.mark.parametrize("target, temp_mib", [("per_head", 192.5), ("joint", 320.7)])
def test_packed_documents_at_long_context_compile_within_memory_bound(target, temp_mib):
    """S = 128K with segment ids and positions passed (the gather path): the slot validity gathers each slot's
    block keys in XLA, in chunks of rows (`ops_sparse.packed_validity_chunk`). Over the whole sequence the
    gathered keys and clamped indices took 512.5 / 512.3 MiB of temp (per_head / joint), over the bound; in
    chunks 192.5 / 320.7 (default ids: 128.1 / 257)."""
    require_libtpu()
    seq = 131072
    report = aot.compile_memory(sparse_program(target, expect_path="gather"), *sparse_input_structs(seq, packed=True))
    bound = 1.25 * seq * 512 * 4 + 64 * MiB
    print(f"sparse AOT packed S={seq} {target}: {report}")
    assert 0 < report.temp_bytes <= min(bound, (temp_mib + 1) * MiB), (report, bound)


def test_sparse_head_major_rows_compile():
    # head_chunk 8 with bf16 is not a whole sublane tile: head-major rows; K=256 < N=256 tiles of 2.
    require_libtpu()
    aot.compile_for_tpu(sparse_program("joint", 8), *sparse_input_structs(1024, width=256))


@pytest.mark.parametrize("name, seq, heads, width, cfg, path", [
    ("flash_visit_forced", 32768, 64, 512, {"path": "visit"}, "visit"),
    ("flash_visit_tile_lists", 32768, 64, 512, {"path": "visit", "tile_list": True}, "visit"),  # a dynamic grid
    ("pro_k1024", 16384, 128, 1024, None, "visit"),  # N H / K = 512 < 600
    ("pro_k1024_32k", 32768, 128, 1024, None, "gather"),  # 1,024 >= 600
    ("pro_k1024_gather", 131072, 128, 1024, None, "gather"),
])
def test_sparse_long_context_paths_compile_within_memory_bound(name, seq, heads, width, cfg, path):
    require_libtpu()
    report = aot.compile_memory(sparse_program("per_head", cfg=cfg, expect_path=path),
                                *sparse_input_structs(seq, width=width, heads=heads))
    bound = 1.25 * seq * width * 4 + 64 * MiB
    print(f"sparse AOT {name} S={seq}: {report}")
    assert 0 < report.temp_bytes <= bound, (report, bound)
