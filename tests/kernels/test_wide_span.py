"""GPU: one update_states call whose buffers lie more than 16 GB apart (a large model's
FP8 state next to amaxes in XLA's temporary buffer). The launcher then addresses the
buffers with 64-bit offsets, ~800 states per launch: the result equals the CPU kernel
bit for bit and the call is ONE launch, not one per state. (The planning itself is
checked on the host by test_launch_plan.py.)"""

import re

import jax
import numpy as np
import pytest

import helpers
import jax_fp8
from jax_fp8.devtools import trace


def test_update_with_buffers_more_than_16gb_apart(gpu_device, tmp_path):
    rng = np.random.default_rng(11)
    n = 300
    host = [jax_fp8.ScalingState(rng.random(64).astype(np.float32) * 10,
                                 np.float32(rng.random() + 0.5), np.float32(1.0))
            for _ in range(n)]
    amaxes_host = [helpers.random_amax_values(rng, ()) for _ in range(n)]
    try:
        states = jax.device_put(host, gpu_device)
        amaxes, keep_alive = helpers.put_far_from(states, amaxes_host, gpu_device)
    except Exception as err:  # noqa: BLE001 - not enough GPU memory for the fillers
        pytest.skip(f"could not place buffers 16 GB apart: {err}")
    if amaxes is None:
        pytest.skip("the allocator kept the buffers within 16 GB of each other")

    # Donated, the states are updated in their own buffers, 16 GB from the amaxes (not
    # donated, XLA would copy them into fresh buffers wherever the allocator finds room).
    fn = jax.jit(jax_fp8.update_states, donate_argnums=0)
    got = fn(states, amaxes)
    assert helpers.buffer_span((got, amaxes)) > helpers.WIDE_SPAN_BYTES
    cpu = jax.devices("cpu")[0]
    want = jax.jit(jax_fp8.update_states)(jax.device_put(host, cpu),
                                          jax.device_put(amaxes_host, cpu))
    for g, w in zip(got, want):
        helpers.assert_update_equal([np.asarray(v) for v in (g.amax_history, g.scale,
                                                             g.scale_inv)],
                                    [np.asarray(v) for v in (w.amax_history, w.scale,
                                                             w.scale_inv)],
                                    "buffers > 16 GB apart")
    _, events = trace.capture(lambda s: fn(s, amaxes), got, logdir=str(tmp_path / "trace"))
    kernels = trace.by_name(trace.device_events(events, "gpu"))
    launches = sum(count for name, (count, _) in kernels.items() if "UpdateKernel" in name)
    assert launches == 1, kernels
    # the 64-bit-offset instantiation (UpdateKernel<states per launch, unsigned long>)
    assert any(re.search(r"UpdateKernel<\d+, unsigned long>", name) for name in kernels), kernels
    del keep_alive
