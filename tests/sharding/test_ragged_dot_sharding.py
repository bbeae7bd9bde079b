"""jax_fp8.ragged_dot on 8 host devices, tokens data-parallel (tests/sharding/
ragged_dot_sharding_worker.py), on Auto and Explicit meshes: the output and the input
gradient are one device's bits and keep the tokens' sharding; the weight gradient is each
device's partial sum with one sum all-reduce: float32 partial sums on Auto meshes (one
device's bits), partial sums rounded to the weight's bfloat16 on Explicit meshes (JAX
transposes the per-device product there, as XLA's own sharded dot_general rounds), within
the bound the worker states."""

import pytest

import helpers


@pytest.fixture(scope="module")
def results():
    return helpers.run_8_device_worker("ragged_dot_sharding_worker.py", timeout=600)


def test_one_devices_bits(results):
    assert results["auto"]["same_bits"] == [True] * 3, results["auto"]
    assert results["explicit"]["same_bits"][:2] == [True] * 2, results["explicit"]
    assert results["explicit"]["dw_within_bound"], results["explicit"]


@pytest.mark.parametrize("mesh", ["auto", "explicit"])
def test_tokens_stay_sharded(results, mesh):
    out, dx, _ = results[mesh]["shardings"]
    assert "data" in out and "data" in dx, results[mesh]


@pytest.mark.parametrize("mesh", ["auto", "explicit"])
def test_weight_gradient_is_one_sum(results, mesh):
    assert results[mesh]["all_reduces"] == {"add": 1}, results[mesh]
