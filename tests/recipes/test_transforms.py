"""The update under JAX transformations: jit, eager, vmap, scan, checkpoint, grad."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import ieee_reference as ref
import jax_fp8
from helpers import assert_bits_equal, run_on

UPD = dict(margin=1.0, power_of_2_scale=False, skip_unused=True)


def _cases(seed, lead, L, with_amax=True):
    return helpers.make_cases(np.random.default_rng(seed), lead, L, with_amax)


def _assert_update(got, h, s, a, what, **kw):
    want = ref.update(h, s, a, **kw)
    helpers.assert_update_equal(got, want, f"{what}:")


def test_eager_equals_jit_equals_reference(device):
    h, s, a = _cases(0, (50,), 16)
    eager = run_on(device, lambda h, s, a: jax_fp8.amax_and_scale_update(h, s, a, **UPD),
                   h, s, a, jit=False)
    jitted = run_on(device, lambda h, s, a: jax_fp8.amax_and_scale_update(h, s, a, **UPD),
                    h, s, a)
    _assert_update(eager, h, s, a, "eager", **UPD)
    _assert_update(jitted, h, s, a, "jit", **UPD)


def test_eager_update_states(device):
    tree = {"a": jax_fp8.ScalingState.create((3,), 8), "b": [jax_fp8.ScalingState.create((), 1)]}
    amaxes = {"a": jnp.array([1.0, 2.0, 0.0], jnp.float32), "b": [jnp.float32(4.0)]}
    out = run_on(device, jax_fp8.update_states, tree, amaxes, jit=False)
    assert_bits_equal(out["a"].scale, np.array([448.0, 224.0, 1.0], np.float32), "a.scale")
    assert_bits_equal(out["a"].amax_history[:, -1], np.array([1.0, 2.0, 0.0], np.float32), "a.h")
    assert_bits_equal(out["b"][0].scale, np.float32(112.0), "b.scale")
    assert_bits_equal(out["b"][0].amax_history, np.zeros(1, np.float32), "b.h")


def test_vmap_equals_stacked_call(device):
    """vmap over a leading axis is the same update as the call on the stack."""
    h, s, a = _cases(1, (6, 20), 16)

    def f(h, s, a):
        vm = jax.vmap(lambda h, s, a: jax_fp8.amax_and_scale_update(h, s, a, **UPD))(h, s, a)
        return vm, jax_fp8.amax_and_scale_update(h, s, a, **UPD)

    vm, stacked = run_on(device, f, h, s, a)
    helpers.assert_update_equal(vm, stacked, "vmap vs stacked")
    _assert_update(vm, h, s, a, "vmap", **UPD)


def test_vmap_over_amax_only(device):
    """in_axes=(None, None, 0): one state, a batch of candidate amaxes."""
    h, s, _ = _cases(2, (5,), 16, with_amax=False)
    amaxes = np.stack([np.full(5, v, np.float32) for v in (0.0, -0.0, 1.0, np.nan, 1e-45, 3e38)])

    def f(h, s, a):
        return jax.vmap(lambda h, s, a: jax_fp8.amax_and_scale_update(h, s, a, **UPD),
                        in_axes=(None, None, 0))(h, s, a)

    out = run_on(device, f, h, s, amaxes)
    for b in range(amaxes.shape[0]):
        _assert_update([o[b] for o in out], h, s, amaxes[b], f"batch {b}", **UPD)


def test_vmap_batch_axis_not_leading(device):
    """Batch axis in the middle of the history and scale (in_axes=1), and at the
    history's very end (the history axis then sits before the batch axis)."""
    h, s, a = _cases(3, (4, 7), 16)  # lead (4, 7): vmap over axis 1 (size 7)

    def mid(h, s, a):
        return jax.vmap(lambda h, s, a: jax_fp8.amax_and_scale_update(h, s, a, **UPD),
                        in_axes=(1, 1, 1))(h, s, a)

    out = run_on(device, mid, h, s, a)
    _assert_update(out, np.moveaxis(h, 1, 0), s.T, a.T, "in_axes=1", **UPD)

    # History [L, B] with the batch last; scale [B]; amax unbatched (broadcast).
    hl = np.ascontiguousarray(h[0].T)  # [16, 7]
    s0 = s[0]
    a0 = np.float32(2.0)

    def last(h, s, a):
        return jax.vmap(lambda h, s, a: jax_fp8.amax_and_scale_update(h, s, a, **UPD),
                        in_axes=(1, 0, None), out_axes=(1, 0, 0))(h, s, a)

    out = run_on(device, last, hl, s0, a0)
    want = ref.update(hl.T, s0, np.full(7, a0, np.float32), **UPD)
    assert_bits_equal(out[0], want[0].T, "history (batch last)")
    assert_bits_equal(out[1], want[1], "scale (batch last)")
    assert_bits_equal(out[2], want[2], "scale_inv (batch last)")


def test_nested_vmap_and_vmap_of_update_states(device):
    h, s, a = _cases(4, (3, 4, 5), 2)

    def f(h, s, a):
        g = lambda h, s, a: jax_fp8.amax_and_scale_update(h, s, a, **UPD)  # noqa: E731
        return jax.vmap(jax.vmap(g, in_axes=(1, 1, 1)))(h, s, a)

    out = run_on(device, f, h, s, a)
    _assert_update(out, np.moveaxis(h, 2, 1), np.moveaxis(s, 2, 1), np.moveaxis(a, 2, 1),
                   "nested vmap", **UPD)

    states = jax_fp8.ScalingState(jnp.asarray(h), jnp.asarray(s), jnp.zeros_like(s),
                                  fp8_dtype=jnp.float8_e5m2)
    recipe = jax_fp8.DelayedScaling(margin=1.0, skip_unused=True)
    out = run_on(device, jax.vmap(lambda st, a: jax_fp8.update_states(st, a, recipe=recipe)),
                 states, a)
    assert out.fp8_dtype == np.dtype(jnp.float8_e5m2)
    _assert_update((out.amax_history, out.scale, out.scale_inv), h, s, a, "vmap(update_states)",
                   fp8_dtype="float8_e5m2", **UPD)


@pytest.mark.parametrize("impl", ["auto", "jnp"])
def test_scan_100_steps_matches_numpy_loop(device, impl):
    """A training-loop shape: 100 steps, each stages a new amax and updates."""
    steps, lead, L = 100, (6,), 16
    rng = np.random.default_rng(5)
    h, s, _ = helpers.make_cases(rng, lead, L, False)
    amaxes = helpers.random_amax_values(rng, (steps,) + lead, special_p=0.2)
    if impl == "jnp":  # no subnormals anywhere, so the fallback must match too
        h, s, amaxes = (np.where(helpers.subnormal_rows((x, False)), 0.0, x).astype(np.float32)
                        for x in (h, s, amaxes))
    kw = dict(amax_compute_algo="max", power_of_2_scale=True, skip_unused=False)

    def run(h, s, amaxes):
        def body(carry, amax):
            h, s = carry
            h, s, si = jax_fp8.amax_and_scale_update(h, s, amax, implementation=impl, **kw)
            return (h, s), (s, si)

        return jax.lax.scan(body, (h, s), amaxes)

    (h_end, s_end), (s_all, si_all) = run_on(device, run, h, s, amaxes)
    hn, sn = h.copy(), s.copy()
    for t in range(steps):
        hn, sn, sin = ref.update(hn, sn, amaxes[t], **kw)
        if impl == "jnp" and helpers.subnormal_rows((sin, False)).any():
            pytest.fail("test inputs must avoid subnormal results for the jnp path")
        assert_bits_equal(s_all[t], sn, f"scale at step {t}")
        assert_bits_equal(si_all[t], sin, f"scale_inv at step {t}")
    assert_bits_equal(h_end, hn, "final history")
    assert_bits_equal(s_end, sn, "final scale")


def test_scan_over_update_states(device):
    tree = {"x": jax_fp8.ScalingState.create((2,), 4, jnp.float8_e4m3fn),
            "g": jax_fp8.ScalingState.create((), 3, jnp.float8_e5m2)}
    amaxes = {"x": jnp.arange(20, dtype=jnp.float32).reshape(10, 2) + 1,
              "g": jnp.arange(10, dtype=jnp.float32) * 2 + 1}

    def run(tree, amaxes):
        def body(t, a):
            t = jax_fp8.update_states(t, a)
            return t, t["g"].scale
        return jax.lax.scan(body, tree, amaxes)

    out, g_scales = run_on(device, run, tree, amaxes)
    hx, sx = np.zeros((2, 4), np.float32), np.ones(2, np.float32)
    hg, sg = np.zeros(3, np.float32), np.ones((), np.float32)
    for t in range(10):
        hx, sx, six = ref.update(hx, sx, np.asarray(amaxes["x"][t]))
        hg, sg, sig = ref.update(hg, sg, np.asarray(amaxes["g"][t]), fp8_dtype="float8_e5m2")
        assert_bits_equal(g_scales[t], sg, f"g scale at {t}")
    assert_bits_equal(out["x"].amax_history, hx, "x history")
    assert_bits_equal(out["x"].scale_inv, six, "x scale_inv")
    assert_bits_equal(out["g"].amax_history, hg, "g history")


def test_checkpoint(device):
    h, s, a = _cases(6, (8,), 16)
    f = lambda h, s, a: jax_fp8.amax_and_scale_update(h, s, a, **UPD)  # noqa: E731
    out = run_on(device, jax.checkpoint(f), h, s, a)
    _assert_update(out, h, s, a, "checkpoint", **UPD)

    # Rematerialised inside a differentiated function: the loss uses the new scale.
    # (Values chosen so that XLA's own gradient arithmetic stays exact and normal.)
    p = np.arange(1, 9, dtype=np.float32)
    h = np.exp2(np.arange(16 * 8, dtype=np.float32) % 7).reshape(8, 16).astype(np.float32)
    s = np.ones(8, np.float32)
    a = np.exp2(np.arange(8, dtype=np.float32)).astype(np.float32)

    def loss(p, h, s, a):
        _, s_new, _ = jax.checkpoint(f)(h, s, a)
        return jnp.sum(p * p * s_new)

    g = run_on(device, jax.grad(loss), p, h, s, a)
    s_new = ref.update(h, s, a, **UPD)[1]
    np.testing.assert_array_equal(s_new, np.float32(224.0) / np.maximum(np.float32(64), a))
    np.testing.assert_array_equal(g, (np.float32(2) * p) * s_new)


def _model_loss(params, state, amaxes):
    """A toy FP8 step: the state is updated, and the new scale enters the loss."""
    new_state = jax_fp8.update_states(state, amaxes)
    x_scale = new_state["x"].scale
    w_scale = new_state["w"].scale_inv
    loss = jnp.sum(params["w"] * params["w"]) * x_scale + jnp.sum(params["b"]) * w_scale
    return loss, new_state


def test_grad_through_update_states(device):
    params = {"w": np.array([1.0, -2.0, 3.0], np.float32), "b": np.array([0.5, 0.25], np.float32)}
    state = {"x": jax_fp8.ScalingState.create((), 4), "w": jax_fp8.ScalingState.create((), 4)}
    amaxes = {"x": np.float32(14.0), "w": np.float32(7.0)}

    def step(params, state, amaxes):
        (loss, new_state), grads = jax.value_and_grad(_model_loss, has_aux=True)(
            params, state, amaxes)
        return loss, grads, new_state

    loss, grads, new_state = run_on(device, step, params, state, amaxes)
    # x: 448 / 14 = 32; w: scale 448 / 7 = 64, scale_inv 1 / 64.
    assert new_state["x"].scale == np.float32(32.0)
    assert new_state["w"].scale_inv == np.float32(1 / 64)
    assert loss == np.float32(14.0 * 32.0 + 0.75 / 64)
    np.testing.assert_array_equal(grads["w"], np.float32(2 * 32.0) * params["w"])
    np.testing.assert_array_equal(grads["b"], np.full(2, 1 / 64, np.float32))

    # The state itself gets zero gradients (it is bookkeeping, not differentiated).
    g_state = run_on(device, jax.grad(lambda st: _model_loss(params, st, amaxes)[0]), state,
                     check_device=False)  # constant zeros land on the default device
    for leaf in jax.tree.leaves(g_state):
        assert_bits_equal(leaf, np.zeros_like(leaf), "state gradient")


def test_grad_eager_and_jvp():
    state = jax_fp8.ScalingState.create((2,), 3)

    def loss(p, st):
        new = jax_fp8.update_states(st, jnp.array([2.0, 4.0], jnp.float32))
        return jnp.sum(p * new.scale)

    p = jnp.array([1.0, 1.0], jnp.float32)
    g = jax.grad(loss)(p, state)  # eager, no jit
    np.testing.assert_array_equal(np.asarray(g), np.array([224.0, 112.0], np.float32))
    primal, tangent = jax.jvp(lambda h: jax_fp8.amax_and_scale_update(h, jnp.ones(2))[1],
                              (state.amax_history + 1,), (jnp.ones((2, 3)),))
    np.testing.assert_array_equal(np.asarray(primal), np.full(2, 448.0, np.float32))
    np.testing.assert_array_equal(np.asarray(tangent), np.zeros(2, np.float32))
