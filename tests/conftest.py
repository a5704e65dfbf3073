"""Shared pytest setup: f64 is NOT enabled (kernels run in f32); the oracle uses NumPy float64."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
# The chips on a TPU host, else 8 CPU host devices (tests/platform_select.py); before jax initialises its backend.
import platform_select  # noqa: E402

PLATFORM = platform_select.configure()

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=12, deadline=None, derandomize=True, print_blob=True)
settings.load_profile("ci")

# Markers, from where a test lives (pytest.ini declares them): CI runs everything; a quick local run deselects,
# e.g. `python -m pytest -q -m "not v5p_compile"`. test_aot_chips.py compiles for the chips after v5p (v6e, TPU7x):
# marked with the v5p compiles, since what makes them slow, libtpu's compilers, is the same.
V5P_COMPILE_FILES = {"test_aot.py", "test_aot_chips.py", "test_aot_kernels.py", "test_aot_sparse.py",
                     "test_aot_sharding.py", "test_aot_placement.py", "test_aot_student.py", "test_platform.py",
                     "test_demo.py"}
SHARDED_FILES = {"test_sharding.py", "test_placement.py", "test_check_vma.py", "test_aot_sharding.py",
                 "test_aot_placement.py", "test_sharded_student.py", "test_partial_manual.py"}


def pytest_collection_modifyitems(config, items):
    import pytest
    for item in items:
        filename = item.path.name
        if filename in V5P_COMPILE_FILES or "compiles_for_v5p" in item.name:
            item.add_marker(pytest.mark.v5p_compile)
        if filename in SHARDED_FILES:
            item.add_marker(pytest.mark.sharded)
