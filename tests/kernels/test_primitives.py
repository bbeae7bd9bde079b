"""The primitive frame (jax_fp8/_primitives/base.py): every primitive is declared in it and
takes the one `implementation` vocabulary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_fp8._primitives import (
    amax,
    base,
    block_gemm,
    block_quantize,
    layout,
    quotient,
    split,
    update,
)

NINE = {"jax_fp8_update", "jax_fp8_amax", "jax_fp8_amax_for_state", "jax_fp8_transpose_bytes",
        "jax_fp8_quantize_transpose", "jax_fp8_split_rows", "jax_fp8_block_quantize",
        "jax_fp8_block_gemm", "jax_fp8_quotient_bits"}
E4M3 = jnp.float8_e4m3fn


def test_every_primitive_is_declared_in_the_frame():
    assert set(base.SPECS) == NINE
    assert base.IMPLEMENTATIONS == ("auto", "jnp")


def _calls(implementation):
    """One call of each primitive bound with `implementation`."""
    x = jnp.ones((8, 256), jnp.float32)
    q = x.astype(E4M3)
    s = jnp.ones((8, 2), jnp.float32)
    opts = dict(implementation=implementation)
    history = jnp.asarray(np.random.default_rng(0).uniform(0, 4, (3, 16)), jnp.float32)
    return {
        "jax_fp8_update": lambda: update.fp8_update_p.bind(
            history, jnp.ones((3,), jnp.float32), scaled_max=(448.0,), amax_compute_algo=0,
            power_of_2_scale=False, skip_unused=False, has_scale_inv=False, has_amax=False,
            in_place=False, **opts),
        "jax_fp8_amax": lambda: amax.amax_p.bind(x, **opts),
        "jax_fp8_amax_for_state": lambda: amax.amax_for_state_p.bind(x, x, **opts),
        "jax_fp8_transpose_bytes": lambda: layout.transpose_bytes_p.bind(q, **opts),
        "jax_fp8_quantize_transpose": lambda: layout.quantize_transpose_p.bind(
            x, jnp.float32(1.0), fp8_dtype=np.dtype(E4M3), **opts),
        "jax_fp8_split_rows": lambda: split.split_rows_p.bind(x[0], sizes=(6, 250), **opts),
        "jax_fp8_block_quantize": lambda: block_quantize.block_quantize(
            x, block_rows=1, fp8_dtype=E4M3, power_of_2_scale=True, amax_epsilon=0.0, **opts),
        "jax_fp8_block_gemm": lambda: block_gemm.block_gemm(
            q, s, q, s, a_block_rows=1, b_block_rows=1, out_dtype=jnp.float32, **opts),
        "jax_fp8_quotient_bits": lambda: quotient.quotient_bits_p.bind(
            x, x, subnormal=True, **opts),
    }


@pytest.mark.parametrize("bad", ["xla", "kernel", "fallback", "local"])
def test_implementations_outside_the_vocabulary_are_refused(bad):
    calls = _calls(bad)
    assert set(calls) == NINE
    for call in calls.values():
        with pytest.raises(ValueError, match="implementation must be one of"):
            jax.eval_shape(call)


def test_auto_and_jnp_give_the_same_bits():
    """On the CPU the two implementations agree bit for bit (the CPU kernels of the update
    and the split against the reference; XLA's ops elsewhere). The GPU's kernels are
    checked against the reference in their own test files (the block GEMM within a bound)."""
    with jax.default_device(jax.devices("cpu")[0]):
        auto, jnp_ = _calls("auto"), _calls("jnp")
        outs = {name: (jax.jit(auto[name])(), jax.jit(jnp_[name])()) for name in auto}
    for name, (got, want) in outs.items():
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.atleast_1d(g).view(np.uint8),
                                          np.atleast_1d(w).view(np.uint8), err_msg=name)


def test_bind_defaults_to_auto():
    x = jnp.arange(6.0, dtype=jnp.float32)
    assert "implementation=auto" in str(jax.make_jaxpr(amax.amax_p.bind)(x))
