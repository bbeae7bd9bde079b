"""Drives jax_fp8's CUDA kernels through the real JAX path, for compute-sanitizer.

Run by scripts/sanitize.sh (``python scripts/sanitize_driver.py [transpose]``).

Covers: a donated (aliased, in-place) per-tensor pytree, a stacked state, mixed
history lengths (1 .. 5000, several passes per block), skip_unused, amax inputs, and
1,500 states in one call (two launches past the kernel-parameter limit), and 300
donated states whose amaxes lie > 16 GB away (64-bit offsets, one launch). With the
argument "transpose": the FP8 transpose kernels instead (byte transpose; quantize +
transpose + amax), tile edges and batches.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp8
from jax_fp8._primitives import layout
from jax_fp8.devtools.buffers import buffer_span, put_far_from


rng = np.random.default_rng(0)

if sys.argv[1:] == ["transpose"]:
    # The byte-transpose kernel: whole tiles, partial tiles on both edges, one word, a
    # batch (vmap), both FP8 types; inputs copied from the host (initcheck), bits checked.
    for shape in [(4, 4), (128, 128), (132, 260), (4, 1028), (1028, 8), (4096, 2048)]:
        for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
            x = rng.integers(0, 256, shape, dtype=np.uint8)
            y = layout.transpose_bytes_p.bind(jax.device_put(x.view(np.dtype(dtype))))
            assert (np.asarray(y).view(np.uint8) == x.T).all(), (shape, dtype)
    x = rng.integers(0, 256, (3, 8, 136), dtype=np.uint8)
    y = jax.jit(lambda a: layout.rotate_axes(a, 2))(
        jax.device_put(x.view(np.dtype(jnp.float8_e4m3fn))))
    assert (np.asarray(y).view(np.uint8) == np.transpose(x, (2, 0, 1))).all()
    # The quantize + transpose + amax kernel: every input and FP8 type, edge tiles.
    for shape in [(4, 4), (132, 260), (1028, 8), (4096, 2048)]:
        for in_dtype in (np.float32, jnp.bfloat16, jnp.float16):
            for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
                x = jax.device_put(rng.standard_normal(shape).astype(in_dtype))
                q, q_t, amax = layout.quantize_transpose_p.bind(
                    x, jax.device_put(np.float32(0.5)), fp8_dtype=np.dtype(dtype))
                q8 = np.asarray(q).view(np.uint8)
                assert (np.asarray(q_t).view(np.uint8) == q8.T).all(), (shape, dtype)
                # (Compared on the host: a comparison on the device would be an XLA
                # kernel's output, which initcheck does not track.)
                assert np.asarray(amax) == np.abs(np.asarray(x, np.float32)).max(), (shape, dtype)
    print("sanitize driver done")
    sys.exit(0)
lengths = [1, 2, 3, 16, 1023, 1024, 1025, 5000]
tree = [jax_fp8.ScalingState(jax.device_put(rng.random((i % 3, L), np.float32)),
                             jax.device_put(np.ones((i % 3,), np.float32)),
                             jax.device_put(np.ones((i % 3,), np.float32)),
                             jnp.float8_e5m2 if i % 2 else jnp.float8_e4m3fn)
        for i, L in enumerate(lengths * 3)]
amaxes = [jax.device_put(rng.random(st.scale.shape, np.float32)) for st in tree]
for skip in (False, True):
    recipe = jax_fp8.DelayedScaling(skip_unused=skip)
    step = jax.jit(lambda t, a: jax_fp8.update_states(t, a, recipe=recipe), donate_argnums=0)
    for _ in range(3):
        tree = step(tree, amaxes)


def host_state(lead, hist_len):
    # Built on the host and copied in: initcheck tracks host-to-device copies, but not
    # the writes of XLA's own kernels, which --kernel-name leaves uninstrumented (a
    # state XLA fills with zeros would read as "uninitialized" in our kernel).
    return jax_fp8.ScalingState(jax.device_put(rng.random(lead + (hist_len,), np.float32)),
                                jax.device_put(np.ones(lead, np.float32)),
                                jax.device_put(np.ones(lead, np.float32)), jnp.float8_e4m3fn)


big = [host_state((), 16) for _ in range(1500)]
big = jax.jit(jax_fp8.update_states, donate_argnums=0)(big)
stacked = host_state((64,), 1024)
stacked = jax.jit(jax_fp8.update_states, donate_argnums=0)(stacked)
# The wide path: amaxes > 2^32 floats from the states -> 64-bit offsets, 300 states in
# one launch (the host-side plan is checked by tests/test_launch_plan.py).
wide = [host_state((), 64) for _ in range(300)]
wide_amaxes, keep_alive = put_far_from(
    wide, [np.float32(rng.random() * 4) for _ in wide], jax.devices()[0])
if wide_amaxes is None:  # the allocator kept everything close: no 64-bit case here
    print("wide-span case: skipped (could not place the amaxes 16 GB from the states)")
else:
    print(f"wide-span case: buffers span {buffer_span((wide, wide_amaxes)) / 2**30:.1f} GB")
    wide = jax.jit(jax_fp8.update_states, donate_argnums=0)(wide, wide_amaxes)
jax.block_until_ready((tree, big, stacked, wide))
print("sanitize driver done")
