"""Shared by the v5p AOT tests: libtpu is required (a missing libtpu fails them, it does not skip them)."""

import os

import pytest

from csa_pallas import aot


def require_libtpu():
    if not aot.libtpu_available():
        if os.environ.get("CSA_PALLAS_ALLOW_NO_LIBTPU") == "1":
            pytest.skip("libtpu not installed and CSA_PALLAS_ALLOW_NO_LIBTPU=1")
        pytest.fail("libtpu is required for the v5p AOT tests: pip install 'jax[tpu]==0.10.2'")
