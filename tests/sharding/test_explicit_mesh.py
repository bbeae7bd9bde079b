"""FP8 backward on a mesh with Explicit axes, every recipe: the gradient GEMMs contract
over the sharded batch axis, so they must name their output sharding (as JAX's own dot
rule does). Delayed and current scaling give one device's gradients (the kernel gradient,
a sum over the sharded rows, within its summation bound; bit for bit where the sum is
exact); block scaling and MXFP8 as well, each device quantizing and multiplying its
shards."""

import pytest

import helpers


@pytest.fixture(scope="module")
def results():
    return helpers.run_8_device_worker("explicit_mesh_worker.py")


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("size", ["small", "blocks"])
def test_fp8_dot_general_grad_on_explicit_mesh(results, recipe, size):
    res = results[f"{recipe}/{size}"]
    assert "error" not in res, res
    assert res["dx_equal"] and res["meta_equal"], res
    assert res["dw_err_over_bound"] <= 1, res
    if size == "small":   # 8 rows per device: the FP8 products' sums are exact
        assert res["dw_equal"], res
    assert res["specs"][1] in ("P('data', None)", "PartitionSpec('data', None)"), res  # dx like x
    assert res["specs"][0] in ("P(None, None)", "PartitionSpec(None, None)", "P()"), res


@pytest.mark.parametrize("recipe", ["block", "mxfp8"])
@pytest.mark.parametrize("size", ["small", "blocks"])
def test_block_scaling_on_explicit_mesh(results, recipe, size):
    res = results[f"{recipe}/{size}"]
    assert "error" not in res, res
    assert res["dx_equal"] and res["meta_equal"] and res["dw_err_over_bound"] <= 1, res
    assert res["specs"][1] in ("P('data', None)", "PartitionSpec('data', None)"), res
