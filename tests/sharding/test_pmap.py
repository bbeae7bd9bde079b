"""The one-call FP8 train step under jax.pmap (linen and NNX): with `axis_name` the update
max-reduces the devices' amaxes and every replica gets the same FP8 state; without it, or
with a pmean over every gradient, the step is refused at trace time naming the fix."""

import pytest

import helpers

CHECKS = ["linen_pmean_over_all_gradients_is_refused", "linen_without_axis_name_is_refused",
          "linen_axis_name_takes_the_max_over_devices", "nnx_without_axis_name_is_refused",
          "nnx_axis_name_keeps_the_replicas_equal_and_updates"]


@pytest.fixture(scope="module")
def results():
    return helpers.run_8_device_worker("pmap_worker.py")


@pytest.mark.parametrize("name", CHECKS)
def test_pmap(results, name):
    assert results[name] == "ok", results[name]
