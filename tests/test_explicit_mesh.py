"""FP8 backward on a mesh with Explicit axes: the gradient GEMMs contract over the
sharded batch axis, so they must name their output sharding (as JAX's own dot rule
does); the sharded gradients equal the single-device ones."""

import helpers


def test_fp8_dot_general_grad_on_explicit_mesh():
    res = helpers.run_8_device_worker("explicit_mesh_worker.py")
    assert res["equal"], res
    assert res["specs"][1] in ("P('data', None)", "PartitionSpec('data', None)"), res  # dx like x
