"""FP8 GEMMs of activations sharded along a minor (sequence) axis, ``[4, 40@data, 64]``,
on a mesh with Explicit axes: `jax_fp8.fp8_einsum`, `jax_fp8.fp8_dot_general` and an
``nn.Dense`` converted by `jax_fp8.flax.fp8_model`, delayed and current scaling, jitted
with their gradients on 8 host devices (sequence_sharding_worker.py).

Each gives one device's output, input gradient and staged amaxes bit for bit, with the
output and input gradient sharded as the input; the kernel gradient, a sum over the
sharded rows, within twice the summation bound of one device's (bit for bit for delayed
scaling at these sizes). The forward gathers no activations: its only collective is
current scaling's max of the input's amax."""

import pytest

import helpers

SEQUENCE_SHARDED = ("P(None, 'data', None)", "PartitionSpec(None, 'data', None)")


@pytest.fixture(scope="module")
def results():
    return helpers.run_8_device_worker("sequence_sharding_worker.py")


@pytest.mark.parametrize("api", ["einsum", "dot_general", "dense"])
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_sequence_sharded_activations_on_explicit_mesh(results, recipe, api):
    res = results[f"{recipe}/{api}"]
    assert "error" not in res, res
    assert res["out_equal"] and res["dx_equal"] and res["amaxes_equal"], res
    assert res["n_amaxes"] == (3 if recipe == "delayed" else 0), res
    assert res["dw_err_over_bound"] <= 1, res
    if recipe == "delayed":
        assert res["dw_equal"], res
    assert res["specs"][0] in SEQUENCE_SHARDED and res["specs"][1] in SEQUENCE_SHARDED, res
    want = [] if recipe == "delayed" else [["all-reduce", "maximum"]]
    assert res["forward_collectives"] == want, res
