"""An Equinox transformer converted by jax_fp8.equinox.fp8_model and trained FSDP-style on 8
host devices (eqx.filter_shard, jax.jit): every weight is all-gathered as FP8, the
partitioned program has 3 FP8 GEMMs per projection, and the step's loss and FP8 state
match the one-device step's (tests/sharding/equinox_fsdp_worker.py)."""

import pytest

import helpers

RECIPES = ["delayed", "current"]
WEIGHT_FP8_BYTES = 64 * 64        # the smallest projection weight, gathered in FP8


@pytest.fixture(scope="module")
def results():
    return helpers.run_8_device_worker("equinox_fsdp_worker.py", timeout=900)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_weight_is_all_gathered_in_fp8(results, recipe):
    gathers = results[recipe]["gathers"]
    # Each of the 7 projection weights, forward and backward (or gathered once for both).
    assert len(gathers["f8e4m3fn"]) >= results[recipe]["projections"], gathers
    wide = {dtype: sizes for dtype, sizes in gathers.items()
            if dtype != "f8e4m3fn" and max(sizes) >= WEIGHT_FP8_BYTES}
    assert not wide, gathers     # no weight gathered in float32 (16 KiB each)


@pytest.mark.parametrize("recipe", RECIPES)
def test_partitioned_step_has_three_fp8_gemms_per_projection(results, recipe):
    r = results[recipe]
    assert r["fp8_gemms"] == 3 * r["projections"] == 21, r
    assert r["gemms"] - r["fp8_gemms"] == 6, r    # attention's q.k and p.v, fwd + 2 grads


@pytest.mark.parametrize("recipe", RECIPES)
def test_sharded_step_matches_the_one_device_step(results, recipe):
    """The loss bit for bit; the new FP8 state within 2**-20 of the largest value: a
    gradient's amax is the max of values the sharded program sums in another order."""
    r = results[recipe]
    assert r["loss_rel_diff"] == 0.0, r
    assert r["fp8_state_rel_diff"] <= 2 ** -20, r
    assert r["scales_moved"] == (recipe == "delayed"), r
