"""pack_states / PackedStates: a model's FP8 states as one stacked state per (dtype, L).

Round trip, the fused update on a packed tree (bit-equal to the unpacked one, one
custom call, 3 arrays per group), and Fp8TrainState(pack_fp8=True) training bit-equal
to the unpacked train state (on CPU and GPU), with the amaxes reaching the packed rows
through the gradient of the unpacking; the split of the scale vectors (one custom call)
against slices.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
import jax_fp8
from jax_fp8.flax import FP8_COLLECTION, Fp8DotGeneral, Fp8TrainState

TARGET = 'custom_call_target="jax_fp8_update"'
SPLIT = 'custom_call_target="jax_fp8_split_rows"'


def _mixed_tree(rng):
    def st(lead, hist_len, dtype):
        h, s, _ = helpers.make_cases(rng, lead, hist_len, False)
        return jax_fp8.ScalingState(h, s, np.ones(lead, np.float32), fp8_dtype=dtype)

    e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
    return {"a": [st((), 16, e4), st((3,), 16, e4), st((), 16, e5)],
            "b": {"scan": st((4,), 8, e4), "c": st((2, 2), 16, e4)},
            "step": np.int32(7)}  # a non-state leaf rides along


def _bits_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        helpers.assert_bits_equal(np.asarray(x), np.asarray(y), "packed vs unpacked")
    assert jax.tree.structure(a) == jax.tree.structure(b)


def test_round_trip_groups_and_array_count():
    tree = _mixed_tree(np.random.default_rng(0))
    packed = jax_fp8.pack_states(tree)
    # Groups: (e4m3, 16) rows 1 + 3 + 4, (e5m2, 16) 1 row, (e4m3, 8) 4 rows.
    shapes = sorted((g.amax_history.shape, np.dtype(g.fp8_dtype).name) for g in packed.groups)
    assert shapes == [((1, 16), "float8_e5m2"), ((4, 8), "float8_e4m3fn"),
                      ((8, 16), "float8_e4m3fn")]
    assert packed.num_arrays == 3 * 3 + 1
    _bits_equal(packed.unpack(), tree)
    _bits_equal(jax.jit(lambda p: p.unpack())(packed), tree)
    assert jax_fp8.unpack_states(tree) is tree


def test_states_info_sees_packed_states_by_their_unpacked_paths():
    from jax_fp8 import state

    tree = _mixed_tree(np.random.default_rng(4))
    info = sorted(state.states_info(tree), key=str)
    assert len(info) == 5
    assert sorted(state.states_info(jax_fp8.pack_states(tree)), key=str) == info
    nested = sorted(state.states_info({"fp8": jax_fp8.pack_states(tree)}), key=str)
    assert nested == sorted(state.states_info({"fp8": tree}), key=str)


def test_update_on_packed_states_is_one_call_and_bit_equal():
    rng = np.random.default_rng(1)
    tree = _mixed_tree(rng)
    is_state = lambda x: isinstance(x, jax_fp8.ScalingState)  # noqa: E731
    amaxes = jax.tree.map(lambda s: helpers.random_amax_values(rng, s.scale.shape)
                          if is_state(s) else s, tree, is_leaf=is_state)
    packed = jax_fp8.pack_states(tree)
    # The amaxes packed the same way: states whose scale is the amax, packed; their
    # groups' scales are the packed amaxes, row for row.
    as_scale = jax.tree.map(lambda s, a: jax_fp8.ScalingState(s.amax_history, a, s.scale_inv,
                                                              s.fp8_dtype) if is_state(s) else s,
                            tree, amaxes, is_leaf=is_state)
    amax_tree = jax_fp8.PackedStates(tuple(g.scale for g in jax_fp8.pack_states(as_scale).groups),
                                     packed.others, packed.layout)
    update = jax.jit(lambda t, a: jax_fp8.update_states(t, a), donate_argnums=0)
    text = update.lower(packed, amax_tree).compile().as_text()
    assert text.count(TARGET) == 1
    got = update(packed, amax_tree).unpack()
    want = jax.jit(lambda t, a: jax_fp8.update_states(t, a))(tree, amaxes)
    _bits_equal(got, want)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        dg = lambda: Fp8DotGeneral(recipe=jax_fp8.DelayedScaling(history_len=8))  # noqa: E731
        for i, f in enumerate((16, 16, 4)):
            x = nn.Dense(f, dot_general_cls=dg)(x)
            x = nn.relu(x) if i < 2 else x
        return x


def _has_split_kernel(backend):
    from jax_fp8 import _registration

    return "jax_fp8_split_rows" in (_registration.CUDA_TARGETS if backend == "gpu"
                                    else _registration.CPU_TARGETS)


def test_packed_train_state_trains_bit_equal_to_unpacked(backend, device):
    """The packed step's scale vectors also reach the layers through one
    jax_fp8_split_rows each (no slice per state)."""
    rng = np.random.default_rng(2)
    with jax.default_device(device):
        x = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
        y = jnp.tanh(x[:, :4])
        model = MLP()
        variables = jax.jit(model.init)(jax.random.key(0), x)
        recipe = jax_fp8.DelayedScaling(history_len=8)
        plain, packed = [Fp8TrainState.create(apply_fn=model.apply, variables=variables,
                                              tx=optax.adam(1e-2), recipe=recipe, pack_fp8=pack)
                         for pack in (False, True)]
        # 3 layers x (input, kernel: e4m3; grad: e5m2), history 8: two groups, 6 arrays.
        assert len(jax.tree.leaves(packed.fp8)) == 6 and len(jax.tree.leaves(plain.fp8)) == 27

        step = jax.jit(lambda state: helpers.mse_fp8_step(state, x, y))
        text = step.lower(packed).compile().as_text()
        assert text.count(TARGET) == 1
        # Two groups (E4M3, E5M2); the step reads scale_inv of both and the E4M3 scales
        # (XLA may drop a split whose pieces it does not use).
        splits = text.count(SPLIT)
        assert (1 <= splits <= 4) if _has_split_kernel(backend) else splits == 0, splits
        assert SPLIT not in step.lower(plain).compile().as_text()
        for _ in range(4):
            plain, loss_plain = step(plain)
            packed, loss_packed = step(packed)
            assert float(loss_plain) == float(loss_packed)
    _bits_equal(packed.fp8.unpack(), plain.fp8)
    _bits_equal(packed.params, plain.params)
    # The scales moved: the amaxes reached the packed rows.
    assert all(float(np.min(np.asarray(g.amax_history)[:, -1])) > 0 for g in packed.fp8.groups)
    assert packed.variables()[FP8_COLLECTION] is not None


# ----------------------------------------------------------------- the split of the scales


def _split_cases(rng, pieces):
    """(values, sizes): every float32 class (NaN payloads, infinities, subnormals, -0), and
    piece sizes with zeros, a long piece and more non-empty pieces than one CUDA launch
    describes (2,040)."""
    sizes = [0, 0] + list(rng.integers(1, 4, size=pieces)) + [3000, 0, 1]
    bits = rng.integers(0, 2**32, size=sum(sizes), dtype=np.uint64).astype(np.uint32)
    bits[:8] = [0x7FC00001, 0xFFBFFFFF, 0x7F800000, 0xFF800000, 0x00000001, 0x807FFFFF,
                0x80000000, 0x00000000]
    return bits.view(np.float32), tuple(int(n) for n in sizes)


def test_split_rows_is_slices(backend, device):
    from jax_fp8._primitives import split

    values, sizes = _split_cases(np.random.default_rng(3), 2100)
    a = jax.device_put(values, device)
    fn = jax.jit(lambda a: split.split_rows(a, sizes))
    got = fn(a)
    start = 0
    for piece, n in zip(got, sizes):
        helpers.assert_bits_equal(np.asarray(piece), values[start:start + n], "split piece")
        start += n
    text = fn.lower(a).compile().as_text()
    # One custom call (ffi/split_cuda.cu, ffi/split_cpu.cc).
    assert text.count(SPLIT) == (1 if _has_split_kernel(backend) else 0)
    # vmap, the gradient (a concatenation) and sizes of one piece: plain slices.
    b = jnp.stack([a[:10], -a[:10]])
    helpers.assert_bits_equal(np.asarray(jax.vmap(lambda r: split.split_rows(r, (4, 6))[1])(b)),
                              np.asarray(b[:, 4:]), "vmap")
    g = jax.grad(lambda r: sum(p.sum() * (i + 1) for i, p in
                               enumerate(split.split_rows(r, (4, 0, 6)))))(jnp.ones(10))
    np.testing.assert_array_equal(np.asarray(g), [1.0] * 4 + [3.0] * 6)


def test_split_rows_refuses_what_it_cannot_split():
    from jax_fp8._primitives import split

    with pytest.raises(TypeError, match="sizes summing to R"):
        split.split_rows_p.bind(jnp.ones(5), sizes=(2, 2))
    # Other dtypes and ranks are XLA slices.
    out = split.split_rows(jnp.ones((5, 2)), (2, 3))
    assert [o.shape for o in out] == [(2, 2), (3, 2)]
