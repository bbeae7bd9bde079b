"""Expert parallelism on 8 host devices (tests/sharding/moe_sharding_worker.py): fp8_ragged_dot
with one delayed-scaling state per expert, tokens data-parallel, the experts' weights
sharded along the experts' axis (and their columns over a second axis). The grouped GEMM
primitive partitions (each device its rows against every expert's FP8 weight, its group
sizes clamped to its rows), so every result is one device's bits; the weights travel as
FP8 values; the amaxes of a data-parallel step take one max all-reduce. MaxText's
sparse-matmul MoE converted by fp8_model, its experts in a shard_map over the 8 devices."""

import pytest

import helpers

CASES = ["dp", "ep", "ep_tp"]
G, K, N = 8, 64, 32


@pytest.fixture(scope="module")
def results():
    return helpers.run_8_device_worker("moe_sharding_worker.py", timeout=900)


@pytest.mark.parametrize("case", CASES)
def test_one_devices_bits(results, case):
    """out, dx, dw and the per-expert amaxes of the input, weight and gradient."""
    assert results[case]["same_bits"] == [True] * 6, results[case]


@pytest.mark.parametrize("case", CASES)
def test_the_grouped_gemm_runs_per_device(results, case):
    assert results[case]["per_device_ops"] > 0, results[case]


def test_data_parallel_collectives(results):
    """One max all-reduce for every amax of the step, one sum for the weight gradient,
    nothing gathered."""
    r = results["dp"]
    assert r["all_reduce_kinds"] == {"add": 1, "maximum": 1}, r
    assert r["gathers"] == {}, r


@pytest.mark.parametrize("case", ["ep", "ep_tp"])
def test_expert_weights_move_as_fp8(results, case):
    """The experts' weights are gathered for the forward and the input gradient as FP8
    values: G * K * N of them (per column shard), never in float32. (XLA's CPU backend
    carries FP8 collectives widened to float16: 2 bytes a value there, 1 on GPUs.)"""
    gathers = results[case]["gathers"]
    fp8 = {k: v for k, v in gathers.items() if k.startswith("f8") or k == "f16"}
    cols = 2 if case == "ep_tp" else 1
    weight = [b for v in fp8.values() for b in v if b in (G * K * N // cols,
                                                          2 * G * K * N // cols)]
    assert len(weight) >= 2, gathers
    assert all(b <= 4 * G for b in gathers.get("f32", [])), gathers   # scales only


def test_shard_map_tokens_per_device(results):
    """Inside shard_map, each device its own tokens and group sizes, every expert's weight
    and state replicated: the weight gradient is summed and each expert's amaxes max-ed over
    the devices, the bits of one device given all devices' rows of each expert as its
    group."""
    assert results["shard_map"]["same_bits"] == [True] * 4, results["shard_map"]


def test_maxtext_experts_in_a_shard_map_on_8_devices(results):
    """MaxText's sparse-matmul MoE converted by fp8_model on 8 devices: 9 FP8 grouped GEMMs
    in the step (3 forward, 6 backward), none left in high precision, and each device's
    output the block's on its tokens alone, bit for bit."""
    r = results["maxtext"]
    assert r["same_bits"], r
    assert len(r["ragged_dots"]) == 9, r
    assert all("xf8" in t for pair in r["ragged_dots"] for t in pair), r
