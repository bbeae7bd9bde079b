"""Property-based check (hypothesis): for arbitrary float32 bit patterns and any
options, the kernel equals the NumPy reference bit for bit.

Shapes are kept to a few, and compiled programs are cached per (L, options), so
examples reuse programs. The default profile is small and deterministic (CI);
the `slow` one explores far more (run with --runslow).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import helpers
import ieee_reference as ref
import jax_fp8

LEAD = 6
LS = (1, 3, 16)

_special_bits = st.sampled_from([int(b) for b in helpers.bits(np.concatenate(
    [helpers.SPECIAL_AMAX, helpers.SPECIAL_SCALE]))])
# Any bit pattern (NaN payloads, subnormals, ...), some specials, some plain floats.
f32_bits = st.one_of(
    st.integers(0, 2 ** 32 - 1),
    _special_bits,
    st.floats(width=32, allow_nan=False).map(lambda x: int(helpers.bits(np.float32(x)))),
)


def _array(bits_list, shape):
    return np.array(bits_list, np.uint32).view(np.float32).reshape(shape)


@st.composite
def cases(draw):
    L = draw(st.sampled_from(LS))
    h = _array(draw(st.lists(f32_bits, min_size=LEAD * L, max_size=LEAD * L)), (LEAD, L))
    s = _array(draw(st.lists(f32_bits, min_size=LEAD, max_size=LEAD)), (LEAD,))
    with_amax = draw(st.booleans())
    a = _array(draw(st.lists(f32_bits, min_size=LEAD, max_size=LEAD)), (LEAD,)) \
        if with_amax else None
    opts = dict(
        fp8_dtype=draw(st.sampled_from(["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz"])),
        margin=draw(st.sampled_from([0.0, 1.0, 2.5, -1.0, 0.3])),
        amax_compute_algo=draw(st.sampled_from(["max", "most_recent"])),
        power_of_2_scale=draw(st.booleans()),
        skip_unused=draw(st.booleans()),
    )
    return h, s, a, opts


@functools.cache
def _compiled(with_amax, opts_items):
    opts = dict(opts_items)
    if with_amax:
        return jax.jit(lambda h, s, a: jax_fp8.amax_and_scale_update(h, s, a, **opts))
    return jax.jit(lambda h, s: jax_fp8.amax_and_scale_update(h, s, **opts))


def _check(case):
    h, s, a, opts = case
    f = _compiled(a is not None, tuple(sorted(opts.items())))
    args = (h, s) if a is None else (h, s, a)
    got = [np.asarray(x) for x in f(*args)]
    want = ref.update(h, s, a, **opts)
    helpers.assert_update_equal(got, want, f"with {opts}:", {"history": h, "scale": s})


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_kernel_equals_reference_on_arbitrary_bits(case):
    _check(case)


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_kernel_equals_reference_on_arbitrary_bits_long(case):
    _check(case)
