"""The primitive frame (jax_fp8/_primitives/base.py): every primitive is declared in it and
takes the one `implementation` vocabulary; its rules for shard_map's varying axes; its
computations with a version per platform."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_fp8._primitives import (
    amax,
    base,
    block_gemm,
    block_quantize,
    grouped_gemm,
    grouped_wgrad,
    layout,
    quotient,
    ragged_dot,
    split,
    update,
)

PRIMITIVES = {"jax_fp8_update", "jax_fp8_amax", "jax_fp8_amax_for_state",
              "jax_fp8_transpose_bytes", "jax_fp8_quantize_transpose", "jax_fp8_split_rows",
              "jax_fp8_block_quantize", "jax_fp8_block_gemm", "jax_fp8_quotient_bits",
              "jax_fp8_product_bits", "jax_fp8_grouped_gemm", "jax_fp8_grouped_wgrad",
              "jax_fp8_ragged_dot"}
E4M3 = jnp.float8_e4m3fn


def test_every_primitive_is_declared_in_the_frame():
    assert set(base.SPECS) == PRIMITIVES
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
        "jax_fp8_product_bits": lambda: quotient.product_bits_p.bind(x, x, x, **opts),
        "jax_fp8_grouped_gemm": lambda: grouped_gemm.grouped_gemm(
            q, jnp.stack([q, q[::-1]]), jnp.asarray([3, 5], jnp.int32),
            jnp.ones((2,), jnp.float32), jnp.full((2,), 0.5, jnp.float32),
            out_dtype=jnp.float32, **opts),
        "jax_fp8_grouped_wgrad": lambda: grouped_wgrad.grouped_wgrad(
            q, q[::-1].astype(jnp.float8_e5m2), jnp.asarray([3, 5], jnp.int32),
            jnp.ones((2,), jnp.float32), jnp.full((2,), 0.5, jnp.float32),
            out_dtype=jnp.float32, **opts),
        "jax_fp8_ragged_dot": lambda: ragged_dot.ragged_product(
            x.astype(jnp.bfloat16), jnp.ones((2, 256, 16), jnp.bfloat16),
            jnp.asarray([3, 5], jnp.int32), mode=ragged_dot.FORWARD, out_dtype=jnp.bfloat16,
            **opts),
    }


@pytest.mark.parametrize("bad", ["xla", "kernel", "fallback", "local"])
def test_implementations_outside_the_vocabulary_are_refused(bad):
    calls = _calls(bad)
    assert set(calls) == PRIMITIVES
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


# --------------------------------------------------------------- a version per platform

def _times(x, *, k):
    return x * k


def _times_plus_one(x, *, k):
    return x * k + 1


# Registered once per process: the reference on every platform but the CPU, where the
# variant adds one (so the result says which version ran).
TOY = base.ByPlatform("test_toy_by_platform", _times,
                      {"cpu": base.Variant(_times_plus_one, "adds one")})
toy = base.by_platform(TOY)


def test_a_version_per_platform_is_the_lowering_platform_s():
    """by_platform: the CPU variant wherever the CPU runs it (a jit, eagerly, under vmap
    and grad, with jit disabled); lowered for CUDA, the reference (no CUDA variant)."""
    x = jnp.arange(4.0, dtype=jnp.float32)
    want = np.asarray(x) * 2 + 1
    with jax.default_device(jax.devices("cpu")[0]):
        runs = {"eager": toy(x, k=2.0), "jit": jax.jit(lambda x: toy(x, k=2.0))(x),
                "vmap": jax.vmap(lambda x: toy(x, k=2.0))(x)}
        value, grad = jax.value_and_grad(lambda x: toy(x, k=2.0).sum())(x)
        with jax.disable_jit():
            runs["disable_jit"] = toy(x, k=2.0)
    for name, got in runs.items():
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert value == want.sum()
    np.testing.assert_array_equal(grad, np.full(4, 2.0, np.float32))
    fn = jax.jit(lambda x: toy(x, k=2.0))
    cpu = fn.trace(x).lower(lowering_platforms=("cpu",)).as_text()
    cuda = fn.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.add" in cpu and "stablehlo.add" not in cuda
    assert "func.func private @test_toy_by_platform" in cpu


def test_the_version_and_its_reason_come_from_one_decision():
    assert base.decide_platform(TOY, "cpu") == ("variant", "the cpu variant: adds one")
    assert base.decide_platform(TOY, "cuda") == ("reference", "no cuda variant")
    assert base.decide_platform(TOY, "cpu", "jnp") == ("reference", "implementation='jnp'")
    with pytest.raises(ValueError, match="already registered"):
        base.by_platform(TOY)
    with pytest.raises(ValueError, match="already registered"):
        base.by_platform(base.ByPlatform("jax_fp8_amax", _times))


def test_operands_are_aligned_on_their_manual_axes_by_the_frame():
    """Spec.same_varying: inside shard_map, the update and the quotient take operands that
    vary over different manual axes (one varying, one replicated); the results vary over
    their union."""
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    P = jax.sharding.PartitionSpec

    def body(a, b):
        bits = quotient.quotient_bits(a, b)
        hist, scale, _ = update.fp8_update_p.bind(
            a[None, :], b[:1], scaled_max=(448.0,), amax_compute_algo=0,
            power_of_2_scale=False, skip_unused=False, has_scale_inv=False, has_amax=False,
            in_place=False)
        return bits, hist, scale

    a = jnp.arange(1.0, 5.0, dtype=jnp.float32)
    b = jnp.full((4,), 3.0, jnp.float32)
    run = jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P()), out_specs=(P("d"),) * 3)
    bits, hist, scale = jax.jit(run)(a, b)
    np.testing.assert_array_equal(bits, (np.arange(1.0, 5.0, dtype=np.float32)
                                         / np.float32(3)).view(np.uint32))
    assert hist.shape == (1, 4) and scale.shape == (1,)
