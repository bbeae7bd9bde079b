"""jax_fp8._compat: each private JAX name the training-loop guards read still exists and
behaves on the installed jax (a JAX upgrade that renames or changes one fails here, not
silently in a guard that stops raising)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from jax_fp8 import _compat


def test_every_name_is_there_and_a_missing_one_is_an_import_error(monkeypatch):
    _compat.check()
    monkeypatch.setattr(_compat, "_core", object())   # a JAX without trace_ctx
    with pytest.raises(ImportError, match="jax._src.core.trace_ctx"):
        _compat.check()


def test_differentiation_traces_are_recognised():
    seen = {}

    def f(x):
        seen["grad"] = _compat.is_differentiation_trace(_compat.trace_of(x))
        return jnp.sum(x * x)

    jax.grad(f)(jnp.ones(3))
    jax.jvp(lambda x: seen.setdefault("jvp", _compat.is_differentiation_trace(
        _compat.trace_of(x))) and x, (jnp.ones(3),), (jnp.ones(3),))
    jax.jit(lambda x: seen.setdefault("jit", _compat.is_differentiation_trace(
        _compat.trace_of(x))) or x)(jnp.ones(3))
    assert seen == {"grad": True, "jvp": True, "jit": False}
    assert _compat.trace_of(jnp.ones(3)) is None


@pytest.mark.parametrize("loop, run", [
    ("scan", lambda body: lax.scan(lambda c, _: (body(c), None), jnp.ones(3), None, length=2)),
    ("while_body", lambda body: lax.while_loop(lambda c: c[0] < 5, body, jnp.ones(3))),
    ("cond", lambda body: lax.cond(True, body, lambda c: c, jnp.ones(3))),
])
def test_what_a_trace_traces_for(loop, run):
    """The loop and branch names the guards look for (meta.py's LOOPS, BRANCHES)."""
    names = []

    def body(c):
        t = _compat.current_trace()
        while t is not None:
            names.append(_compat.traced_for(t))
            t = _compat.parent_trace(t)
        return c + 1

    jax.jit(lambda: run(body))()
    assert loop in names, names


def test_vmap_traces_are_recognised():
    seen = []
    jax.vmap(lambda x: seen.append(_compat.is_batch_trace(_compat.current_trace())) or x)(
        jnp.ones((2, 3)))
    jax.jit(lambda x: seen.append(_compat.is_batch_trace(_compat.current_trace())) or x)(
        jnp.ones(3))
    assert seen == [True, False]


def test_staged_arguments_are_named():
    """The names of a scan body's arguments (the guard for a read-only collection carried
    by nn.scan reads them): the carry's leaves ``c...``, the xs' ``xs...``; a value
    computed in the body or a concrete array has none."""
    seen = {}

    def body(c, xs):
        seen["carry"] = _compat.staged_argument(c["state"])
        seen["xs"] = _compat.staged_argument(xs[0])
        seen["computed"] = _compat.staged_argument(c["state"] + 1)
        return c, None

    lax.scan(body, {"state": jnp.ones(3)}, (jnp.ones((2, 4)),))
    assert seen == {"carry": "c['state']", "xs": "xs[0]", "computed": None}
    assert _compat.staged_argument(jnp.ones(3)) is None


def test_current_trace_nests_in_its_parents():
    depth = {}

    def f(x):
        chain, t = [], _compat.current_trace()
        while t is not None:
            chain.append(t)
            t = _compat.parent_trace(t)
        depth["n"] = len(chain)
        assert _compat.trace_of(x) in chain
        return x

    jax.jit(jax.grad(lambda x: jnp.sum(f(x))))(jnp.ones(2))
    assert depth["n"] >= 3        # the grad's trace, jit's, the evaluation trace at the root


def test_the_frozen_scales_flag_is_part_of_the_jit_cache_key():
    """`frozen_scales` is a jit-key configuration option (`_compat.jit_key_flag`): a
    function jitted and traced outside it is traced anew inside it, and back."""
    import jax_fp8
    from jax_fp8.meta import scales_frozen

    traced = []
    f = jax.jit(lambda x: (traced.append(scales_frozen()), x + scales_frozen())[1])
    assert float(f(0.0)) == 0.0
    with jax_fp8.frozen_scales():
        assert float(f(0.0)) == 1.0
    assert float(f(0.0)) == 0.0 and traced == [False, True]
