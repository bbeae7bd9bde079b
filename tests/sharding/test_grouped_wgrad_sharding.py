"""The grouped weight-gradient primitive on 8 host devices (tests/sharding/
grouped_wgrad_sharding_worker.py), rows sharded: with the kernel asked for, each device runs
the primitive on its rows (the global groups clamped to them) and one float32 all-reduce
sums the partial sums before the one scaling and rounding; with it off, XLA partitions the
reference. Either way the one-device bits (exact operands) and a replicated result. The
kernel is asked for by implementation="cuda", and by "auto" (the default, unless
JAX_FP8_GROUPED_WGRAD_KERNEL=0); "jnp" is the reference."""

import os

import pytest

import helpers

ASKED = ("cuda", "auto") if os.environ.get("JAX_FP8_GROUPED_WGRAD_KERNEL", "1") == "1" \
    else ("cuda",)
CASES = [f"{impl}_{dtype}" for impl in ("cuda", "jnp", "auto")
         for dtype in ("bfloat16", "float32")]


@pytest.fixture(scope="module")
def results():
    return helpers.run_8_device_worker("grouped_wgrad_sharding_worker.py", timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_one_devices_bits(results, case):
    r = results[case]
    assert r["same_bits"] and r["nan_in_empty_group"] and r["replicated"], r


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith(ASKED)])
def test_kernel_asked_for_partitions_per_device(results, case):
    r = results[case]
    assert r["per_device"] > 0, r
    assert r["row"] == ["partitioned", "a jit over 8 devices: each runs the reference on its "
                        "shards"], r
    assert ["add", "f32"] in r["all_reduces"], r        # the partial sums, in float32


@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith(ASKED)])
def test_kernel_off_leaves_the_reference_to_xla(results, case):
    r = results[case]
    assert r["per_device"] == 0, r
    assert r["row"][0] == "reference", r
