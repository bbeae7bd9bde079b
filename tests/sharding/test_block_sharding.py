"""Block scaling under a jit over 8 host devices (tests/sharding/block_sharding_worker.py): the
block quantization and the block-scaled GEMM run per shard (custom_partitioning on Auto meshes,
shard_map on Explicit ones; on the CPU each device runs the reference on its shards, on
a GPU the kernels), FSDP all-gathers the FP8 weights with their block scales, and the
results are one device's: bit for bit where no GEMM sums over a sharded axis, within the
block GEMM's bound where one does (each device's float32 product summed over the
devices: the one-device sum of the same float32 terms in another order).

The GPU side (each device's custom calls) is test_gpu_partitioned_block_step_runs_the_kernels,
on a machine with at least 2 GPUs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers

M, D = 1024, 512
FP8 = {"f8e4m3fn", "f8e5m2"}
CASES = ["dp/auto", "dp/explicit", "fsdp/auto", "fsdp/explicit", "tp/auto", "tp/explicit",
         "tp_columns/auto"]


@pytest.fixture(scope="module")
def results():
    return helpers.run_8_device_worker("block_sharding_worker.py", timeout=900)


def _dims(shape: str) -> list:
    return [int(d) for d in shape[shape.index("[") + 1:shape.index("]")].split(",") if d]


@pytest.mark.parametrize("case", CASES)
def test_every_gemm_runs_per_shard(results, case):
    r = results[case]
    dots = r["dots"]
    assert len(dots) == 6, dots     # 2 layers x (forward, input gradient, weight gradient)
    for shape, _, operands in dots:
        # No device multiplies the whole batch: every GEMM takes its shard of the rows.
        assert M not in _dims(shape) and all(M not in _dims(o) for o in operands), dots
    if case.endswith("/auto"):      # each one the block GEMM's per-device computation
        assert all(in_scope for _, in_scope, _ in dots), dots
    assert r["gemm_scope_ops"] > 0 and r["quantize_scope_ops"] > 0, r


@pytest.mark.parametrize("case", CASES)
def test_only_fp8_and_block_scales_are_gathered(results, case):
    """What travels is FP8 plus its float32 block scales (4 bytes per 128 values at most);
    nothing in high precision. FSDP gathers each weight (128 x 128 tiles) for the forward
    and the input gradient, two column-parallel layers the activation between them (as
    FP8 with 1 x 128 scales), data parallelism and the Megatron pair nothing."""
    gathers = results[case]["collectives"].get("all-gather", {})
    fp8 = sum(sum(v) for k, v in gathers.items() if k in FP8)
    scales = sum(gathers.get("f32", []))
    assert set(gathers) <= FP8 | {"f32"}, gathers
    assert scales * 128 <= 4 * fp8, gathers
    if case.startswith("fsdp"):
        assert sorted(gathers["f8e4m3fn"]) == [D * D] * 4, gathers
        assert scales * 128 * 128 <= 4 * fp8, gathers
    elif case.startswith("tp_columns"):
        assert sum(gathers["f8e4m3fn"]) == M // 4 * D * 2, gathers   # [256, 512] each way
    else:
        assert not gathers, gathers


@pytest.mark.parametrize("axes", ["auto", "explicit"])
def test_fsdp_gathers_at_most_1_1_times_the_delayed_recipes_bytes(results, axes):
    def total(case):
        gathers = results[case]["collectives"]["all-gather"]
        return sum(sum(v) for v in gathers.values())

    delayed = results["fsdp/delayed"]["collectives"]["all-gather"]
    assert set(delayed) <= FP8, delayed
    assert total(f"fsdp/{axes}") <= 1.1 * total("fsdp/delayed"), results[f"fsdp/{axes}"]


@pytest.mark.parametrize("case", ["dp/auto", "dp/explicit", "fsdp/auto", "fsdp/explicit",
                                  "tp_columns/auto"])
def test_forward_and_input_gradient_have_the_one_device_bits(results, case):
    r = results[case]
    assert r["out_equal"], r
    # (A column-parallel layer's input gradient sums over "model": bounded, not bits.)
    assert r["dx_equal"] or case.startswith("tp_columns"), r
    assert r["dx_rel"] < 1e-2, r
    # The weight gradients sum over the sharded rows (a float32 sum over devices, in
    # another order than one device's), then round to bfloat16-computed float32.
    assert r["dw_rel"] < 1e-2, r


@pytest.mark.parametrize("case", ["tp/auto", "tp/explicit"])
def test_tensor_parallel_sums_row_parallel_products_over_devices(results, case):
    r = results[case]
    # The row-parallel forward and the column-parallel input gradient contract over
    # "model": float32 partial products, one f32 all-reduce each, rounded afterwards.
    assert set(r["collectives"]) == {"all-reduce"}, r["collectives"]
    assert set(r["collectives"]["all-reduce"]) == {"f32"}, r["collectives"]
    assert r["out_rel"] < 1e-2 and r["dx_rel"] < 1e-2 and r["dw_rel"] < 1e-2, r


@pytest.mark.parametrize("axes", ["dp", "fsdp", "tp"])
def test_explicit_mesh_gives_the_auto_meshs_bits(results, axes):
    auto, explicit = results[f"{axes}/auto"], results[f"{axes}/explicit"]
    for key in ("out_rel", "dx_rel", "dw_rel"):
        assert auto[key] == explicit[key], (auto, explicit)


def test_explicit_mesh_gradients_are_typed_as_their_weights(results):
    assert results["fsdp/explicit"]["dw_specs"] == ["P('fsdp', None)"] * 2, results
    assert results["tp/explicit"]["dw_specs"] == ["P(None, 'model')", "P('model', None)"]


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_gemm_with_k_sharded_is_within_the_block_gemm_bound(results, out_dtype):
    r = results[f"k_sharded_gemm/{out_dtype}"]
    assert r["err_over_bound"] <= 1 and r["one_device_err_over_bound"] <= 1, r
    assert r["collectives"] == {"all-reduce": {"f32": [256 * 128 * 4]}}, r
    assert r["gemm_shapes"] == ["f32[256,128]"], r   # each device's K shard, float32


def test_shards_that_cut_blocks_are_gathered_first_with_the_one_device_bits(results):
    r = results["unaligned_shards"]
    assert r["equal"], r
    assert "f32" in r["collectives"].get("all-gather", {}), r   # x, before quantizing


@pytest.mark.gpu
def test_gpu_partitioned_block_step_runs_the_kernels():
    """On >= 2 GPUs, data-parallel: each device runs the quantization kernel and the
    block GEMM's custom call on its rows (no dot in the program), with one device's
    forward bits."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_fp8
    from jax_fp8.devtools import hlo

    gpus = helpers.GPU_DEVICES
    if len(gpus) < 2:
        pytest.skip("needs at least 2 GPUs")
    mesh = jax.sharding.Mesh(np.array(gpus[:2]), ("data",))
    meta = jax_fp8.Fp8Meta.create(jax_fp8.Float8BlockScaling())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1024, 512)).astype(jnp.bfloat16)
    w = (rng.standard_normal((512, 512)) / 16).astype(jnp.bfloat16)

    def loss(w, x):
        out = jax_fp8.fp8_dot_general(x, w, (((1,), (0,)), ((), ())), meta)[0]
        return jnp.mean(out.astype(jnp.float32) ** 2), out

    step = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    ws = jax.device_put(w, NamedSharding(mesh, P()))
    compiled = step.lower(ws, xs).compile()
    assert hlo.count_custom_calls(compiled, "jax_fp8_block_gemm") == 3, compiled.as_text()
    assert hlo.count_custom_calls(compiled, "jax_fp8_block_quantize") == 3
    assert not [g for g in hlo.gemms(compiled) if g.kind == "dot"], hlo.gemms(compiled)
    _, out = compiled(ws, xs)
    _, want = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(
        *jax.device_put((w, x), gpus[0]))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
