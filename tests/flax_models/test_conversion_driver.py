"""The conversion driver every framework adapter runs a converted call in
(`jax_fp8.interception.converting`): its effects last for the call and act in the calling
thread only. A replacement that fails to go in leaves none in; a call the conversion leaves
alone goes to the function installed when the call began (another library's wrapper
included); a trace made inside a converted module is never reused outside it, nor the other
way round; an exception, another thread, a converted model nested in another: each leaves
JAX as it was and the results those of each model alone."""

from __future__ import annotations

import threading
import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from flax import nnx
from jax import lax

import jax_fp8
import jax_fp8.equinox as jfe
from jax_fp8 import Fp8Meta, Fp8Rule, interception
from jax_fp8.flax import fp8_model

assert_equal = np.testing.assert_array_equal
CURRENT = jax_fp8.Float8CurrentScaling()
ACTIVATIONS = Fp8Rule(recipe=CURRENT, activations=True, min_fp8_flops=0)
Q, K = jr.normal(jr.key(1), (8, 32)), jr.normal(jr.key(2), (8, 32))
DN = (((1,), (1,)), ((), ()))


def _nothing_installed():
    """JAX's functions are those found at import, and no primitive's bind is replaced."""
    assert jax.lax.dot_general is interception.ORIGINAL["dot_general"]
    assert jnp.einsum is interception.ORIGINAL["einsum"]
    assert jnp.matmul is interception.ORIGINAL["matmul"]
    assert "param" not in {n for n, v in vars(nn.Module).items()
                           if getattr(v, "__module__", "").startswith("jax_fp8")}
    for prim in interception.FOLLOWED:
        assert "bind" not in vars(prim), prim
    assert interception.current() is None
    assert interception.conversion_key.value is None


def _plain_scores(q, k):
    return interception.ORIGINAL["einsum"]("qd,kd->qk", q, k)


def _fp8_scores(q, k):
    return jax_fp8.fp8_einsum("qd,kd->qk", q, k, Fp8Meta.create(CURRENT))[0]


@jax.jit
def scores(q, k):
    """A helper jitted once at module level, as codebases write attention."""
    return jnp.einsum("qd,kd->qk", q, k)


class Attention(eqx.Module):
    """Calls the jitted helper: its GEMM of two activations is converted under
    `ACTIVATIONS`."""

    def __call__(self, q, k):
        return scores(q, k)


class Projection(eqx.Module):
    """A weight GEMM (converted) and a GEMM of two activations (left alone)."""

    w: jax.Array

    def __call__(self, x):
        h = lax.dot_general(x, self.w, DN)
        return h + lax.dot_general(x, x, DN)[:, :1]


def _projection():
    return jfe.fp8_model(Projection(jr.normal(jr.key(3), (16, 32))), Fp8Rule(min_fp8_flops=0))


# ------------------------------------------------------------------------------- install


class _Slotted:
    __slots__ = ()


def test_a_replacement_that_fails_to_go_in_leaves_none_in():
    """All or none: the ones installed before the failing one come out again."""
    with pytest.raises(AttributeError), interception.patched(extra=[(_Slotted(), "x", 1)]):
        pass
    _nothing_installed()
    assert interception.installed_now() == {}


def test_a_wrapper_installed_after_import_is_called_while_a_converted_model_runs():
    """Another library's wrapper of jax.lax.dot_general, installed after ``import jax_fp8``,
    gets every call the conversion leaves alone, and is in place again afterwards."""
    model = _projection()
    x = jr.normal(jr.key(4), (4, 32))
    want = model(x)
    calls = []
    inner = jax.lax.dot_general

    def wrapper(*args, **kwargs):
        calls.append(args[0].shape)
        return inner(*args, **kwargs)

    jax.lax.dot_general = wrapper
    try:
        got = model(x)
        assert (4, 32) in calls    # the GEMM of two activations, left alone
        assert jax.lax.dot_general is wrapper
    finally:
        jax.lax.dot_general = inner
    assert_equal(got, want)
    _nothing_installed()


class Wrapping(Projection):
    """Wraps jax.lax.dot_general (the converting function, while it runs) on its first call,
    as a library set up lazily inside a model would."""

    def __call__(self, x):
        if not WRAPPED:
            current = jax.lax.dot_general

            def wrapper(*args, **kwargs):
                WRAPPED.append(1)
                return current(*args, **kwargs)

            WRAPPED.append(wrapper)
            jax.lax.dot_general = wrapper
        return super().__call__(x)


WRAPPED: list = []


def test_a_wrapper_installed_while_a_converted_model_runs_is_left_in_place():
    """A library that wraps jax.lax.dot_general during a converted call keeps its wrapper
    after the call; later converted calls go through it without recursing, and convert."""
    x = jr.normal(jr.key(4), (4, 32))
    want = _projection()(x)
    model = jfe.fp8_model(Wrapping(_projection().w), Fp8Rule(min_fp8_flops=0))
    try:
        assert_equal(model(x), want)
        wrapper = WRAPPED[0]
        assert jax.lax.dot_general is wrapper
        calls = len(WRAPPED)
        assert_equal(model(x), want)            # converted again, through the wrapper
        assert len(WRAPPED) > calls
        assert_equal(_projection()(x), want)
        assert jax.lax.dot_general is wrapper
    finally:
        jax.lax.dot_general = interception.ORIGINAL["dot_general"]
        WRAPPED.clear()
    assert_equal(_projection()(x), want)
    _nothing_installed()


# ----------------------------------------------------------------------------- jit cache


def test_a_jit_helper_traced_inside_a_converted_call_is_plain_outside_it():
    """E5: traced first inside a converted Equinox call (FP8), later called from plain code:
    plain, and FP8 again inside."""
    model = jfe.fp8_model(Attention(), ACTIVATIONS)
    assert_equal(model(Q, K), _fp8_scores(Q, K))
    assert_equal(scores(Q, K), _plain_scores(Q, K))
    assert_equal(model(Q, K), _fp8_scores(Q, K))


def test_a_jit_helper_traced_in_plain_code_converts_inside_a_converted_call():
    q, k = Q[:4], K[:4]    # shapes of their own: a helper traced here first
    assert_equal(scores(q, k), _plain_scores(q, k))
    assert_equal(jfe.fp8_model(Attention(), ACTIVATIONS)(q, k), _fp8_scores(q, k))
    assert_equal(scores(q, k), _plain_scores(q, k))


# -------------------------------------------------------------------- an exception, threads


class Failing(eqx.Module):
    def __call__(self, q, k):
        scores(q, k)
        raise RuntimeError("mid-apply")


def test_an_exception_mid_apply_leaves_nothing_behind():
    """A converted call that raises after tracing a jitted helper: nothing installed, no
    conversion running, the helper plain outside; the next converted call converts and
    reports as the first."""
    q, k = Q[:6], K[:6]
    with pytest.raises(RuntimeError, match="mid-apply"):
        jfe.fp8_model(Failing(), ACTIVATIONS)(q, k)
    assert_equal(scores(q, k), _plain_scores(q, k))
    _nothing_installed()
    assert_equal(jfe.fp8_model(Attention(), ACTIVATIONS)(q, k), _fp8_scores(q, k))


def test_an_exception_mid_linen_apply_leaves_nothing_behind():
    class Broken(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.Dense(8)(x)
            raise ValueError(f"mid-apply {y.shape}")

    class Fine(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(x)

    x = jnp.ones((2, 8))
    variables = fp8_model(Fine()).init(jr.key(0), x)
    with pytest.raises(ValueError, match="mid-apply"):
        fp8_model(Broken()).apply(variables, x)
    _nothing_installed()
    assert jax_fp8.flax.rules.recorded_params() is None
    fp8_model(Fine()).apply(variables, x)


def test_other_threads_see_jax_as_it_is_while_a_model_converts():
    """While one thread is inside a converted call (its jitted helper traced in FP8), another
    thread's plain calls of the same helper and of jax.lax.dot_general are plain, and a
    converted call of its own converts; afterwards nothing is installed."""
    q, k = Q[:5], K[:5]
    inside, done = threading.Event(), threading.Event()
    results, errors = {}, []

    class Waiting(eqx.Module):
        def __call__(self, q, k):
            out = scores(q, k)
            inside.set()
            assert done.wait(60), "the other thread did not finish"
            return out

    def converting():
        try:
            results["converted"] = jfe.fp8_model(Waiting(), ACTIVATIONS)(q, k)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)
            inside.set()

    thread = threading.Thread(target=converting)
    thread.start()
    try:
        assert inside.wait(60)
        results["plain"] = scores(q, k)
        results["dot"] = jax.lax.dot_general(q, k, DN)
        results["other"] = jfe.fp8_model(Attention(), ACTIVATIONS)(q, k)
    finally:
        done.set()
        thread.join(60)
    assert not errors, errors
    assert_equal(results["converted"], _fp8_scores(q, k))
    assert_equal(results["plain"], _plain_scores(q, k))
    assert_equal(results["dot"], interception.ORIGINAL["dot_general"](q, k, DN))
    assert_equal(results["other"], _fp8_scores(q, k))
    _nothing_installed()


# --------------------------------------------------------------------------------- nesting


class _Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(32)(x)


def test_a_linen_model_nested_in_another_converts_with_its_own_rules():
    """A converted model applied inside another converted model's method (rules that
    convert nothing) runs as it does alone: FP8, with its rules."""
    x = jr.normal(jr.key(0), (4, 32))
    inner = fp8_model(_Dense(), Fp8Rule(min_fp8_flops=0))
    inner_vars = inner.init(jr.key(1), x)
    alone = inner.apply(inner_vars, x)
    plain = _Dense().apply({"params": inner_vars["params"]}, x)
    assert not np.array_equal(alone, plain)

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return inner.apply(inner_vars, x), nn.Dense(32)(x)

    outer = fp8_model(Outer(), Fp8Rule(path="nothing"))
    outer_vars = outer.init(jr.key(2), x)
    nested, dense = outer.apply(outer_vars, x)
    assert_equal(nested, alone)
    assert_equal(dense, nn.Dense(32).apply({"params": outer_vars["params"]["Dense_0"]}, x))
    _nothing_installed()


def test_an_equinox_model_nested_in_a_linen_one_converts_with_its_own_rules():
    """And across frameworks: an Equinox model called inside a converted linen model's
    module converts with its rules, and the linen module's GEMM after it with linen's."""
    x = jr.normal(jr.key(4), (4, 32))
    projection = _projection()
    alone = projection(x)

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return projection(x), nn.Dense(32)(x)

    outer = fp8_model(Outer(), Fp8Rule(min_fp8_flops=0))
    variables = outer.init(jr.key(5), x)
    nested, dense = outer.apply(variables, x)
    assert_equal(nested, alone)
    fp8_dense = fp8_model(_Dense(), Fp8Rule(min_fp8_flops=0))
    want = fp8_dense.apply({"params": {"Dense_0": variables["params"]["Dense_0"]},
                            "fp8_meta": {"Dense_0": variables["fp8_meta"]["Dense_0"]}}, x)
    assert_equal(dense, want)
    _nothing_installed()


def test_nnx_and_equinox_converted_calls_nest():
    """An NNX module of one's own calling a converted Equinox model between two GEMMs of
    its weight: both of its GEMMs convert (its site is running again after the inner call),
    and the inner model's as it does alone."""
    x = jr.normal(jr.key(6), (4, 32))
    projection = _projection()
    alone = projection(x)

    class Mixed(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jr.normal(jr.key(7), (32, 32)))

        def __call__(self, x):
            h = x @ self.w[...]
            inner = projection(x)
            return h @ self.w[...], inner

    model = fp8_model(Mixed(), Fp8Rule(min_fp8_flops=0), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jax_fp8.Fp8ConversionWarning)
        out, inner = model(x)
    assert_equal(inner, alone)
    # Both GEMMs of w thread its one state (w_fp8), as without the call between them.
    w, numbers = model.w[...], (((1,), (0,)), ((), ()))
    h, meta = jax_fp8.fp8_dot_general(x, w, numbers, Fp8Meta.create())
    assert_equal(out, jax_fp8.fp8_dot_general(h, w, numbers, meta)[0])
    _nothing_installed()
