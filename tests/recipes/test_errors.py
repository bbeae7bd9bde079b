"""Bad input raises a TypeError / ValueError naming the argument, at trace time
(eagerly and inside jax.jit alike), and leaves the caller's state intact."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp8
from helpers import assert_bits_equal

F32 = jnp.float32


def _h(shape=(3, 8), dtype=F32):
    return jnp.ones(shape, dtype)


def _s(shape=(3,), dtype=F32):
    return jnp.ones(shape, dtype)


def _call(*arrays, **kw):
    return jax_fp8.amax_and_scale_update(*arrays, **kw)


# (id, array arguments, keyword options, exception type, regex the message must match)
STACK_CASES = [
    ("history-f16", (_h(dtype=jnp.float16), _s()), {}, TypeError, r"amax_history.*float32"),
    ("history-bf16", (_h(dtype=jnp.bfloat16), _s()), {}, TypeError, r"amax_history.*float32"),
    ("history-i32", (_h(dtype=jnp.int32), _s()), {}, TypeError, r"amax_history.*float32"),
    ("scale-f16", (_h(), _s(dtype=jnp.float16)), {}, TypeError, r"scale.*float32"),
    ("scale-bf16", (_h(), _s(dtype=jnp.bfloat16)), {}, TypeError, r"scale.*float32"),
    ("scale-i32", (_h(), _s(dtype=jnp.int32)), {}, TypeError, r"scale.*float32"),
    ("amax-f16", (_h(), _s(), _s(dtype=jnp.float16)), {}, TypeError, r"amax.*float32"),
    ("amax-bf16", (_h(), _s(), _s(dtype=jnp.bfloat16)), {}, TypeError, r"amax.*float32"),
    ("amax-i32", (_h(), _s(), _s(dtype=jnp.int32)), {}, TypeError, r"amax.*float32"),
    ("scale-shape", (_h(), _s((4,))), {}, ValueError, r"scale.*\(4,\).*\(3,\)"),
    ("scale-rank", (_h(), _s((3, 8))), {}, ValueError, r"scale"),
    ("scale-scalar-for-stack", (_h(), _s(())), {}, ValueError, r"scale"),
    ("amax-shape", (_h(), _s(), _s((3, 1))), {}, ValueError, r"amax.*\(3, 1\)"),
    ("history-rank0", (jnp.float32(1.0), _s(())), {}, ValueError, r"amax_history"),
    ("history-L0", (_h((3, 0)), _s()), {}, ValueError, r"amax_history.*>= 1"),
    ("algo", (_h(), _s()), {"amax_compute_algo": "mean"}, ValueError, r"amax_compute_algo"),
    ("algo-none", (_h(), _s()), {"amax_compute_algo": None}, ValueError, r"amax_compute_algo"),
    ("margin-nan", (_h(), _s()), {"margin": float("nan")}, ValueError, r"margin"),
    ("margin-inf", (_h(), _s()), {"margin": float("inf")}, ValueError, r"margin"),
    ("margin-neg-inf", (_h(), _s()), {"margin": -float("inf")}, ValueError, r"margin"),
    ("margin-np-nan", (_h(), _s()), {"margin": np.float32("nan")}, ValueError, r"margin"),
    ("margin-1e4", (_h(), _s()), {"margin": 1e4}, ValueError, r"margin"),
    ("margin-neg-1e4", (_h(), _s()), {"margin": -1e4}, ValueError, r"margin"),
    ("margin-200", (_h(), _s()), {"margin": -200.0}, ValueError, r"margin"),
    ("margin-str", (_h(), _s()), {"margin": "1"}, TypeError, r"margin"),
    ("margin-bool", (_h(), _s()), {"margin": True}, TypeError, r"margin"),
    ("margin-array", (_h(), _s()), {"margin": jnp.float32(1.0)}, TypeError, r"margin"),
    ("pow2-int", (_h(), _s()), {"power_of_2_scale": 1}, TypeError, r"power_of_2_scale"),
    ("pow2-str", (_h(), _s()), {"power_of_2_scale": "yes"}, TypeError, r"power_of_2_scale"),
    ("pow2-none", (_h(), _s()), {"power_of_2_scale": None}, TypeError, r"power_of_2_scale"),
    ("skip-int", (_h(), _s()), {"skip_unused": 0}, TypeError, r"skip_unused"),
    ("dtype-f32", (_h(), _s()), {"fp8_dtype": jnp.float32}, TypeError, r"fp8_dtype"),
    ("dtype-i8", (_h(), _s()), {"fp8_dtype": jnp.int8}, TypeError, r"fp8_dtype"),
    ("dtype-u8", (_h(), _s()), {"fp8_dtype": np.uint8}, TypeError, r"fp8_dtype"),
    ("dtype-bf16", (_h(), _s()), {"fp8_dtype": jnp.bfloat16}, TypeError, r"fp8_dtype"),
    ("dtype-str", (_h(), _s()), {"fp8_dtype": "e4m3"}, TypeError, r"fp8_dtype"),
    ("implementation", (_h(), _s()), {"implementation": "cuda"}, ValueError,
     r"implementation"),
    ("implementation-local", (_h(), _s()), {"implementation": "local"}, ValueError,
     r"implementation"),
]


@pytest.mark.parametrize("arrays,kw,exc,pattern", [c[1:] for c in STACK_CASES],
                         ids=[c[0] for c in STACK_CASES])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_amax_and_scale_update_rejects(arrays, kw, exc, pattern, mode):
    f = (lambda *a: _call(*a, **kw))  # noqa: E731
    if mode == "jit":
        f = jax.jit(f)
    with pytest.raises(exc, match=pattern):
        f(*arrays)


def test_non_array_history_is_a_type_error():
    with pytest.raises(TypeError, match="amax_history"):
        _call([[1.0, 2.0]], jnp.ones(1))


# ----------------------------------------------------------------------------
# update_states

def _tree():
    return {"x": jax_fp8.ScalingState.create((2,), 8),
            "w": [jax_fp8.ScalingState.create((), 4, jnp.float8_e5m2)],
            "other": jnp.arange(3.0)}


def _amaxes():
    return {"x": jnp.ones(2, F32), "w": [jnp.float32(1.0)], "other": None}


def _with(tree, path, **fields):
    import dataclasses
    t = jax.tree.map(lambda x: x, tree, is_leaf=lambda x: isinstance(x, jax_fp8.ScalingState))
    if path == "x":
        t["x"] = dataclasses.replace(t["x"], **fields)
    else:
        t["w"][0] = dataclasses.replace(t["w"][0], **fields)
    return t


def _tree_cases():
    t = _tree()
    a = _amaxes()
    return [
        ("amaxes-structure", t, {"x": jnp.ones(2, F32)}, {}, ValueError, r"amaxes"),
        ("amaxes-list-for-dict", t, [jnp.ones(2, F32)], {}, ValueError, r"amaxes"),
        ("amaxes-extra", t, {**a, "extra": jnp.ones(1)}, {}, ValueError, r"amaxes"),
        ("amax-shape", t, {**a, "x": jnp.ones(3, F32)}, {}, ValueError,
         r"\['x'\].*amax.*\(3,\)"),
        ("amax-dtype", t, {**a, "w": [jnp.ones((), jnp.bfloat16)]}, {}, TypeError,
         r"\['w'\]\[0\].*amax.*float32"),
        ("state-history-f16", _with(t, "x", amax_history=jnp.ones((2, 8), jnp.float16)), None,
         {}, TypeError, r"\['x'\].*amax_history.*float32"),
        ("state-scale-i32", _with(t, "w", scale=jnp.ones((), jnp.int32)), None, {},
         TypeError, r"\['w'\]\[0\].*scale.*float32"),
        ("state-scale-shape", _with(t, "x", scale=jnp.ones(3, F32)), None, {}, ValueError,
         r"\['x'\].*scale"),
        ("state-scale_inv-shape", _with(t, "x", scale_inv=jnp.ones((2, 1), F32)), None, {},
         ValueError, r"\['x'\].*scale_inv"),
        ("state-L0", _with(t, "w", amax_history=jnp.ones((0,), F32)), None, {}, ValueError,
         r"\['w'\]\[0\].*amax_history"),
        ("state-rank0", _with(t, "w", amax_history=jnp.float32(1.0)), None, {}, ValueError,
         r"amax_history"),
        ("recipe-dict", t, None, {"recipe": {"margin": 0.0}}, TypeError, r"recipe"),
        ("recipe-none", t, None, {"recipe": None}, TypeError, r"recipe"),
        ("recipe-format", t, None, {"recipe": jax_fp8.Format.HYBRID}, TypeError, r"recipe"),
        ("implementation", t, None, {"implementation": "gpu"}, ValueError, r"implementation"),
    ]


TREE_CASES = _tree_cases()


@pytest.mark.parametrize("tree,amaxes,kw,exc,pattern", [c[1:] for c in TREE_CASES],
                         ids=[c[0] for c in TREE_CASES])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_update_states_rejects(tree, amaxes, kw, exc, pattern, mode):
    f = lambda t, a: jax_fp8.update_states(t, a, **kw)  # noqa: E731
    if mode == "jit":
        f = jax.jit(f)
    with pytest.raises(exc, match=pattern):
        f(tree, amaxes)


@pytest.mark.parametrize("kw,exc,pattern", [
    ({"history_len": 0}, ValueError, "history_len"),
    ({"history_len": -3}, ValueError, "history_len"),
    ({"history_len": 2.5}, ValueError, "history_len"),
    ({"history_len": True}, ValueError, "history_len"),
    ({"amax_compute_algo": "avg"}, ValueError, "amax_compute_algo"),
    ({"margin": float("nan")}, ValueError, "margin"),
    ({"margin": float("inf")}, ValueError, "margin"),
    ({"margin": 1e4}, ValueError, "margin"),
    ({"margin": -1e4}, ValueError, "margin"),
    ({"margin": "0"}, TypeError, "margin"),
    ({"fp8_format": "HYBRID"}, TypeError, "fp8_format"),
    ({"power_of_2_scale": 1}, TypeError, "power_of_2_scale"),
    ({"skip_unused": "no"}, TypeError, "skip_unused"),
], ids=lambda v: repr(v) if not isinstance(v, dict) else ",".join(f"{k}={v[k]!r}" for k in v))
def test_delayed_scaling_rejects(kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        jax_fp8.DelayedScaling(**kw)


@pytest.mark.parametrize("kw,exc,pattern", [
    ({"history_len": 0}, ValueError, "history_len"),
    ({"history_len": 1.5}, ValueError, "history_len"),
    ({"fp8_dtype": jnp.float32}, TypeError, "fp8_dtype"),
    ({"fp8_dtype": jnp.int8}, TypeError, "fp8_dtype"),
    ({"shape": (-1,)}, ValueError, "shape"),
])
def test_scaling_state_create_rejects(kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        jax_fp8.ScalingState.create(**kw)


def test_scaling_state_rejects_non_fp8_dtype():
    with pytest.raises(TypeError, match="fp8_dtype"):
        jax_fp8.ScalingState(jnp.zeros(4), jnp.ones(()), jnp.ones(()), fp8_dtype=jnp.float16)


def test_errors_name_the_argument_not_just_the_type():
    """The messages say which argument and what was wrong (not a bare XLA error)."""
    with pytest.raises(ValueError) as info:
        _call(_h((3, 8)), _s((3,)), _s((2,)))
    msg = str(info.value)
    assert "amax" in msg and "(2,)" in msg and "(3,)" in msg
    assert not re.search(r"XlaRuntimeError|INVALID_ARGUMENT", msg)


# ----------------------------------------------------------------------------
# A failed call leaves the caller's state intact.

def test_failed_call_leaves_state_intact():
    tree = _tree()
    before = jax.tree.map(np.array, tree)
    bad = {**_amaxes(), "x": jnp.ones(5, F32)}
    for f in (jax_fp8.update_states, jax.jit(jax_fp8.update_states),
              jax.jit(jax_fp8.update_states, donate_argnums=(0,))):
        with pytest.raises(ValueError, match="amax"):
            f(tree, bad)
        assert not any(x.is_deleted() for x in jax.tree.leaves(tree))
        for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(before)):
            assert_bits_equal(np.asarray(x), y, "state after a failed call")
    # And the same state still updates fine afterwards.
    out = jax.jit(jax_fp8.update_states)(tree, _amaxes())
    assert out["x"].scale.tolist() == [448.0, 448.0]

    h, s = jnp.full((3, 4), 2.0, F32), jnp.full(3, 7.0, F32)
    for kw in ({"margin": float("nan")}, {"amax_compute_algo": "x"}):
        with pytest.raises(ValueError):
            jax.jit(lambda h, s: _call(h, s, **kw), donate_argnums=(0, 1))(h, s)
        assert not h.is_deleted() and not s.is_deleted()
        assert np.all(np.asarray(h) == 2.0) and np.all(np.asarray(s) == 7.0)


def test_donating_one_state_twice_is_refused_and_loses_nothing():
    """The same buffers twice in a donated tree: JAX refuses the call before running it
    (its runtime check, at call time: buffer identity is not known while tracing), with
    an error that says so; nothing is consumed and the state still updates afterwards.
    Not donated, the same state twice is simply updated twice, independently."""
    st = jax_fp8.ScalingState(jnp.full((4,), 2.0, F32), jnp.ones((), F32), jnp.ones((), F32))
    donated = jax.jit(jax_fp8.update_states, donate_argnums=0)
    with pytest.raises(Exception, match="donate the same buffer twice"):
        donated([st, st])
    assert not any(x.is_deleted() for x in jax.tree.leaves(st))
    assert np.asarray(st.amax_history).tolist() == [2.0] * 4
    a, b = jax.jit(jax_fp8.update_states)([st, st])
    assert_bits_equal(np.asarray(a.scale), np.asarray(b.scale), "same state twice")
    assert float(donated(st).scale) == 224.0  # 448 / max(2, 2, 2)
