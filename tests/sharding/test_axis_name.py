"""update_states(axis_name=...): amaxes of the whole tree cross devices in ONE
all-reduce (max), then one fused update; every replica ends with the same state."""

import helpers


def test_axis_name_one_collective_and_global_max():
    res = helpers.run_8_device_worker("axis_name_worker.py")
    assert res["all_reduce"] + res["all_reduce_start"] == 1, res
    assert res["custom_calls"] == 1, res
    assert res["equal"], res


def test_new_fp8_state_axis_name_in_a_shard_map_train_step():
    """Data-parallel FP8 step in shard_map(check_vma=False): the backward max-reduces the
    FP8 ops' amaxes over the mapped axis (so a pmean of the whole gradient tree could not
    average them; XLA combines the three layers' into one all-reduce), the update's
    axis_name one pmax more, then one fused update; the new FP8 state equals the one-device
    step over the whole batch."""
    res = helpers.run_8_device_worker("axis_name_worker.py")
    assert res["dp_all_reduce"] == 2, res
    assert res["dp_custom_calls"] == 1, res
    assert res["dp_amaxes_nonzero"], res
    assert res["dp_equal"], res


def test_shard_map_with_check_vma_needs_no_collective_in_user_code():
    """shard_map's default check_vma=True: the replicated weight's gradient comes back
    summed over the data axis and the amaxes max-reduced, from fp8_dot_general's own
    backward; the FP8 state equals the one-device step's bit for bit."""
    res = helpers.run_8_device_worker("axis_name_worker.py")
    assert res["vma_fp8_equal"], res
    assert res["vma_weight_grads_close"], res
