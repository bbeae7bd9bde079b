"""Compiled-program checks: one fused custom call, in place under donation, copies
without it, and no custom call for implementation="jnp"."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import ieee_reference as ref
import jax_fp8
from helpers import assert_bits_equal

TARGET = 'custom_call_target="jax_fp8_update"'
LS = (1, 2, 16, 1024)
DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
SHAPES = ((), (3,), (2, 2))


def _tree(n, device=None, seed=0):
    """n ScalingStates of mixed history lengths, dtypes and leading shapes, as a
    nested pytree of ScalingState leaves only, with random (non-fresh) contents."""
    rng = np.random.default_rng(seed)
    states = []
    for i in range(n):
        shape, L = SHAPES[i % 3], LS[i % 4]
        h, s, _ = helpers.make_cases(rng, shape, L, False)
        st = jax_fp8.ScalingState(h, s, np.ones(shape, np.float32), fp8_dtype=DTYPES[i % 2])
        states.append(st)
    tree = {"blocks": [states[i:i + 10] for i in range(0, n, 10)]}
    if device is not None:
        tree = jax.device_put(tree, device)
    return tree


def _nbytes(tree):
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def _ops(hlo_text):
    """Opcode counts of the compiled HLO's entry computation and everything else."""
    return re.findall(r"=\s*\S+\s+([a-z][a-z0-9\-]*)\(", hlo_text)


def test_1000_states_lower_to_one_custom_call():
    """1,000 states (every L, both dtypes, several shapes): one custom call in the
    lowered program. With in_place=True it aliases every state buffer to its result;
    by default (more than IN_PLACE_MAX_STATES states) it aliases none."""
    tree = _tree(1000)
    text = jax.jit(functools.partial(jax_fp8.update_states, in_place=True)).lower(
        tree).as_text()
    assert text.count("stablehlo.custom_call @jax_fp8_update") == 1
    assert text.count("stablehlo.custom_call") == 1
    # 3 aliased operands (history, scale, scale_inv) per state.
    assert text.count("#stablehlo.output_operand_alias") == 3000
    text = jax.jit(jax_fp8.update_states).lower(tree).as_text()
    assert text.count("stablehlo.custom_call @jax_fp8_update") == 1
    assert text.count("#stablehlo.output_operand_alias") == 0


def test_many_states_compile_to_one_custom_call(device):
    """The compiled program for 120 mixed states holds exactly one jax_fp8_update
    custom call and nothing that computes (parameters, copies, tuples only)."""
    tree = _tree(120, device)
    compiled = jax.jit(jax_fp8.update_states).lower(tree).compile()
    text = compiled.as_text()
    assert text.count(TARGET) == 1, text[:2000]
    ops = set(_ops(text)) - {"parameter", "copy", "get-tuple-element", "tuple", "custom-call",
                             "bitcast", "copy-start", "copy-done"}
    assert not ops, ops


@pytest.mark.slow
def test_1000_states_compile_to_one_custom_call():
    """A 1,000-tensor model, compiled (slow: XLA CPU's compile time grows
    quadratically with the custom call's operand count)."""
    tree = _tree(1000)
    compiled = jax.jit(functools.partial(jax_fp8.update_states, in_place=True),
                       donate_argnums=0).lower(tree).compile()
    assert compiled.as_text().count(TARGET) == 1
    assert compiled.memory_analysis().alias_size_in_bytes == _nbytes(tree)


def test_donation_is_in_place(device):
    """Donated states: the compiled program aliases exactly the states' bytes, has
    no copy, and the caller's (donated) buffers are consumed."""
    tree = _tree(100, device, seed=1)
    want_in = jax.tree.map(np.array, tree)
    compiled = jax.jit(jax_fp8.update_states, donate_argnums=0).lower(tree).compile()
    assert compiled.memory_analysis().alias_size_in_bytes == _nbytes(tree)
    text = compiled.as_text()
    assert text.count(TARGET) == 1
    assert "copy" not in set(_ops(text))
    out = compiled(tree)
    assert all(x.is_deleted() for x in jax.tree.leaves(tree))
    for st_in, st_out in zip(jax.tree.leaves(want_in, is_leaf=lambda x: isinstance(
            x, jax_fp8.ScalingState)), jax.tree.leaves(out, is_leaf=lambda x: isinstance(
            x, jax_fp8.ScalingState))):
        want = ref.update(st_in.amax_history, st_in.scale, fp8_dtype=st_in.fp8_dtype)
        for g, w in zip((st_out.amax_history, st_out.scale, st_out.scale_inv), want):
            assert_bits_equal(g, w, "donated update")


def test_donation_with_amaxes(device):
    """Amaxes are read only: donating the states alone aliases the states' bytes."""
    tree = _tree(40, device, seed=2)
    amaxes = jax.tree.map(lambda st: jnp.full(st.scale.shape, 3.5, jnp.float32), tree,
                          is_leaf=lambda x: isinstance(x, jax_fp8.ScalingState))
    amaxes = jax.device_put(amaxes, device)
    compiled = jax.jit(jax_fp8.update_states, donate_argnums=0).lower(tree, amaxes).compile()
    assert compiled.memory_analysis().alias_size_in_bytes == _nbytes(tree)
    assert compiled.as_text().count(TARGET) == 1


def test_amax_and_scale_update_donation(device):
    """The single-stack API: history and scale are updated in place; scale_inv is a
    new output (it is not an input)."""
    h = jax.device_put(np.ones((8, 1024), np.float32), device)
    s = jax.device_put(np.ones(8, np.float32), device)
    compiled = jax.jit(jax_fp8.amax_and_scale_update, donate_argnums=(0, 1)).lower(h, s).compile()
    assert compiled.memory_analysis().alias_size_in_bytes == h.nbytes + s.nbytes
    assert compiled.as_text().count(TARGET) == 1


def test_without_donation_caller_arrays_unchanged(device):
    """No donation: XLA copies first; the caller's arrays keep their values and
    stay alive, while the results are the update."""
    tree = _tree(30, device, seed=3)
    before = jax.tree.map(np.array, tree)
    compiled = jax.jit(jax_fp8.update_states).lower(tree).compile()
    assert compiled.memory_analysis().alias_size_in_bytes == 0
    for call in (compiled, jax.jit(jax_fp8.update_states), jax_fp8.update_states):
        out = call(tree)
        assert not any(x.is_deleted() for x in jax.tree.leaves(tree))
        for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(before)):
            assert_bits_equal(np.asarray(x), y, "caller's array after the call")
        first = jax.tree.leaves(out)[0]
        assert not np.array_equal(helpers.bits(first), helpers.bits(jax.tree.leaves(before)[0]))

    # The single-stack API, eager and jitted.
    h = jax.device_put(np.arange(12, dtype=np.float32).reshape(3, 4) + 1, device)
    s = jax.device_put(np.ones(3, np.float32), device)
    h0, s0 = np.array(h), np.array(s)
    for f in (jax_fp8.amax_and_scale_update, jax.jit(jax_fp8.amax_and_scale_update)):
        nh, ns, _ = f(h, s)
        assert_bits_equal(np.asarray(h), h0, "history")
        assert_bits_equal(np.asarray(s), s0, "scale")
        assert_bits_equal(np.asarray(nh), ref.update(h0, s0)[0], "new history")


def test_jnp_implementation_has_no_custom_call(device):
    tree = _tree(4, device, seed=4)
    text = jax.jit(lambda t: jax_fp8.update_states(t, implementation="jnp")).lower(
        tree).compile().as_text()
    assert "custom-call" not in _ops(text) and "jax_fp8_update" not in text
    h = jax.device_put(np.ones((4, 16), np.float32), device)
    s = jax.device_put(np.ones(4, np.float32), device)
    text = jax.jit(lambda h, s: jax_fp8.amax_and_scale_update(h, s, implementation="jnp")).lower(
        h, s).compile().as_text()
    assert "custom-call" not in _ops(text) and "jax_fp8_update" not in text
    text = jax.jit(jax_fp8.amax_and_scale_update).lower(h, s).compile().as_text()
    assert text.count(TARGET) == 1  # and "auto" does use the kernel


def test_two_calls_are_two_custom_calls_and_options_are_attributes():
    """Sanity of the counting itself: two updates in one program are two custom
    calls; the options travel as attributes of the one call."""
    h = jnp.ones((4, 16), jnp.float32)
    s = jnp.ones(4, jnp.float32)

    def f(h, s):
        h, s, _ = jax_fp8.amax_and_scale_update(h, s)
        return jax_fp8.amax_and_scale_update(h, s, margin=1.0, amax_compute_algo="most_recent",
                                             power_of_2_scale=True, skip_unused=True)

    lowered = jax.jit(f).lower(h, s)
    assert lowered.compile().as_text().count(TARGET) == 2
    text = lowered.as_text()
    assert "amax_compute_algo = 1 : i32" in text and "power_of_2_scale = true" in text
    assert "scaled_max = dense<2.240000e+02>" in text


def test_2000_separate_states_compile_to_one_custom_call_and_run():
    """A model that is not packed (one state array per FP8 tensor) with 2,000 states:
    out of place by default, so XLA compiles it in time ~linear in the number of states
    (seconds here; minutes with every state aliased). Bits equal the IEEE reference's."""
    tree = [jax_fp8.ScalingState.create((), 16 if i % 2 else 64,
                                        jnp.float8_e4m3fn if i % 3 else jnp.float8_e5m2)
            for i in range(2000)]
    amaxes = [jnp.float32(i % 7) for i in range(2000)]
    compiled = jax.jit(jax_fp8.update_states).lower(tree, amaxes).compile()
    assert compiled.as_text().count(TARGET) == 1
    got = compiled(tree, amaxes)
    for st, new, amax in zip(tree, got, amaxes, strict=True):
        h, s, si = ref.update(np.asarray(st.amax_history), np.asarray(st.scale),
                              np.asarray(amax), fp8_dtype=st.fp8_dtype.name)
        assert_bits_equal(new.amax_history, h)
        assert_bits_equal(new.scale, s)
        assert_bits_equal(new.scale_inv, si)
