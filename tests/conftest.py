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
