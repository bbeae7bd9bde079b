"""Tensor-parallel and FSDP FP8 train steps (8 host devices, data 4 x model 2): one fused update,
the whole model's amaxes in ONE max all-reduce (each amax is a max over all devices,
jax_fp8/_primitives/amax.py, so XLA combines them), and the new FP8 state equal, bit for bit, to
the same step on one device."""

import pytest

import helpers


@pytest.fixture(scope="module", params=["tp", "fsdp"])
def results(request):
    return helpers.run_8_device_worker("tensor_parallel_worker.py", request.param)


def test_one_fused_update_in_tensor_parallel_step(results):
    assert results["updates"] == 1, results
    assert results["all_reduces"].get("maximum", 0) >= 1, results  # amaxes are global


def test_amaxes_cross_devices_in_one_collective(results):
    assert results["all_reduces"].get("maximum", 0) == 1, results


def test_fp8_state_is_the_single_device_one(results):
    assert results["amaxes_nonzero"], results
    assert results["fp8_state_equals_one_device"], results
