"""Amax records, the raw cotangents of FP8 states (what ``jax.grad`` and
``eqx.filter_value_and_grad`` return for them): whatever linear map generic code applies to
a whole record -- a loss scale undone, a clip factor, a negation, a mean or a sum of
identical records (what every device holds under pmap) -- the amax reads back exactly, on
amaxes spanning float32's normal range."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp8
from helpers import assert_bits_equal
from jax_fp8._fp8_grads import amax_record, recorded_amax

LIKE = jax_fp8.ScalingState.create((4096,), 4)


def _amaxes(seed=0, n=4096):
    """Positive float32 amaxes, every mantissa pattern likely, exponents 2**-60..2**60: a
    record scaled by the factors below keeps every part a normal float32 (a factor that
    makes the amax's low part subnormal flushes it, as XLA flushes any subnormal)."""
    rng = np.random.default_rng(seed)
    mant = rng.integers(0, 2 ** 23, n, dtype=np.uint32)
    exp = rng.integers(127 - 60, 127 + 60, n, dtype=np.uint32)
    a = ((exp << 23) | mant).view(np.float32)
    a[:4] = [1.0, 448.0, np.float32(1 + 2 ** -23), np.float32(2 - 2 ** -23)]
    return a


@jax.jit
def _scaled(amax, c):
    return recorded_amax(jax.tree.map(lambda t: t * c, amax_record(amax, LIKE)))


@jax.jit
def _divided(amax, c):
    return recorded_amax(jax.tree.map(lambda t: jnp.asarray(t, jnp.float32) / c,
                                      amax_record(amax, LIKE)))


def test_a_record_as_written_reads_its_staging_slot():
    a = _amaxes()
    record = jax.jit(amax_record)(a, LIKE)
    assert_bits_equal(np.asarray(record.amax_history[:, 0]), a)
    assert not np.any(np.asarray(record.amax_history[:, 1:]))
    assert_bits_equal(np.asarray(jax.jit(recorded_amax)(record)), a)


@pytest.mark.parametrize("c", [2.0 ** -16, 2.0 ** 15, 0.37, 3.0, -1.0, 1 / 7, 1e-7, 12345.678])
def test_any_factor_reads_back_the_amax(c):
    a = _amaxes(1)
    c = np.float32(c)
    assert_bits_equal(np.asarray(_scaled(a, c)), a)
    assert_bits_equal(np.asarray(_divided(a, c)), a)


@pytest.mark.parametrize("n", [2, 3, 5, 8, 64, 1000])
def test_a_mean_or_sum_of_identical_records_reads_back_the_amax(n):
    """As lax.pmean / psum over n devices would compute it: a float32 sum in order (the
    worst rounding), then the division by n."""
    a = _amaxes(2)

    @jax.jit
    def mean(amax):
        record = amax_record(amax, LIKE)
        total = jax.lax.fori_loop(1, n, lambda _, t: jax.tree.map(jnp.add, t, record), record)
        return (recorded_amax(jax.tree.map(lambda t: t / n, total)),
                recorded_amax(total))

    got_mean, got_sum = mean(a)
    assert_bits_equal(np.asarray(got_mean), a)
    assert_bits_equal(np.asarray(got_sum), a)


def test_zero_inf_nan_and_hand_made_records():
    a = np.array([0.0, np.inf, np.nan, 3.5] + [1.0] * 4092, np.float32)
    for c in (np.float32(1), np.float32(2.0 ** -16)):
        got = np.asarray(_scaled(a, c))
        assert got[0] == 0 and got[1] == np.inf and np.isnan(got[2]) and got[3] == 3.5
    # A raw cotangent written by hand (the staging slot only, unit 0) and an all-zero
    # accumulator (jnp.zeros_like of the states) read as their staging slots.
    hand = jax_fp8.ScalingState(jnp.zeros((4096, 4)).at[:, 0].set(a), jnp.zeros(4096),
                                jnp.zeros(4096))
    assert_bits_equal(np.asarray(recorded_amax(hand)), a)
    assert not np.any(np.asarray(recorded_amax(jax.tree.map(jnp.zeros_like, LIKE))))


def test_a_real_backward_s_records_survive_a_loss_scale_and_combine_by_max():
    """The records fp8_dot_general's backward hands back, divided by a loss scale, update
    the state as the unscaled ones do; two microbatches' records combine by max."""
    recipe = jax_fp8.DelayedScaling(history_len=4)
    meta = jax_fp8.Fp8Meta.create(recipe)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((32, 16)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(4).standard_normal((16, 16)), jnp.float32)
    dn = (((1,), (0,)), ((), ()))

    def loss(meta, x):
        return jnp.sum(jax_fp8.fp8_dot_general(x, w, dn, meta)[0] ** 2)

    g = jax.grad(loss)(meta, x)
    want = jax_fp8.amax_cotangents(g)
    for c in (np.float32(2.0 ** -15), np.float32(0.3)):
        got = jax_fp8.amax_cotangents(jax.tree.map(lambda t: t * c, g))
        for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert_bits_equal(np.asarray(u), np.asarray(v))
    g1, g2 = jax.grad(loss)(meta, x[:16]), jax.grad(loss)(meta, 3 * x[16:])
    combined = jax_fp8.amax_cotangents(jax_fp8.combine_fp8_grads(g1, g2))
    for u, v, w_ in zip(*(jax.tree.leaves(jax_fp8.amax_cotangents(t)) for t in (g1, g2)),
                        jax.tree.leaves(combined)):
        assert_bits_equal(np.asarray(w_), np.fmax(np.asarray(u), np.asarray(v)))
