"""Kernel fingerprints: a hash of every Pallas kernel body (its jaxpr, printed canonically) and grid of ten
representative configurations, so a refactor that should not change the kernels proves it did not. A commit that
changes a kernel on purpose regenerates them and says so:

    python tests/test_fingerprints.py --write      # rewrites tests/fingerprints.json

Hashes depend on the pinned jax version (0.10.2)."""

from __future__ import annotations

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import platform_select  # noqa: E402

platform_select.configure()

import jax  # noqa: E402
import jax.extend.core as jex_core  # noqa: E402
import pytest  # noqa: E402

import test_variants as variants  # noqa: E402
from kernel_cases import compiled_pallas_calls  # noqa: E402

FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fingerprints.json")
CASES = ("dense_merged_pairs", "dense_pairs", "dense_plain_straight", "dense_two_pass", "dense_head_major_rows",
         "dense_table_cached", "sparse_visit_cached", "sparse_visit_table", "sparse_gather",
         "sparse_gather_bf16_planes")


def _is_jaxpr(x) -> bool:
    return isinstance(x, (jex_core.ClosedJaxpr, jex_core.Jaxpr))


def _canonical(jaxpr, depth: int = 0) -> list:
    """A printout of `jaxpr` that depends only on its contents: every sub-jaxpr printed inline where it is used
    (JAX's printer shares a sub-jaxpr traced once from one Python function, so equal programs traced from
    differently shaped Python code print differently), variables numbered in order of appearance."""
    if isinstance(jaxpr, jex_core.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    names = {}

    def name(v):
        if isinstance(v, jex_core.Literal):
            return f"{v.val}:{v.aval.str_short()}"
        if v not in names:
            names[v] = f"v{len(names)}:{v.aval.str_short()}"
        return names[v]

    pad = "  " * depth
    lines = [pad + "in " + " ".join(name(v) for v in jaxpr.constvars + jaxpr.invars)]
    for eqn in jaxpr.eqns:
        params, subs = [], []
        for key in sorted(eqn.params):
            value = eqn.params[key]
            items = value if isinstance(value, (list, tuple)) else (value,)
            if items and all(_is_jaxpr(x) for x in items):
                subs += [(key, x) for x in items]
            else:
                params.append(f"{key}={value}")
        ins = " ".join(name(v) for v in eqn.invars)
        outs = " ".join(name(v) for v in eqn.outvars)
        lines.append(f"{pad}{outs} = {eqn.primitive.name}[{', '.join(params)}] {ins}")
        for key, sub in subs:
            lines.append(f"{pad}  {key}:")
            lines += _canonical(sub, depth + 2)
    lines.append(pad + "out " + " ".join(name(v) for v in jaxpr.outvars))
    return lines


def _kernel_texts(jaxpr) -> list:
    """The canonical kernel body and grid of every compiled (Mosaic) pallas_call in `jaxpr`, in program order: the
    interpreted branch of each call (`runtime.pallas_call`) is the same body with its loops rolled."""
    return [f"{eqn.params['name']}\n" + "\n".join(_canonical(eqn.params["jaxpr"]))
            + f"\n{eqn.params['grid_mapping'].grid}" for eqn in compiled_pallas_calls(jaxpr)]


def fingerprint(name: str) -> dict:
    """{"kernels": count, "sha256": hash} of the forward+backward and teacher kernels of variant `name`."""
    texts = _kernel_texts(jax.make_jaxpr(variants.loss_and_grad(name))(variants.arrays_for(name)).jaxpr)
    digest = hashlib.sha256("\n\n".join(texts).encode()).hexdigest()[:16]
    return dict(kernels=len(texts), sha256=digest)


def _recorded() -> dict:
    with open(FILE) as f:
        return json.load(f)


@pytest.mark.parametrize("name", CASES)
def test_kernel_fingerprints_are_unchanged(name):
    got = fingerprint(name)
    assert got["kernels"] > 0
    want = _recorded()[name]
    assert got == want, (f"{name}: the kernels changed ({want} -> {got}). If on purpose, regenerate with "
                         f"`python tests/test_fingerprints.py --write` and say so in the commit")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        table = {name: fingerprint(name) for name in CASES}
        with open(FILE, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
            f.write("\n")
        print(json.dumps(table, indent=1, sort_keys=True))
    else:
        print(__doc__)
