"""No silent wrong results: every way of driving the library gives the right numbers or a
clear error at trace time. One test (or a few) per way that once went wrong."""

import functools
import os
import subprocess
import sys

import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import helpers
import jax_fp8
from helpers import rand
from jax_fp8.flax import FP8_COLLECTION, Fp8DotGeneral, Fp8TrainState

DN = (((1,), (0,)), ((), ()))
R16 = jax_fp8.DelayedScaling(history_len=16)
DG = functools.partial(Fp8DotGeneral, recipe=R16)


def staged(tree):
    return jax_fp8.amax_cotangents(tree)


# ------------------------------------------------------------------ float16

def test_float16_dot_general_does_not_overflow_once_scales_adapt():
    x, w = jnp.full((2, 8), 100, jnp.float16), jnp.ones((8, 4), jnp.float16)
    meta = jax_fp8.Fp8Meta.create(R16)

    @jax.jit
    def step(x, w, meta):
        def loss(x, w, meta):
            out, _ = jax_fp8.fp8_dot_general(x, w, DN, meta)
            return jnp.sum(out.astype(jnp.float32)), out
        (_, out), (dx, dw, dm) = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
            x, w, meta)
        return out, dx, dw, jax_fp8.new_fp8_state(meta, dm, R16)

    # Step 0 quantizes 100 with scale 1 (E4M3: 96); later steps with scale 448/100, which
    # puts x at fp8_max, where the FP8 GEMM's result (~448 * 448 * K) exceeds float16.
    for i in range(3):
        out, dx, dw, meta = step(x, w, meta)
        assert out.dtype == dx.dtype == dw.dtype == jnp.float16
        for got, want in ((out, 800.0), (dx, 4.0), (dw, 200.0)):
            assert np.all(np.isfinite(np.asarray(got, np.float32))), (i, got)
            np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0.05)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shapes", [((2, 8), (8, 4)), ((32, 64), (64, 32))])
def test_fp8_gemm_at_fp8_max_is_finite_at_every_size(dtype, shapes):
    # XLA:GPU widens the FP8 operands of a GEMM it cannot run in FP8 (2x8x4) to float16
    # for a float32 result, where 448 * 448 * 8 overflows; jax_fp8 widens them itself.
    x, w = jnp.full(shapes[0], 100, dtype), jnp.ones(shapes[1], dtype)
    k, n = shapes[1]
    meta = jax_fp8.Fp8Meta.create(R16)
    step = jax.jit(lambda x, w, meta: jax.value_and_grad(
        lambda x, w, meta: jnp.sum(jax_fp8.fp8_dot_general(x, w, DN, meta)[0]
                                   .astype(jnp.float32)), argnums=(0, 1, 2))(x, w, meta))
    for i in range(3):  # from step 1 on, the scales put x and w at fp8_max
        loss, (dx, dw, dm) = step(x, w, meta)
        meta = jax_fp8.new_fp8_state(meta, dm, R16)
        m = x.shape[0]
        for got, want in ((loss, 100.0 * m * k * n), (dx, float(n)), (dw, 100.0 * m)):
            got = np.asarray(got, np.float32)
            assert np.all(np.isfinite(got)), (i, got)
            np.testing.assert_allclose(got, want, rtol=0.05)  # E4M3 rounds 100 to 96


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_flax_dense_trains_in_float16_as_in_bfloat16(dtype):
    model = nn.Sequential([nn.Dense(32, dtype=dtype, dot_general_cls=DG), nn.relu,
                           nn.Dense(4, dtype=dtype, dot_general_cls=DG)])
    x, y = rand(0, (64, 16), 3.0), rand(1, (64, 4))
    v = model.init(jax.random.key(0), x)
    state = Fp8TrainState.create(apply_fn=model.apply, variables=v, tx=optax.adam(1e-2),
                                 recipe=R16)

    step = jax.jit(lambda state: helpers.mse_fp8_step(state, x, y))

    losses = []
    for _ in range(30):
        state, val = step(state)
        losses.append(float(val))
    assert np.all(np.isfinite(losses)), losses
    assert losses[-1] < 0.5 * losses[0], losses


def test_bfloat16_dequantization_factor_bound():
    """gemm() rounds scale_inv_a * scale_inv_b to bfloat16 for a bfloat16 result: the
    stated bound, a relative error of at most 2**-8, holds (and is reached)."""
    f = np.float32(1.0) + np.arange(1, 4096, dtype=np.float32) * np.float32(2.0 ** -20)
    r = np.asarray(jnp.asarray(f).astype(jnp.bfloat16).astype(jnp.float32))
    rel = np.abs(r - f) / f
    assert rel.max() <= 2.0 ** -8
    assert float(jnp.asarray(np.float32(1.0038)).astype(jnp.bfloat16)) == 1.0
    assert rel.max() > 2.0 ** -9          # the old docstring's 2**-9 did not hold


# ------------------------------------------------------------------ multi-device

@pytest.fixture(scope="module")
def multi_device():
    return helpers.run_8_device_worker("trust_worker.py")


def test_shard_map_type_check_sees_a_varying_amax(multi_device):
    assert multi_device["vma_error"] is not None
    assert "out_specs" in multi_device["vma_error"]
    assert multi_device["vma_reduced_scale"] == 448.0 / 8.0
    assert multi_device["amax_vma_error"] is not None


def test_axis_name_reduces_the_staged_amaxes_without_explicit_amaxes(multi_device):
    assert multi_device["pmap_scales"] == [56.0] * 4
    assert multi_device["pmap_newest"] == [8.0] * 4


def test_sharded_programs_export_and_run_with_the_same_bits(multi_device):
    assert multi_device["export_update_same_bits"]
    assert multi_device["export_update_custom_calls"] >= 1
    assert multi_device["export_step_same_bits"]


# ------------------------------------------------------------------ amaxes by max, never sum

def test_vmap_over_examples_with_one_shared_meta_takes_the_max():
    x = jnp.stack([jnp.full((8,), 2.0), jnp.full((8,), 4.0).at[3].set(-9.0)])
    w = rand(1, (8, 4))
    meta = jax_fp8.Fp8Meta.create(R16)

    def loss(x, w, meta):
        per = jax.vmap(lambda xi: jax_fp8.fp8_dot_general(xi, w, (((0,), (0,)), ((), ())),
                                                          meta)[0])
        return jnp.sum(per(x) ** 2)

    got = staged(jax.jit(jax.grad(loss, argnums=2))(x, w, meta))
    assert float(got.input) == 9.0                         # max |x| over the batch
    assert float(got.kernel) == float(jnp.max(jnp.abs(w)))
    g = jax.grad(lambda o: jnp.sum(o ** 2))(jax.vmap(lambda xi: xi @ w)(x))
    assert float(got.grad) == pytest.approx(float(jnp.max(jnp.abs(g))), rel=0.07)


def test_vmap_over_stacked_metas_keeps_one_amax_per_layer():
    x = jnp.stack([jnp.full((2, 8), 2.0), jnp.full((2, 8), 5.0)])
    w = rand(1, (8, 4))
    metas = jax_fp8.Fp8Meta.create(R16, shape=(2,))

    def loss(x, metas):
        def one(xi, m):
            return jax_fp8.fp8_dot_general(xi, w, DN, m)[0]
        return jnp.sum(jax.vmap(one)(x, metas))

    got = staged(jax.jit(jax.grad(loss, argnums=1))(x, metas))
    np.testing.assert_array_equal(got.input, [2.0, 5.0])


class _VmappedDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        dense = nn.vmap(nn.Dense, variable_axes={"params": None, FP8_COLLECTION: None},
                        split_rngs={"params": False}, in_axes=0)
        return dense(4, dot_general_cls=DG)(x)


def test_nn_vmap_with_the_fp8_collection_broadcast_takes_the_max():
    x = jnp.stack([jnp.full((3, 4), 2.0), jnp.full((3, 4), 4.0)])
    model = _VmappedDense()
    v = model.init(jax.random.key(0), x)

    def loss(fp8, params):
        y, _ = model.apply({"params": params, FP8_COLLECTION: fp8}, x, mutable=[FP8_COLLECTION])
        return jnp.sum(y)

    g = jax.grad(loss)(v[FP8_COLLECTION], v["params"])
    assert float(g["VmapDense_0"]["Fp8DotGeneral_0"]["input"].amax_history[0]) == 4.0


class _Twice(nn.Module):
    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(4, dot_general_cls=DG)
        return dense(x) + dense(x * 0.75)


@pytest.mark.parametrize("mutable", [False, True], ids=["immutable", "mutable"])
def test_a_dense_called_twice_takes_the_max_with_or_without_a_mutable_collection(mutable):
    x = jnp.full((2, 4), 4.0).at[0, 0].set(7.0)       # uses: max 7, then max 5.25
    model = _Twice()
    v = model.init(jax.random.key(0), x)

    def loss(fp8, params):
        variables = {"params": params, FP8_COLLECTION: fp8}
        if mutable:
            return jnp.sum(model.apply(variables, x, mutable=[FP8_COLLECTION])[0])
        return jnp.sum(model.apply(variables, x))

    g = jax.jit(jax.grad(loss))(v[FP8_COLLECTION], v["params"])
    assert float(g["Dense_0"]["Fp8DotGeneral_0"]["input"].amax_history[0]) == 7.0


def test_a_meta_closed_over_by_a_scan_body_is_an_error():
    meta, w = jax_fp8.Fp8Meta.create(R16), rand(1, (4, 4))

    def loss(meta, xs):
        def body(c, xi):
            return c + jnp.sum(jax_fp8.fp8_dot_general(xi, w, DN, meta)[0]), None
        return jax.lax.scan(body, 0.0, xs)[0]

    with pytest.raises(ValueError, match="closed over by a `scan` body"):
        jax.grad(loss)(meta, jnp.ones((3, 2, 4)))
    with pytest.raises(ValueError, match="closed over by a `fori_loop` body"):
        jax.grad(lambda m: jax.lax.fori_loop(0, 3, lambda i, c: c + jnp.sum(
            jax_fp8.fp8_dot_general(jnp.ones((2, 4)), w, DN, m)[0]), 0.0))(meta)

    def carried(meta, xs):                             # the fix the message gives
        def body(carry, xi):
            c, m = carry
            y, m = jax_fp8.fp8_dot_general(xi, w, DN, m)
            return (c + jnp.sum(y), m), None
        return jax.lax.scan(body, (0.0, meta), xs)[0][0]

    xs = jnp.stack([jnp.full((2, 4), 1.0), jnp.full((2, 4), 3.0), jnp.full((2, 4), 2.0)])
    assert float(staged(jax.grad(carried)(meta, xs)).input) == 3.0


def test_a_meta_in_both_branches_of_a_cond_is_fine():
    meta, w = jax_fp8.Fp8Meta.create(R16), rand(1, (4, 4))

    def loss(meta, x, p):
        return jax.lax.cond(p, lambda x: jnp.sum(jax_fp8.fp8_dot_general(x, w, DN, meta)[0]),
                            lambda x: jnp.sum(jax_fp8.fp8_dot_general(2 * x, w, DN, meta)[0]),
                            x)

    x = jnp.full((2, 4), 1.5)
    assert float(staged(jax.grad(loss)(meta, x, True)).input) == 1.5
    assert float(staged(jax.grad(loss)(meta, x, False)).input) == 3.0


def test_a_reused_meta_in_plain_jax_is_an_error():
    meta, w, x = jax_fp8.Fp8Meta.create(R16), rand(1, (4, 4)), rand(0, (2, 4))

    def loss(meta):
        a, _ = jax_fp8.fp8_dot_general(x, w, DN, meta)
        b, _ = jax_fp8.fp8_dot_general(x * 2, w, DN, meta)
        return jnp.sum(a + b)

    with pytest.raises(ValueError, match="already given to another FP8 op"):
        jax.grad(loss)(meta)


# ------------------------------------------------------------------ one recipe

def test_train_state_refuses_states_made_by_another_recipe():
    """The README snippet's mistake: layers with the default recipe (history 1024,
    HYBRID), the train state told history 16 and E4M3."""
    model = nn.Dense(4, dot_general_cls=Fp8DotGeneral)
    v = model.init(jax.random.key(0), jnp.ones((2, 8)))
    recipe = jax_fp8.DelayedScaling(history_len=16, fp8_format=jax_fp8.Format.E4M3)
    with pytest.raises(ValueError, match=r"history length 1024, the recipe's is 16"):
        Fp8TrainState.create(apply_fn=model.apply, variables=v, tx=optax.sgd(0.1),
                             recipe=recipe)
    model = nn.Dense(4, dot_general_cls=functools.partial(Fp8DotGeneral, recipe=recipe))
    v = model.init(jax.random.key(0), jnp.ones((2, 8)))
    state = Fp8TrainState.create(apply_fn=model.apply, variables=v, tx=optax.sgd(0.1),
                                 recipe=recipe)
    states = jax.tree.leaves(jax_fp8.unpack_states(state.fp8),
                             is_leaf=lambda s: isinstance(s, jax_fp8.ScalingState))
    assert {s.history_len for s in states} == {16}
    assert {s.fp8_dtype for s in states} == {np.dtype(jnp.float8_e4m3fn)}


def test_new_fp8_state_refuses_a_recipe_of_another_format():
    meta = jax_fp8.Fp8Meta.create(jax_fp8.DelayedScaling(history_len=4))      # HYBRID
    e4m3 = jax_fp8.DelayedScaling(history_len=4, fp8_format=jax_fp8.Format.E4M3)
    with pytest.raises(ValueError, match=r"fp8_states\.grad .*float8_e5m2"):
        jax_fp8.new_fp8_state(meta, meta, e4m3)


# ------------------------------------------------------------------ checkpoints record the format

def _train_state(fmt, pack):
    recipe = jax_fp8.DelayedScaling(history_len=4, fp8_format=fmt)
    model = nn.Dense(3, dot_general_cls=functools.partial(Fp8DotGeneral, recipe=recipe))
    v = model.init(jax.random.key(0), jnp.ones((2, 4)))
    return Fp8TrainState.create(apply_fn=model.apply, variables=v, tx=optax.sgd(1.0),
                                recipe=recipe, pack_fp8=pack)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "per_tensor"])
def test_orbax_restore_into_another_fp8_format_is_an_error(tmp_path, pack):
    saved = _train_state(jax_fp8.Format.HYBRID, pack)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", saved)
    ckptr.wait_until_finished()
    same = jax.tree.map(ocp.utils.to_shape_dtype_struct, _train_state(jax_fp8.Format.HYBRID,
                                                                      pack))
    restored = ckptr.restore(tmp_path / "ckpt", same)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(a, b)
    other = jax.tree.map(ocp.utils.to_shape_dtype_struct, _train_state(jax_fp8.Format.E4M3,
                                                                       pack))
    with pytest.raises(ValueError, match="float8_e5m2"):
        ckptr.restore(tmp_path / "ckpt", other)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "per_tensor"])
def test_msgpack_round_trip_and_format_mismatch(pack):
    state = _train_state(jax_fp8.Format.HYBRID, pack)
    blob = flax.serialization.to_bytes(state)
    back = flax.serialization.from_bytes(state, blob)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="float8_e5m2|format"):
        flax.serialization.from_bytes(_train_state(jax_fp8.Format.E4M3, pack), blob)


# ------------------------------------------------------------------ eager debugging

def test_disable_jit_runs_every_primitive_eagerly_with_the_same_bits():
    tree = {"a": jax_fp8.ScalingState.create((), 8), "b": jax_fp8.ScalingState.create((3,), 4)}
    amaxes = {"a": jnp.float32(3.5), "b": jnp.asarray([1.0, 0.0, 1e-30], jnp.float32)}
    meta, x, w = jax_fp8.Fp8Meta.create(R16), rand(0, (4, 8)), rand(1, (8, 4))

    def work(tree, amaxes, x, w, meta):
        up = jax_fp8.update_states(tree, amaxes)
        g = jax.grad(lambda x, w, m: jnp.sum(jax_fp8.fp8_dot_general(x, w, DN, m)[0] ** 2),
                     argnums=(0, 1, 2))(x, w, meta)
        return up, g, jax_fp8.compute_amax(x)

    want = jax.jit(work)(tree, amaxes, x, w, meta)
    with jax.disable_jit():
        got = work(tree, amaxes, x, w, meta)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ bad arguments name themselves

def test_none_scale_or_amax_leaf_names_the_argument_and_path():
    tree = {"layer": {"x": jax_fp8.ScalingState.create((), 4)}}
    broken = {"layer": {"x": jax_fp8.ScalingState(jnp.zeros(4), None, jnp.ones(()))}}
    with pytest.raises(TypeError, match=r"tree\['layer'\]\['x'\]: scale .* got None"):
        jax_fp8.update_states(broken)
    with pytest.raises(TypeError, match=r"amax .* got None \(amaxes\['layer'\]\['x'\]\)"):
        jax_fp8.update_states(tree, {"layer": {"x": None}})


@pytest.mark.parametrize("name", ["float8_e8m0fnu", "float8_e3m4", "float8_e4m3",
                                  "float8_e4m3b11fnuz"])
def test_fp8_dtypes_outside_the_four_are_refused(name):
    if not hasattr(jnp, name):
        pytest.skip(f"this jax has no {name}")
    dtype = getattr(jnp, name)
    with pytest.raises(TypeError, match="fp8_dtype must be one of"):
        jax_fp8.ScalingState.create((), 4, dtype)
    with pytest.raises(TypeError, match="fp8_dtype must be one of"):
        jax_fp8.amax_and_scale_update(jnp.zeros(4), jnp.ones(()), fp8_dtype=dtype)


# ------------------------------------------------------------------ export

def test_export_round_trip_and_what_a_fresh_process_says(tmp_path):
    tree = {"a": jax_fp8.ScalingState.create((), 8), "b": jax_fp8.ScalingState.create((3,), 4)}
    f = jax.jit(jax_fp8.update_states)
    exp = jax.export.export(f, disabled_checks=jax_fp8.export_disabled_checks())(tree)
    blob = exp.serialize()
    got = jax.export.deserialize(blob).call(tree)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(f(tree))):
        np.testing.assert_array_equal(a, b)
    # Exporting without the documented disabled checks names the custom call.
    with pytest.raises(ValueError, match="jax_fp8_update"):
        jax.export.export(f)(tree)
    # In a fresh process without `import jax_fp8`, both kinds of program say so.
    arrays = jax.jit(lambda h, s: jax_fp8.amax_and_scale_update(h, s))
    exp2 = jax.export.export(arrays, disabled_checks=jax_fp8.export_disabled_checks(),
                             platforms=("cpu",))(jnp.zeros(4), jnp.ones(()))
    (tmp_path / "tree.bin").write_bytes(blob)
    (tmp_path / "arrays.bin").write_bytes(exp2.serialize())
    code = (
        "import sys, jax, jax.numpy as jnp\n"
        "for name in ('tree', 'arrays'):\n"
        "    try:\n"
        "        e = jax.export.deserialize(open(sys.argv[1] + '/' + name + '.bin', 'rb').read())\n"
        "        e.call(jnp.zeros(4), jnp.ones(()))\n"
        "    except Exception as err:\n"
        "        print(name, '|', err)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env=env)
    lines = dict(line.split(" | ", 1) for line in proc.stdout.splitlines() if " | " in line)
    assert "jax_fp8.ScalingState" in lines["tree"], proc.stdout + proc.stderr
    assert "jax_fp8_update" in lines["arrays"], proc.stdout + proc.stderr
