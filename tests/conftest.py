"""Shared pytest setup: f64 is NOT enabled (kernels run in f32); the oracle uses NumPy float64."""
import os
import sys

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# 8 host devices for the shard_map tests (tests/test_sharding.py); must be set before jax initialises its backend.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(__file__))

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=12, deadline=None, derandomize=True, print_blob=True)
settings.load_profile("ci")
