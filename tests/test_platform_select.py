"""The suite's device choice (tests/platform_select.py): CPU hosts keep 8 host devices and the interpreter, a TPU
host runs on its chips, and the sharded tests' meshes shrink to the chips a slice has."""

import jax
import pytest

import platform_select
from platform_select import chosen_platform, configure, fit_mesh_axes


def test_this_cpu_host_runs_on_eight_host_devices():
    if platform_select.tpu_chips_present():
        pytest.skip("a TPU host")
    assert jax.default_backend() == "cpu"
    assert len(jax.devices()) == platform_select.HOST_DEVICES


@pytest.mark.parametrize("environ,chips,want", [
    ({}, False, "cpu"),
    ({}, True, "tpu"),
    ({"JAX_PLATFORMS": "cpu"}, True, "cpu"),  # an explicit JAX_PLATFORMS wins over the detection
    ({"JAX_PLATFORMS": "tpu,cpu"}, False, "tpu"),
    ({"CSA_PALLAS_TEST_PLATFORM": "cpu"}, True, "cpu"),
    ({"CSA_PALLAS_TEST_PLATFORM": "tpu", "JAX_PLATFORMS": "cpu"}, False, "tpu"),
])
def test_platform_choice(environ, chips, want):
    assert chosen_platform(dict(environ), chips_present=chips) == want


def test_configure_sets_the_backend_and_host_devices_only_for_cpu():
    cpu = {}
    assert configure(cpu, chips_present=False) == "cpu"
    assert cpu["JAX_PLATFORMS"] == "cpu"
    assert cpu["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=8 --xla_cpu_use_fusion_emitters=false "
                                "--xla_backend_optimization_level=0")
    tpu = {}
    assert configure(tpu, chips_present=True) == "tpu"
    assert tpu["JAX_PLATFORMS"] == "tpu" and "XLA_FLAGS" not in tpu
    kept = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_cpu_use_fusion_emitters=true"}
    configure(kept, chips_present=False)
    assert kept["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=4 --xla_cpu_use_fusion_emitters=true "
                                 "--xla_backend_optimization_level=0")  # the set flags kept, the missing one added
    with pytest.raises(ValueError, match="^CSA_PALLAS_TEST_PLATFORM: expected 'cpu' or 'tpu', got 'gpu'"):
        chosen_platform({"CSA_PALLAS_TEST_PLATFORM": "gpu"})


@pytest.mark.parametrize("axes,available,want", [
    ({"data": 2, "heads": 4}, 8, {"data": 2, "heads": 4}),
    ({"data": 2, "heads": 4}, 4, {"data": 2, "heads": 2}),  # v5p-8: 4 chips
    ({"data": 2, "heads": 2, "seq": 2}, 4, {"data": 2, "heads": 2, "seq": 1}),
    ({"seq": 8}, 4, {"seq": 4}),
    ({"seq": 8}, 1, {"seq": 1}),
    ({"heads": 2, "seq": 4}, 2, {"heads": 2, "seq": 1}),
])
def test_meshes_shrink_to_the_devices_a_host_has(axes, available, want):
    assert fit_mesh_axes(axes, available) == want
