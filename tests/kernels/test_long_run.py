"""Long runs: 100,000 updates in one lax.scan equal 100,000 steps of the numpy
reference, bit for bit, and the history stays well-formed (issue: reliability).

Also (GPU): a jitted train-like step replayed many times, with buffer addresses
changing between calls (no donation, so every call gets new output buffers), stays
bit-equal to the CPU kernel; XLA may run it from a CUDA graph (command buffer).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import helpers
import ieee_reference as ref
import jax_fp8

N_STEPS = 100_000
LEAD, L = (3,), 16


def test_100k_updates_in_scan_match_reference(backend, device):
    rng = np.random.default_rng(7)
    amaxes = helpers.random_amax_values(rng, (N_STEPS,) + LEAD, special_p=0.05)
    recipe = jax_fp8.DelayedScaling(history_len=L, margin=1.0)

    def run(state, xs):
        def body(st, a):
            return jax_fp8.update_states(st, a, recipe=recipe), None
        return lax.scan(body, state, xs)[0]

    out = helpers.run_on(device, run, jax_fp8.ScalingState.create(LEAD, L), amaxes)

    h = np.zeros(LEAD + (L,), np.float32)
    s = np.ones(LEAD, np.float32)
    s_inv = s
    for a in amaxes:
        h, s, s_inv = ref.update(h, s, a, margin=1.0)
    helpers.assert_bits_equal(out.amax_history, h, "history after 100k updates")
    helpers.assert_bits_equal(out.scale, s, "scale after 100k updates")
    helpers.assert_bits_equal(out.scale_inv, s_inv, "scale_inv after 100k updates")
    # Well-formed: slot 0 cleared, then the last L - 1 amaxes (merged into the cleared
    # slot: fmax_num(+0, amax)), oldest first.
    last = ref.fmax_num(np.zeros_like(amaxes[-(L - 1):]), amaxes[-(L - 1):])
    np.testing.assert_array_equal(helpers.bits(np.asarray(out.amax_history)[..., 1:]),
                                  helpers.bits(last.T))
    assert not np.any(helpers.bits(np.asarray(out.amax_history)[..., 0]))


def test_replayed_step_with_moving_buffers_matches_cpu(gpu_device):
    rng = np.random.default_rng(3)
    tree = {f"t{i}": jax_fp8.ScalingState.create((i % 3 + 1,), 16 * (i + 1)) for i in range(12)}
    steps = [jax.tree.map(lambda st: helpers.random_amax_values(rng, st.scale.shape), tree,
                          is_leaf=lambda x: isinstance(x, jax_fp8.ScalingState))
             for _ in range(200)]

    def step(states, amaxes, x):
        # A few ordinary ops around the update, so XLA has a graph worth capturing.
        y = jnp.tanh(x * 2.0) + 1.0
        return jax_fp8.update_states(states, amaxes), y.sum()

    f = jax.jit(step)  # not donated: every call's outputs land in new buffers
    results = {}
    for dev in (gpu_device, jax.devices("cpu")[0]):
        st, x = jax.device_put((tree, jnp.ones((64, 64))), dev)
        keep = []
        for i, am in enumerate(steps):
            st, _ = f(st, jax.device_put(am, dev), x)
            if i % 7 == 0:
                keep.append(jnp.zeros((1024 + i,), device=dev))  # shift the allocator
        results[dev.platform] = jax.tree.map(np.asarray, st)
    for a, b in zip(jax.tree.leaves(results["gpu"]), jax.tree.leaves(results["cpu"])):
        helpers.assert_bits_equal(a, b, "200 replayed steps, GPU vs CPU")
    hlo = f.lower(tree, steps[0], jnp.ones((64, 64))).compile().as_text()
    assert hlo.count('custom_call_target="jax_fp8_update"') == 1


def _computations_calling(hlo_text, target):
    """Names of the HLO computations that hold a custom call to `target`."""
    from jax_fp8.devtools import hlo
    return hlo.computations_calling(hlo_text, target)


def test_update_runs_inside_a_cuda_graph(gpu_device):
    """XLA command buffers (CUDA graphs) on, as by default, with the smallest graph size
    allowed: the update custom call (kCmdBufferCompatible) is outlined into a
    command_buffer computation with its neighbours, and 60 replays with fresh buffers
    every call equal the CPU kernel bit for bit."""
    rng = np.random.default_rng(5)
    tree = [jax_fp8.ScalingState.create((4,), 16 * (i + 1)) for i in range(6)]
    steps = [[helpers.random_amax_values(rng, st.scale.shape) for st in tree]
             for _ in range(60)]

    def step(states, amaxes, x):
        y = jnp.tanh(x @ x) + 1.0
        return jax_fp8.update_states(states, amaxes), (y * 2.0).sum(), jnp.exp(x).max()

    x = jnp.ones((64, 64))
    compiled = jax.jit(step).lower(*jax.device_put((tree, steps[0], x), gpu_device)).compile(
        compiler_options={"xla_gpu_graph_min_graph_size": 1})
    hlo = compiled.as_text()
    holders = _computations_calling(hlo, "jax_fp8_update")
    assert len(holders) == 1, holders
    if "command_buffer" in hlo:
        # XLA that outlines command buffers in HLO (jax 0.10's): the update is in one.
        assert "command_buffer" in holders[0], (
            f"jax_fp8_update is in computation {holders[0]!r}, not in a command buffer")
    # Newer XLA (jax 0.11) forms command buffers from the thunk sequence after emission,
    # which the HLO text does not show; the replays below run either way.
    st = jax.device_put(tree, gpu_device)
    keep = []
    for i, am in enumerate(steps):
        st, _, _ = compiled(st, jax.device_put(am, gpu_device), jax.device_put(x, gpu_device))
        if i % 5 == 0:
            keep.append(jnp.zeros((4096 + i,), device=gpu_device))  # move the allocator
    cpu = jax.devices("cpu")[0]
    want = jax.device_put(tree, cpu)
    update = jax.jit(jax_fp8.update_states)
    for am in steps:
        want = update(want, jax.device_put(am, cpu))
    for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(want)):
        helpers.assert_bits_equal(np.asarray(a), np.asarray(b), "CUDA graph replays vs CPU")
