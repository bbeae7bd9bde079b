"""Sharding checks, run in a fresh process with 8 host CPU devices.

test_sharding.py starts this file with XLA_FLAGS=--xla_force_host_platform_device_count=8
and JAX_PLATFORMS=cpu (the pytest process may already hold a 1-device jax). It runs
every check, never stops at the first failure, and prints one JSON line:
{"check name": "ok" | "<traceback>", ...}.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

# The test folders are on PYTHONPATH (test_sharding.py puts them there).
import helpers
import ieee_reference as ref
import jax_fp8

COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "reduce-scatter",
               "collective-permute", "collective-broadcast")
TARGET = 'custom_call_target="jax_fp8_update"'

RESULTS: dict[str, str] = {}
check = helpers.recorder(RESULTS)


def is_state(x):
    return isinstance(x, jax_fp8.ScalingState)


assert jax.device_count() == 8, jax.devices()
MESH = jax.make_mesh((4, 2), ("a", "b"), devices=jax.devices())

# name: (leading shape, L, dtype, leading PartitionSpec)
SPECS = {
    "stack_ab": ((8, 4), 1024, jnp.float8_e4m3fn, ("a", "b")),
    "stack_ba": ((2, 8), 16, jnp.float8_e5m2, ("b", "a")),
    "stack_a": ((12,), 2, jnp.float8_e4m3fn, ("a",)),
    "stack_b_only": ((3, 6), 1, jnp.float8_e5m2, (None, "b")),
    "flat_ab": ((16,), 16, jnp.float8_e4m3fn, (("a", "b"),)),
    "replicated_scalar": ((), 16, jnp.float8_e4m3fn, ()),
    "replicated_small": ((3,), 2, jnp.float8_e5m2, (None,)),
}


def make_tree(seed, with_amax=True):
    rng = np.random.default_rng(seed)
    tree, amaxes, raw = {}, {}, {}
    for name, (lead, L, dt, spec) in SPECS.items():
        h, s, a = helpers.make_cases(rng, lead, L, with_amax)
        hs = NamedSharding(MESH, P(*spec, None))
        ss = NamedSharding(MESH, P(*spec))
        tree[name] = jax_fp8.ScalingState(
            jax.device_put(h, hs), jax.device_put(s, ss),
            jax.device_put(np.zeros(lead, np.float32), ss), fp8_dtype=dt)
        amaxes[name] = jax.device_put(a, ss) if with_amax else None
        raw[name] = (h, s, a, dt)
    return tree, (amaxes if with_amax else None), raw


RECIPE = jax_fp8.DelayedScaling(margin=1.0, power_of_2_scale=True, skip_unused=True)


def update(tree, amaxes):
    return jax_fp8.update_states(tree, amaxes, recipe=RECIPE)


def compiled_ops(text):
    return re.findall(r"=\s*\S+\s+([a-z][a-z0-9\-]*)\(", text)


@check
def sharded_update_has_no_collectives_and_one_local_custom_call():
    tree, amaxes, _ = make_tree(0)
    text = jax.jit(update).lower(tree, amaxes).compile().as_text()
    ops = compiled_ops(text)
    bad = [c for c in COLLECTIVES if c in ops or c + "-start" in ops]
    assert not bad, f"collectives in the compiled program: {bad}"
    assert text.count(TARGET) == 1, text.count(TARGET)
    # The custom call's operands are the per-device shards.
    line = next(ln for ln in text.splitlines() if TARGET in ln)
    for shard_shape in ("f32[2,2,1024]", "f32[1,2,16]", "f32[3,2]", "f32[3,3,1]",
                        "f32[2,16]", "f32[16]", "f32[3,2]"):
        assert shard_shape in line, (shard_shape, line[:600])
    for full_shape in ("f32[8,4,1024]", "f32[2,8,16]", "f32[12,2]", "f32[3,6,1]"):
        assert full_shape not in line, (full_shape, line[:600])


@check
def sharded_results_equal_single_device_and_reference():
    tree, amaxes, raw = make_tree(1)
    out = jax.jit(update)(tree, amaxes)
    one = jax.devices()[0]
    single = jax.jit(update)(jax.device_put(jax.tree.map(np.asarray, tree), one),
                             jax.device_put(jax.tree.map(np.asarray, amaxes), one))
    for name, (h, s, a, dt) in raw.items():
        got, alone = out[name], single[name]
        want = ref.update(h, s, a, fp8_dtype=dt, margin=1.0, power_of_2_scale=True,
                          skip_unused=True)
        for field, w in zip(("amax_history", "scale", "scale_inv"), want):
            g = getattr(got, field)
            helpers.assert_bits_equal(np.asarray(g), w, f"{name}.{field} vs reference")
            helpers.assert_bits_equal(np.asarray(g), np.asarray(getattr(alone, field)),
                                      f"{name}.{field} vs single device")
            src = getattr(tree[name], field)
            assert g.sharding.is_equivalent_to(src.sharding, g.ndim), (
                name, field, g.sharding, src.sharding)


@check
def donated_sharded_update_aliases_per_device_bytes():
    tree, amaxes, raw = make_tree(2)
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))
    compiled = jax.jit(update, donate_argnums=0).lower(tree, amaxes).compile()
    alias = compiled.memory_analysis().alias_size_in_bytes
    assert alias == per_device, (alias, per_device)
    assert "copy" not in compiled_ops(compiled.as_text())
    out = compiled(tree, amaxes)
    assert all(x.is_deleted() for x in jax.tree.leaves(tree))
    name = "stack_ab"
    h, s, a, dt = raw[name]
    want = ref.update(h, s, a, fp8_dtype=dt, margin=1.0, power_of_2_scale=True, skip_unused=True)
    helpers.assert_bits_equal(np.asarray(out[name].amax_history), want[0], "donated history")


@check
def sharded_without_amax_and_stack_api():
    tree, _, raw = make_tree(3, with_amax=False)
    out = jax.jit(lambda t: jax_fp8.update_states(t, recipe=RECIPE))(tree)
    for name, (h, s, _, dt) in raw.items():
        want = ref.update(h, s, fp8_dtype=dt, margin=1.0, power_of_2_scale=True,
                          skip_unused=True)
        helpers.assert_bits_equal(np.asarray(out[name].scale), want[1], f"{name}.scale")
    st = tree["stack_ab"]
    f = jax.jit(lambda h, s: jax_fp8.amax_and_scale_update(h, s, amax_compute_algo="most_recent"))
    text = f.lower(st.amax_history, st.scale).compile().as_text()
    assert not [c for c in COLLECTIVES if c in compiled_ops(text)]
    assert text.count(TARGET) == 1
    h, s, si = f(st.amax_history, st.scale)
    want = ref.update(raw["stack_ab"][0], raw["stack_ab"][1], amax_compute_algo="most_recent")
    for g, w, n in zip((h, s, si), want, ("history", "scale", "scale_inv")):
        helpers.assert_bits_equal(np.asarray(g), w, f"stack api {n}")
    assert h.sharding.is_equivalent_to(st.amax_history.sharding, 3)
    assert si.sharding.is_equivalent_to(st.scale.sharding, 2)


@check
def history_axis_sharded_is_still_correct():
    """Sharding the history axis itself is allowed (it is gathered); results stay exact."""
    rng = np.random.default_rng(4)
    h, s, a = helpers.make_cases(rng, (4,), 16, True)
    hs = jax.device_put(h, NamedSharding(MESH, P(None, ("a", "b"))))
    ss = jax.device_put(s, NamedSharding(MESH, P()))
    out = jax.jit(jax_fp8.amax_and_scale_update)(hs, ss, a)
    for g, w, n in zip(out, ref.update(h, s, a), ("history", "scale", "scale_inv")):
        helpers.assert_bits_equal(np.asarray(g), w, n)


@check
def jnp_implementation_sharded():
    tree, amaxes, raw = make_tree(5)
    tree = {k: tree[k] for k in ("stack_a", "replicated_small")}
    amaxes = {k: amaxes[k] for k in tree}
    out = jax.jit(lambda t, a: jax_fp8.update_states(t, a, recipe=RECIPE,
                                                     implementation="jnp"))(tree, amaxes)
    for name in tree:
        h, s, a, dt = raw[name]
        want = ref.update(h, s, a, fp8_dtype=dt, margin=1.0, power_of_2_scale=True,
                          skip_unused=True)
        sub = helpers.subnormal_rows((h, True), (s, False), (a, False), (want[0], True),
                                     (want[1], False), (want[2], False))
        helpers.assert_bits_equal(np.asarray(out[name].scale)[~sub], want[1][~sub], name)


print("JAX_FP8_SHARDING_RESULTS " + json.dumps(RESULTS), flush=True)
