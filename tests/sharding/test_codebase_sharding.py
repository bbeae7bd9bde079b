"""T5X- and MaxText-style projections converted by fp8_model on a data x model mesh of 8 host
devices, under their codebases' logical axis rules (T5X's standard_logical_axis_rules), with
each recipe: 3 FP8 GEMMs per projection after SPMD partitioning (forward, input gradient,
weight gradient), the hand-written FP8 model's loss and gradients bit for bit, and no
Fp8ConversionWarning (tests/sharding/codebase_worker.py)."""

import pytest

import helpers

CASES = [f"{codebase}/{recipe}" for codebase in ("t5x", "maxtext", "nnx")
         for recipe in ("delayed", "current", "block", "mxfp8")]


@pytest.fixture(scope="module")
def results():
    return helpers.run_8_device_worker("codebase_worker.py", timeout=900)


def test_worker_ran_every_case(results):
    assert sorted(results) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_three_fp8_gemms_per_projection_after_partitioning(results, case):
    r = results[case]
    assert r["fp8_gemms"] == 3 * r["projections"], r


@pytest.mark.parametrize("case", CASES)
def test_equal_to_the_hand_written_fp8_model_and_silent(results, case):
    r = results[case]
    assert r["equal_to_hand_written"], r
    assert r["warnings"] == [], r
    if not case.startswith("nnx"):   # each kernel reaches its GEMM sharding-constrained
        assert r["sharding_constraints"] >= r["projections"], r
