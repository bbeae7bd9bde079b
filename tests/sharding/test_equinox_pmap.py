"""Equinox data parallelism under pmap, the BERT example's loop: a ``jax.lax.pmean`` (or
``psum``) over the whole gradient tree, FP8 states included, records the max of the
devices' amaxes, bit for bit (tests/sharding/equinox_pmap_worker.py)."""

import pytest

import helpers

CHECKS = ["devices_see_different_amaxes", "pmean_of_the_whole_gradient_tree_records_the_max",
          "psum_of_the_whole_gradient_tree_records_the_max",
          "pmean_of_the_parameters_only_records_the_max", "every_device_holds_the_same_records"]


@pytest.fixture(scope="module")
def results():
    return helpers.run_8_device_worker("equinox_pmap_worker.py")


@pytest.mark.parametrize("name", CHECKS)
def test_equinox_pmap(results, name):
    assert results[name] == "ok", results[name]
