"""How the fused op runs its student (SPEC §8): which kernels (the choice between the dense-mode tiles, sparse mode's
visit student and gather kernels, and the XLA student) and in which query chunks (the memory model, measured on
v5p compiles). `fused_student` runs what this decides.
"""

from __future__ import annotations

from csa_pallas import validation
from csa_pallas.kernels import common, student_gather, student_scores
from csa_pallas.validation import Problem

TARGET_CHUNK_BYTES = 64 << 20  # the scores of one chunk, their gradient and the student terms, per batch row
MIN_QUERY_CHUNK = 64


def default_index_head_chunk(num_index_heads: int, sparse: bool = False) -> int:
    """The XLA student's heads per step on the chunked path: the largest divisor of H_I that is <= 8 in dense mode
    (its [chunk, heads, N] terms are most of a chunk's memory), <= 32 in sparse mode ([chunk, heads, K] terms are
    small; each step re-reads and re-accumulates the gathered keys' f32 cotangent, [chunk, K, d_I]). Sparse
    estimates at S = 32K, K = 512, H_I = 64, d_I = 128 (fused op, forward + backward, BEST ESTIMATE): 284 / 184 /
    133 / 110 ms at 4 / 8 / 16 / 32 heads per step; 64 (no scan) is 193, of which 101 is the estimator's HBM
    floor counting the whole index_q for a fusion that slices one chunk of it (its bundle estimate: 88 vs 94)."""
    limit = 32 if sparse else 8
    return max(c for c in range(1, min(num_index_heads, limit) + 1) if num_index_heads % c == 0)


def unchunked_row_bytes(problem: Problem, visit: bool = False) -> int:
    """Temp HBM per query row of the fused op in one chunk with the student kernels, per batch row: ~2.5 f32 [S, W]
    arrays (W = N dense, K sparse), and in sparse mode ~2 bytes per block more (the selection's block bits and
    tables). Measured on v5p compiles (Flash widths, H_I = 64, d_I = 128, forward + backward): dense 40.4 / 136.6
    MiB at S = 4K / 8K (model 40 / 160); sparse K = 512 22.6 / 64.6 / 168.6 MiB at 4K / 8K / 16K (model 28 / 72
    / 208). visit: the visit student's arrays are [S, N] (`student_width`)."""
    row = 10 * student_width(problem, visit)
    return row + 2 * problem.num_blocks if problem.sparse else row


def student_width(problem: Problem, visit: bool = False) -> int:
    """W of the student's [rows, W] arrays: N in dense mode and for the visit student, K for the others."""
    return max(problem.num_blocks if visit or not problem.sparse else problem.width, 1)


def default_query_chunk(problem: Problem, index_head_chunk: int, index_dim: int = 0,
                        student_kernels: bool = False, index_heads: int = 0, visit: bool = False) -> int:
    """The largest divisor of S (a multiple of 8, or S itself) whose chunk keeps one batch row's f32 [chunk, W]
    arrays within TARGET_CHUNK_BYTES, counted from v5p compiles: with the XLA student ~2 index_head_chunk + 10 of
    them (its ReLU terms and dot products with their gradients, the scores and theirs, the kernel's operands);
    with the student kernels (their terms stay in VMEM; the gradient in the forward pass) ~5 (S = 32K temp: 34,
    54, 91, 164 MiB at 128, 256, 512, 1024 rows). Sparse mode adds the XLA student's gathered keys,
    [chunk, K, d_I] f32 and their cotangent plus a bf16 copy (index_dim = d_I); with the sparse student kernels
    ~9 bytes per index_q element instead (its padded copy and dq; S = 32K, K = 512, H_I = 64, d_I = 128: temp
    20.8 / 32.9 / 85.3 MiB at 256 / 512 / 1024 rows, static estimate 45.9 / 46.0 / 45.5 ms).

    With the student kernels, S in one chunk whenever the unchunked program fits TARGET_CHUNK_BYTES
    (`unchunked_row_bytes`): chunking adds each chunk's copy of its q rows ([chunk, H, D], which the teacher's
    blocks are sliced from; in dense mode also made NaN on the readers of a non-finite block) and of index_q,
    which at short context costs more memory and time than it saves (v5p, Flash widths, S = 4K: dense 184.0 MiB
    temp in two chunks against 40.4 in one, sparse K = 512 42.4 in eight against 22.6). visit: sparse mode's
    visit student (dense mode's kernels over [rows, N], `sparse_blocks`), counted as dense mode."""
    s, n = problem.seq_len, student_width(problem, visit)
    if student_kernels and s * unchunked_row_bytes(problem, visit) <= TARGET_CHUNK_BYTES:
        return s
    per_row = 4 * n * (5 if student_kernels else 2 * index_head_chunk + 10)
    if problem.sparse and not visit:
        per_row += 9 * index_heads * index_dim if student_kernels else 10 * n * index_dim
    # At least MIN_QUERY_CHUNK rows: below, the kernels' query tiles run part-empty and the fixed per-chunk memory
    # grows (v5p compiles at S = 128K: 16-row chunks took ~40% more temp than 64-row ones).
    limit = max(TARGET_CHUNK_BYTES // per_row, MIN_QUERY_CHUNK)
    if s <= limit:
        return s
    fits = [c for c in range(8, limit + 1, 8) if s % c == 0]
    return max(fits) if fits else s


def check_query_chunk(query_chunk, seq_len: int) -> int:
    chunk = validation._check_positive_int("query_chunk", query_chunk)
    if seq_len % chunk:
        raise ValueError(f"query_chunk: expected a divisor of S={seq_len}, got {chunk}")
    return chunk


STUDENTS = ("auto", "pallas", "xla")


CONFIGS = (student_scores.StudentKernelConfig, student_gather.StudentGatherConfig)


def visit_rule(problem: Problem) -> bool:
    """Sparse mode's default student kernels: the visit student (dense mode's kernels over every visible block and
    the KL over blocks, `sparse_blocks`) where the sparse teacher takes its visit path (`ops_sparse.choose_path`)
    and the visit student's whole program fits one query chunk (`unchunked_row_bytes`, ~12 N bytes per row),
    else the gather kernels (~K slots per query at ~4 cycles each). The visit student costs ~S N / 2 (the dense
    student) plus the visit teacher (~S N H), the gather student ~S K; static v5p estimates of the fused op
    (Flash widths, K = 512, H_I = 64, d_I = 128, forward + backward, no repeated index): S = 4K 1.57 ms visit
    (one chunk, 52.9 MiB temp) against 3.51 gather; S = 8K 5.6 visit in one chunk against ~8.0 gather (the
    teacher 2.8 + the gather kernel 5.2), but with 275 MiB of temp against 38, over the chunk budget that dense
    mode keeps too (in 1024-row chunks the student kernels take table schedules, which a static estimate cannot
    resolve). So the default takes it where it fits one chunk, S <= ~4.7K at m = 4; `student=StudentKernelConfig()`
    forces it beyond."""
    from csa_pallas import ops_sparse
    fits = problem.seq_len * unchunked_row_bytes(problem, visit=True) <= TARGET_CHUNK_BYTES
    return fits and ops_sparse.choose_path(problem, ops_sparse.forced_path(problem.layout_config)) == "visit"


def resolve_student(student, problem: Problem, index_q_shape):
    """student ("auto", "pallas", "xla", a `StudentKernelConfig` or, sparse mode only, a `StudentGatherConfig`)
    -> (use the kernels, the forced config or None). "auto": the kernels (dense: the tiled student kernels;
    sparse: `visit_rule` picks the visit student (the tiled kernels, a StudentKernelConfig) or the gather kernels,
    `kernels/student_gather.py`, while index_k fits resident in VMEM). index_q_shape: [B, S, H_I, d_I] (the gather
    kernels' VMEM need)."""
    forced = student if isinstance(student, CONFIGS) else None
    if forced is None:
        validation.check_choice("student", student, STUDENTS)
        if student == "xla":
            return False, None
    if forced is not None and not problem.sparse and not isinstance(forced, student_scores.StudentKernelConfig):
        raise ValueError(f"student: dense mode's kernels take a StudentKernelConfig, got {type(forced).__name__}")
    if problem.sparse and forced is None and not visit_rule(problem) and gather_config(
            problem, index_q_shape) is None:
        if student == "auto":
            return False, None
        raise ValueError(f"student: the sparse student kernels keep index_k resident in VMEM, which N="
                         f"{problem.num_blocks} does not fit; take student='auto' or 'xla'")
    if problem.sparse and isinstance(forced, student_gather.StudentGatherConfig):
        _check_gather_vmem(forced, problem, index_q_shape)
    return True, forced


def visit_student(student, problem: Problem, index_q_shape) -> bool:
    """Sparse mode with the student kernels over blocks (forced by a `StudentKernelConfig`, or `visit_rule`)."""
    if not problem.sparse:
        return False
    use_kernels, forced = resolve_student(student, problem, index_q_shape)
    if forced is not None:
        return isinstance(forced, student_scores.StudentKernelConfig)
    return use_kernels and visit_rule(problem)


def _check_gather_vmem(cfg, problem: Problem, index_q_shape):
    """A forced StudentGatherConfig whose VMEM limit is below its kernels' need (`student_gather.vmem_bytes`: the
    resident keys and dk's accumulator grow with N) is a ValueError here, not a Mosaic VMEM overflow at compile
    time (or an interpreter run that a TPU would refuse)."""
    heads, dim = index_q_shape[2:]
    need = student_gather.vmem_bytes(cfg, num_blocks=problem.num_blocks, heads=heads, head_dim=dim,
                                     width=common.round_up(problem.width, common.LANES))
    if need > cfg.vmem_limit_bytes:
        raise ValueError(
            f"student: StudentGatherConfig.vmem_limit_bytes: expected at least {need} bytes (the gather kernels' "
            f"VMEM at N={problem.num_blocks}, H_I={heads}, d_I={dim}, K={problem.width}, block_q={cfg.block_q}, "
            f"fuse_kl={cfg.fuse_kl}), got {cfg.vmem_limit_bytes}; student_gather.default_config sizes it")


def kernel_config(student, problem: Problem, index_q_shape, rows=None):
    """The config the student kernels run with (the forced one, else the default for a chunk of `rows` query rows,
    S when None), or None where `resolve_student` takes the XLA student."""
    use_kernels, forced = resolve_student(student, problem, index_q_shape)
    if not use_kernels or forced is not None:
        return forced
    if problem.sparse and not visit_rule(problem):
        return gather_config(problem, index_q_shape)
    return student_scores.default_config(seq_len=rows or problem.seq_len, num_blocks=problem.num_blocks)


def slot_order_config(student, problem: Problem, index_q_shape):
    """Sparse mode against a slot-order target (the head-sharded rows of `sharded_student`, whose P arrives from the
    heads' shards in slot order): the gather kernels' config (forced, or the default while index_k fits), or None
    (the XLA student). The visit student needs the block-order target: a StudentKernelConfig is a ValueError."""
    use_kernels, forced = resolve_student(student, problem, index_q_shape)
    if isinstance(forced, student_scores.StudentKernelConfig):
        raise ValueError("student: with a head axis, sparse mode's rows take the gather kernels (their target is in "
                         "slot order); got a StudentKernelConfig, take a StudentGatherConfig, 'auto' or 'xla'")
    if not use_kernels:
        return None
    return forced if forced is not None else gather_config(problem, index_q_shape)


def gather_config(problem: Problem, index_q_shape):
    """The sparse student kernels' default config, or None when they do not fit (`student_gather`)."""
    heads, dim = index_q_shape[2:]
    return student_gather.default_config(num_blocks=problem.num_blocks, heads=heads, head_dim=dim,
                                         width=problem.width)
