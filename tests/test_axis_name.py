"""update_states(axis_name=...): amaxes of the whole tree cross devices in ONE
all-reduce (max), then one fused update; every replica ends with the same state."""

import helpers


def test_axis_name_one_collective_and_global_max():
    res = helpers.run_8_device_worker("axis_name_worker.py")
    assert res["all_reduce"] + res["all_reduce_start"] == 1, res
    assert res["custom_calls"] == 1, res
    assert res["equal"], res
