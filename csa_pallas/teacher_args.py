"""The teacher keyword arguments, declared once.

They are the keyword-only parameters of `validation.validate` (which checks them). Every public op that takes them
(`indexer_distill_loss`, `teacher_distribution` and their sharded twins) is decorated with `takes_teacher_args`:
its signature (what `help()`, `inspect.signature` and IDEs show) gets these parameters, with validate's defaults,
and the function body receives them as one dict, `teacher`, ready for `validation.validate(q, kv, **teacher)` or
for forwarding to another op.
"""

from __future__ import annotations

import functools
import inspect

from csa_pallas import validation

PARAMETERS = tuple(p for p in inspect.signature(validation.validate).parameters.values()
                   if p.kind is inspect.Parameter.KEYWORD_ONLY)
NAMES = tuple(p.name for p in PARAMETERS)

# The docstring lines of these arguments; a decorated function's docstring says "{teacher_args}" where they go.
DOC = """\
      topk_indices: int [B, S, K] selected blocks (-1 = empty slot; any integer dtype); switches to sparse mode.
      window_kv: float [B, S_kv, D] keys of the sliding-window branch (joint target).
      sinks: float [H] per-head sink logits (joint target, with window_kv).
      noncompressed_lse: f32 [B, S, H], u of SPEC §3 when the caller has it (instead of window_kv/sinks).
      full_lse: f32 [B, S, H], the layer's full log-partition F; skips the teacher's LSE pass.
      segment_ids, positions: int [B, S] packing (default one document, positions 0..S-1).
      kv_segment_ids, kv_positions: int [B, S_kv] key side (default: the query side's).
      loss_mask: bool [B, S], False = the row takes no part in the loss (padding: MaxText's segment id 0); it is
        an empty row (0, not counted by "mean", zero gradient, nothing it reads matters).
      compress_ratio: m, tokens per compressed block. window_size: W, sliding window keys incl. the query.
      softmax_scale: tau (default D**-0.5). target: "joint" (layer's joint softmax) or "per_head".
      head_chunk: heads per VMEM tile (any divisor of H; default from the kernel config).
      implementation: None, "xla" or "pallas" (`csa_pallas.api`)."""


def takes_teacher_args(fn=None, *, only=None):
    """Decorator: fn(<positional>, *, teacher: dict, <own keywords>) becomes fn(<positional>, *, <the teacher
    keyword arguments>, <own keywords>); the caller's teacher arguments (defaults filled in) reach fn as `teacher`.
    only: a subset of the names (in their declared order), for an op that takes some of them."""
    if fn is None:
        return functools.partial(takes_teacher_args, only=only)
    unknown = set(only or ()) - set(NAMES)
    if unknown:
        raise TypeError(f"takes_teacher_args({fn.__name__}): {sorted(unknown)} are not teacher arguments")
    parameters = [p for p in PARAMETERS if only is None or p.name in only]
    sig = inspect.signature(fn)
    own = [p for p in sig.parameters.values() if p.name != "teacher"]
    clash = set(NAMES) & {p.name for p in own}
    if clash or "teacher" not in sig.parameters:
        raise TypeError(f"takes_teacher_args({fn.__name__}): needs a `teacher` parameter and none of {sorted(clash)}")
    positional = [p for p in own if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    keyword = [p for p in own if p.kind is inspect.Parameter.KEYWORD_ONLY]

    @functools.wraps(fn)
    def with_teacher_args(*args, **kwargs):
        teacher = {p.name: kwargs.pop(p.name, p.default) for p in parameters}
        return fn(*args, teacher=teacher, **kwargs)

    with_teacher_args.__signature__ = sig.replace(parameters=positional + parameters + keyword)
    if fn.__doc__:
        with_teacher_args.__doc__ = fn.__doc__.replace("{teacher_args}", DOC.strip("\n").lstrip())
    return with_teacher_args
