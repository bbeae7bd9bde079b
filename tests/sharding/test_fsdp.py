"""FSDP on 8 host devices: a weight sharded over devices is quantized where it lives and
all-gathered as FP8 (half the bytes of bf16's gather), in plain jax.jit code, on a mesh
with Explicit axes, in a Flax Fp8TrainState step and with current scaling; the forward output
and the new FP8 state equal the one-device step's bit for bit (tests/sharding/fsdp_worker.py)."""

import pytest

import helpers

FP8 = ("f8e4m3fn", "f8e5m2")


@pytest.fixture(scope="module")
def results():
    return helpers.run_8_device_worker("fsdp_worker.py", timeout=600)


@pytest.mark.parametrize("case", ["rows", "rows_explicit", "cols", "rows_current", "flax"])
def test_every_all_gather_moves_fp8(results, case):
    gathers = results[case]["gathers"]
    assert gathers and set(gathers) <= set(FP8), gathers


@pytest.mark.parametrize("case", ["rows", "flax"])
def test_fp8_gathers_move_half_the_bytes_of_bf16s(results, case):
    fp8 = sum(sum(v) for v in results[case]["gathers"].values())
    bf16 = results[case + "_bf16"]["gathers"]
    assert set(bf16) == {"bf16"}, bf16   # the baseline gathers its weights in bf16
    assert 2 * fp8 == sum(bf16["bf16"]), (results[case], bf16)
    # One gather per layer of the whole [256, 256] weight, one byte a value.
    assert sorted(results[case]["gathers"]["f8e4m3fn"]) == [256 * 256] * 4


@pytest.mark.parametrize("case", ["rows", "rows_explicit"])
def test_fsdp_step_has_the_one_device_bits(results, case):
    r = results[case]
    assert r["scales_moved"], r
    assert r["output_and_fp8_state_equal_one_device"], r
    # The weight gradients are sums over devices, in another order than on one device.
    assert r["weights_max_diff_over_max"] < 1e-4, r


def test_current_scaling_fsdp_gathers_fp8_weights_with_the_one_device_bits(results):
    r = results["rows_current"]
    assert sorted(r["gathers"]["f8e4m3fn"])[-4:] == [256 * 256] * 4, r
    assert r["output_equal_one_device"], r


def test_flax_fsdp_fp8_state_has_the_one_device_bits(results):
    assert results["flax"]["fp8_state_equal_one_device"], results["flax"]
