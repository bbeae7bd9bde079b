"""The public API's shape: ScalingState, DelayedScaling, Format, update_states' tree
handling, and the exported names."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp8
from helpers import assert_bits_equal
from jax_fp8 import _registration


def test_exports():
    """__all__ names each public name the package binds (its submodules aside) once, the
    documented ones among them; the kernel flags say whether the kernel modules loaded."""
    public = {n for n, v in vars(jax_fp8).items()
              if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert sorted(public) == sorted(jax_fp8.__all__)
    for name in ("amax_and_scale_update", "update_states", "ScalingState", "DelayedScaling",
                 "Format", "HAS_CPU_KERNEL", "HAS_CUDA_KERNEL", "Recipe"):
        assert name in public, name
    assert jax_fp8.HAS_CPU_KERNEL is (_registration.CPU_MODULE is not None)
    assert jax_fp8.HAS_CUDA_KERNEL is (_registration.CUDA_MODULE is not None)


def test_cpu_kernel_is_built():
    """The suite's bit-exact CPU checks need the CPU kernel; a build that silently
    lost it would fall back to jnp and the numerics tests would be meaningless."""
    assert jax_fp8.HAS_CPU_KERNEL


def test_create_defaults():
    st = jax_fp8.ScalingState.create()
    assert st.amax_history.shape == (1024,) and st.scale.shape == () and st.scale_inv.shape == ()
    assert st.fp8_dtype == np.dtype(jnp.float8_e4m3fn)
    assert st.history_len == 1024
    for x in (st.amax_history, st.scale, st.scale_inv):
        assert x.dtype == jnp.float32
        assert isinstance(x, jax.Array)
    assert_bits_equal(st.amax_history, np.zeros(1024, np.float32), "history")
    assert_bits_equal(st.scale, np.float32(1.0), "scale")
    assert_bits_equal(st.scale_inv, np.float32(1.0), "scale_inv")


def test_create_shape_and_dtype():
    st = jax_fp8.ScalingState.create(shape=(4, 3), history_len=16, fp8_dtype=jnp.float8_e5m2)
    assert st.amax_history.shape == (4, 3, 16)
    assert st.scale.shape == (4, 3) and st.scale_inv.shape == (4, 3)
    assert st.fp8_dtype == np.dtype(jnp.float8_e5m2)
    assert st.history_len == 16
    np.testing.assert_array_equal(np.asarray(st.scale), np.ones((4, 3), np.float32))
    st1 = jax_fp8.ScalingState.create(shape=[2], history_len=np.int64(1))
    assert st1.amax_history.shape == (2, 1)


def test_scaling_state_is_a_pytree_with_static_dtype():
    st = jax_fp8.ScalingState.create((2,), 8, jnp.float8_e5m2)
    leaves, treedef = jax.tree_util.tree_flatten(st)
    assert len(leaves) == 3
    assert leaves[0] is st.amax_history and leaves[1] is st.scale and leaves[2] is st.scale_inv
    assert "float8_e5m2" in str(treedef)
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(back, jax_fp8.ScalingState) and back.fp8_dtype == st.fp8_dtype

    # The dtype is part of the structure: different dtypes, different treedefs; the
    # same dtype however spelled, equal (and equally hashed) treedefs.
    e4 = jax.tree.structure(jax_fp8.ScalingState.create((2,), 8, jnp.float8_e4m3fn))
    e5 = jax.tree.structure(st)
    e5_np = jax.tree.structure(jax_fp8.ScalingState.create((2,), 8, np.dtype(jnp.float8_e5m2)))
    assert e4 != e5
    assert e5 == e5_np and hash(e5) == hash(e5_np)


def test_scaling_state_is_frozen_and_maps():
    st = jax_fp8.ScalingState.create((), 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.scale = jnp.float32(2.0)
    doubled = jax.tree.map(lambda x: x * 2, st)
    assert isinstance(doubled, jax_fp8.ScalingState)
    assert doubled.fp8_dtype == st.fp8_dtype and float(doubled.scale) == 2.0


def test_scaling_state_through_jit_keeps_dtype():
    st = jax_fp8.ScalingState.create((3,), 4, jnp.float8_e5m2)
    out = jax.jit(lambda s: s)(st)
    assert isinstance(out, jax_fp8.ScalingState) and out.fp8_dtype == np.dtype(jnp.float8_e5m2)


def test_delayed_scaling_defaults_frozen_hashable():
    r = jax_fp8.DelayedScaling()
    assert r.history_len == 1024
    assert r.amax_compute_algo == "max"
    assert r.margin == 0.0
    assert isinstance(r.fp8_format, jax_fp8.Format)
    assert r.power_of_2_scale is False and r.skip_unused is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.margin = 1.0
    assert hash(r) == hash(jax_fp8.DelayedScaling()) and r == jax_fp8.DelayedScaling()
    r2 = jax_fp8.DelayedScaling(margin=1.0)
    assert r2 != r
    assert len({r, r2, jax_fp8.DelayedScaling()}) == 2
    assert dataclasses.replace(r, margin=1.0) == r2


def test_delayed_scaling_as_static_jit_argument():
    calls = []

    def f(tree, recipe):
        calls.append(recipe)
        return jax_fp8.update_states(tree, recipe=recipe)

    jf = jax.jit(f, static_argnames="recipe")
    tree = {"a": jax_fp8.ScalingState(jnp.array([7.0, 0, 0, 0], jnp.float32),
                                      jnp.float32(1.0), jnp.float32(1.0))}
    out1 = jf(tree, jax_fp8.DelayedScaling(margin=1.0))
    out2 = jf(tree, jax_fp8.DelayedScaling(margin=1.0))  # an equal recipe: cached
    out3 = jf(tree, jax_fp8.DelayedScaling(margin=0.0))
    assert len(calls) == 2
    assert float(out1["a"].scale) == 32.0 and float(out2["a"].scale) == 32.0
    assert float(out3["a"].scale) == 64.0


def test_format_dtypes():
    assert jax_fp8.Format.HYBRID.fwd_dtype == np.dtype(jnp.float8_e4m3fn)
    assert jax_fp8.Format.HYBRID.bwd_dtype == np.dtype(jnp.float8_e5m2)
    assert jax_fp8.Format.E4M3.fwd_dtype == np.dtype(jnp.float8_e4m3fn)
    assert jax_fp8.Format.E4M3.bwd_dtype == np.dtype(jnp.float8_e4m3fn)
    r = jax_fp8.DelayedScaling(fp8_format=jax_fp8.Format.E4M3)
    assert r.fp8_format is jax_fp8.Format.E4M3


def test_update_states_leaves_other_leaves_untouched():
    marker = object()
    arr = jnp.arange(3.0)
    np_arr = np.arange(4)
    tree = {"state": jax_fp8.ScalingState.create((), 4), "arr": arr, "np": np_arr,
            "nested": [1, "text", None, marker, (2.5,)]}
    out = jax_fp8.update_states(tree, {"state": jnp.float32(2.0), "arr": None, "np": None,
                                       "nested": [None, None, None, None, (None,)]})
    assert out["arr"] is arr and out["np"] is np_arr
    assert out["nested"][0] == 1 and out["nested"][1] == "text" and out["nested"][2] is None
    assert out["nested"][3] is marker and out["nested"][4] == (2.5,)
    assert float(out["state"].scale) == 224.0
    # Under jit, array leaves pass through with their values.
    jt = jax.jit(jax_fp8.update_states)({"s": jax_fp8.ScalingState.create((), 2), "a": arr})
    np.testing.assert_array_equal(np.asarray(jt["a"]), np.asarray(arr))


@pytest.mark.parametrize("tree", [{}, [], (), None, {"a": jnp.ones(3)}, [jnp.ones(2), 3]],
                         ids=["dict", "list", "tuple", "none", "no-states", "mixed-no-states"])
def test_update_states_without_states_returns_tree(tree):
    assert jax_fp8.update_states(tree) is tree


def test_update_states_root_state_and_states_in_containers():
    st = jax_fp8.ScalingState.create((2,), 4, jnp.float8_e5m2)
    out = jax_fp8.update_states(st, jnp.array([2.0, 4.0], jnp.float32))
    assert isinstance(out, jax_fp8.ScalingState) and out.fp8_dtype == st.fp8_dtype
    np.testing.assert_array_equal(np.asarray(out.scale), np.array([28672.0, 14336.0], np.float32))

    tree = (st, [st], {"k": st})
    outs = jax_fp8.update_states(tree)
    assert isinstance(outs, tuple) and isinstance(outs[1], list) and set(outs[2]) == {"k"}
    assert all(isinstance(x, jax_fp8.ScalingState) for x in (outs[0], outs[1][0], outs[2]["k"]))


def test_update_states_default_recipe_is_delayed_scaling_default():
    tree = {"a": jax_fp8.ScalingState.create((2,), 3)}
    am = {"a": jnp.array([3.5, 0.0], jnp.float32)}
    a = jax_fp8.update_states(tree, am)
    b = jax_fp8.update_states(tree, am, recipe=jax_fp8.DelayedScaling())
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert_bits_equal(x, y, "default recipe")
    np.testing.assert_array_equal(np.asarray(a["a"].scale), np.array([128.0, 1.0], np.float32))


def test_update_states_recipe_history_len_does_not_resize():
    """Each state keeps its own history length; recipe.history_len is for creating."""
    tree = {"a": jax_fp8.ScalingState.create((), 3)}
    out = jax_fp8.update_states(tree, recipe=jax_fp8.DelayedScaling(history_len=8))
    assert out["a"].amax_history.shape == (3,)
