"""BUILD stays in step with the tree: every module, test and benchmark file is named by a Bazel target."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
TRACKED_DIRS = ("csa_pallas", "tests", "benchmarks", "examples")


def build_sources():
    tree = ast.parse((ROOT / "BUILD").read_text())  # Starlark is Python syntax
    sources = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg in ("srcs", "main"):
            for item in ast.walk(node.value):
                if isinstance(item, ast.Constant) and isinstance(item.value, str) and item.value.endswith(".py"):
                    sources.add(item.value)
    return sources


def tree_sources():
    return {str(p.relative_to(ROOT)) for d in TRACKED_DIRS for p in (ROOT / d).rglob("*.py")
            if "__pycache__" not in p.parts}


def test_every_python_file_has_a_target():
    missing = sorted(tree_sources() - build_sources())
    assert not missing, f"add these files to BUILD: {missing}"


def test_build_names_no_missing_file():
    stale = sorted(s for s in build_sources() if not (ROOT / s).exists())
    assert not stale, f"BUILD names files that do not exist: {stale}"


def test_every_test_file_is_a_py_test():
    tree = ast.parse((ROOT / "BUILD").read_text())
    tests = {node.args[0].value if node.args else next(k.value.value for k in node.keywords if k.arg == "name")
             for node in ast.walk(tree)
             if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "py_test"}
    files = {p.stem for p in (ROOT / "tests").glob("test_*.py")}
    assert files <= tests, f"py_test targets missing for {sorted(files - tests)}"
