"""A weight-tied nn.scan (one Dense applied at every iteration) with FP8 layers: where
its FP8 state may live and what each choice computes.

- ``variable_broadcast=["params", "fp8_meta"]``: init and evaluation (the collection
  read-only or mutable) work; a train step differentiating the broadcast state is a
  ValueError at trace time that names ``variable_broadcast`` and the two fixes (JAX
  would add the iterations' amaxes where FP8 takes their max).
- ``variable_broadcast="params", variable_axes={"fp8_meta": 0}``: a state per
  iteration; its amaxes are that iteration's, bit for bit those of the same GEMMs
  written out with `jax_fp8.fp8_dot_general`.
- ``variable_broadcast="params", variable_carry="fp8_meta"``: one state; its amaxes
  are the max over the iterations. Flax's scan needs a carried collection mutable:
  ``model.apply`` with it read-only is a ValueError naming ``mutable=["fp8_meta"]``.

Each through init, a train step of `Fp8TrainState` (the new states) and evaluation.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_fp8
from helpers import rand
from jax_fp8.flax import FP8_COLLECTION, Fp8DotGeneral, Fp8TrainState

N, L = 3, 4
RECIPE = jax_fp8.DelayedScaling(history_len=L)
DG = functools.partial(Fp8DotGeneral, recipe=RECIPE)
DN = (((1,), (0,)), ((), ()))
X = rand(0, (8, 16), 3.0)


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return jnp.tanh(nn.Dense(16, dot_general_cls=DG)(h)), None


def _scan(**where_fp8):
    return nn.scan(Block, variable_broadcast=where_fp8.pop("broadcast", "params"),
                   split_rngs={"params": False}, length=N, **where_fp8)


class Broadcast(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _scan(broadcast=["params", FP8_COLLECTION])(name="loop")(x, None)[0]


class PerIteration(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _scan(variable_axes={FP8_COLLECTION: 0})(name="loop")(x, None)[0]


class Carried(nn.Module):
    @nn.compact
    def __call__(self, x):
        if self.is_initializing():  # a carried collection must exist before the scan
            Block(name="loop")(x, None)
            return x
        return _scan(variable_carry=FP8_COLLECTION)(name="loop")(x, None)[0]


def _layer(tree):
    return tree["loop"]["Dense_0"]


def _meta(fp8, i=None):
    states = _layer(fp8)["Fp8DotGeneral_0"]
    pick = (lambda s: s) if i is None else (lambda s: jax.tree.map(lambda a: a[i], s))
    return jax_fp8.Fp8Meta(*(pick(states[n]) for n in jax_fp8.Fp8Meta.STATES))


def _written_out(params, metas, x):
    """The scan's GEMMs written out: iteration i multiplies by the one kernel with
    metas(i) and returns the meta it threads."""
    kernel, bias = _layer(params)["kernel"], _layer(params)["bias"]
    h, meta = x, None
    for i in range(N):
        out, meta = jax_fp8.fp8_dot_general(h, kernel, DN, metas(i, meta))
        h = jnp.tanh(out + bias)
    return h


def _written_out_grads(params, metas_tree, metas):
    """FP8 gradients of sum(sin(out)) of `_written_out`, w.r.t. ``metas_tree``."""
    def loss(tree):
        return jnp.sum(jnp.sin(_written_out(params, lambda i, m: metas(tree, i, m), X)))
    return jax.jit(jax.grad(loss))(metas_tree)


def _loss(state):
    def loss(params, fp8):
        return jnp.sum(jnp.sin(state.apply_model(params, fp8, X)))
    return loss


def _train_state(model):
    v = jax.jit(model.init)(jax.random.key(0), X)
    return v, Fp8TrainState.create(apply_fn=model.apply, variables=v, tx=optax.sgd(0.0),
                                   recipe=RECIPE)


@jax.jit
def _step(state):
    _, grads = state.value_and_grad(_loss(state))()
    return state.apply_gradients(grads=grads), grads


def _one_state_after_init(v):
    return (_meta(v[FP8_COLLECTION]).input.amax_history.shape == (L,)
            and not np.any(_meta(v[FP8_COLLECTION]).input.amax_history))


# ------------------------------------------------------------------- broadcast


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_broadcast_fp8_state_inits_and_evaluates(on_cpu, jit):
    model = Broadcast()
    v = (jax.jit(model.init) if jit else model.init)(jax.random.key(0), X)
    assert _one_state_after_init(v)
    fp8 = v[FP8_COLLECTION]
    want = _written_out(v["params"], lambda i, m: _meta(fp8), X)
    apply = jax.jit(model.apply, static_argnames="mutable") if jit else model.apply
    np.testing.assert_array_equal(apply(v, X), want)
    out, updates = apply(v, X, mutable=(FP8_COLLECTION,))     # evaluation, mutable
    np.testing.assert_array_equal(out, want)
    jax.tree.map(np.testing.assert_array_equal, updates[FP8_COLLECTION], fp8)
    state = Fp8TrainState.create(apply_fn=model.apply, variables=v, tx=optax.sgd(0.1),
                                 recipe=RECIPE)
    run = jax.jit(state.apply_model) if jit else state.apply_model
    np.testing.assert_array_equal(run(state.params, state.fp8, X), want)


def test_broadcast_fp8_state_in_a_train_step_names_the_fix(on_cpu):
    _, state = _train_state(Broadcast())
    with pytest.raises(ValueError, match=r"differentiated but broadcast into a `scan` body "
                       r"\(nn.scan's variable_broadcast\).*variable_axes=\{'fp8_meta': 0\}"
                       r".*variable_carry='fp8_meta'"):
        _step(state)
    # The FP8 collection read-only, differentiated by hand: the same error.
    v = state.variables()

    def loss(fp8):
        return jnp.sum(Broadcast().apply({"params": v["params"], FP8_COLLECTION: fp8}, X))

    with pytest.raises(ValueError, match="variable_broadcast"):
        jax.jit(jax.grad(loss))(v[FP8_COLLECTION])


# ------------------------------------------------------ a state per iteration


def test_tied_weights_with_a_state_per_iteration(on_cpu):
    v, state = _train_state(PerIteration())
    fp8 = v[FP8_COLLECTION]
    assert _meta(fp8).input.amax_history.shape == (N, L)         # one state per iteration
    assert _layer(v["params"])["kernel"].shape == (16, 16)       # one kernel
    new, grads = _step(state)
    want = _written_out_grads(v["params"], fp8, lambda t, i, m: _meta(t, i))
    jax.tree.map(np.testing.assert_array_equal,   # AmaxGrads: the staged amaxes
                 jax_fp8.amax_cotangents(grads[FP8_COLLECTION].unpack()),
                 jax_fp8.amax_cotangents(want))
    staged = jax_fp8.amax_cotangents(want)
    new_fp8 = new.variables()[FP8_COLLECTION]
    for name in jax_fp8.Fp8Meta.STATES:
        last = getattr(_meta(new_fp8), name).amax_history[:, -1]
        np.testing.assert_array_equal(last, _layer(staged)["Fp8DotGeneral_0"][name])
    # Iteration i quantized its own input: three different amaxes.
    assert len(set(np.asarray(_meta(new_fp8).input.amax_history[:, -1]).tolist())) == N
    np.testing.assert_array_equal(
        new.apply_model(new.params, new.fp8, X),
        _written_out(new.params, lambda i, m: _meta(new_fp8, i), X))


# ------------------------------------------------------------ one carried state


def test_tied_weights_with_one_carried_state(on_cpu):
    v, state = _train_state(Carried())
    assert _one_state_after_init(v)
    fp8 = v[FP8_COLLECTION]
    np.testing.assert_array_equal(
        jax.jit(state.apply_model)(state.params, state.fp8, X),
        _written_out(v["params"], lambda i, m: _meta(fp8) if m is None else m, X))
    new, grads = _step(state)
    want = _written_out_grads(v["params"], fp8,
                              lambda t, i, m: _meta(t) if m is None else m)
    jax.tree.map(np.testing.assert_array_equal,   # AmaxGrads: the staged amaxes
                 jax_fp8.amax_cotangents(grads[FP8_COLLECTION].unpack()),
                 jax_fp8.amax_cotangents(want))
    new_fp8 = new.variables()[FP8_COLLECTION]
    staged = _layer(jax_fp8.amax_cotangents(want))["Fp8DotGeneral_0"]
    for name in jax_fp8.Fp8Meta.STATES:
        np.testing.assert_array_equal(getattr(_meta(new_fp8), name).amax_history[-1],
                                      staged[name])
    np.testing.assert_array_equal(
        new.apply_model(new.params, new.fp8, X),
        _written_out(new.params, lambda i, m: _meta(new_fp8) if m is None else m, X))


def _carried_fp8(packed):
    model = Carried()
    v, state = _train_state(model)
    return model, v, state, (state.fp8 if packed else v[FP8_COLLECTION])


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("how", ["eager", "jit", "jit_grad"])
def test_carried_state_read_only_names_the_fix(on_cpu, packed, how):
    """``model.apply`` with the carried collection read-only: Flax's scan would leave it
    out of the body's carry (JAX's "carry input and carry output must have the same pytree
    structure", for any collection); the FP8 layer raises first, naming the fix."""
    model, v, _, fp8 = _carried_fp8(packed)

    def read_only(f):
        return jnp.sum(jnp.sin(model.apply({"params": v["params"], FP8_COLLECTION: f}, X)))

    run = {"eager": read_only, "jit": jax.jit(read_only),
           "jit_grad": jax.jit(jax.grad(read_only))}[how]
    with pytest.raises(ValueError, match=r"carried from iteration to iteration by `nn.scan` "
                       r"\(variable_carry='fp8_meta'\), and this apply holds the collection "
                       r"read-only.*mutable=\['fp8_meta'\].*state.apply_model"):
        run(fp8)


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_carried_state_the_named_fix(on_cpu, packed):
    """The fix the error names, the collection mutable: the outputs and, differentiated,
    the FP8 gradients of the written-out GEMMs (the max over the iterations), bit for bit;
    a packed collection's gradient comes back packed, ready for apply_gradients."""
    model, v, state, fp8 = _carried_fp8(packed)

    def metas(i, m):
        return _meta(v[FP8_COLLECTION]) if m is None else m

    def apply(f):
        return model.apply({"params": v["params"], FP8_COLLECTION: f}, X,
                           mutable=[FP8_COLLECTION])[0]

    np.testing.assert_array_equal(jax.jit(apply)(fp8), _written_out(v["params"], metas, X))
    grads = jax.jit(jax.grad(lambda f: jnp.sum(jnp.sin(apply(f)))))(fp8)
    want = _written_out_grads(v["params"], v[FP8_COLLECTION],
                              lambda t, i, m: _meta(t) if m is None else m)
    got = jax_fp8.unpack_states(grads) if packed else grads
    jax.tree.map(np.testing.assert_array_equal, got, want)   # raw cotangents, bit for bit
    new = state.apply_gradients(grads=jax.tree.map(jnp.zeros_like, state.params),
                                fp8_grads=grads if packed else jax_fp8.pack_states(grads))
    np.testing.assert_array_equal(
        _meta(new.variables()[FP8_COLLECTION]).input.amax_history[-1],
        _layer(jax_fp8.amax_cotangents(want))["Fp8DotGeneral_0"]["input"])


def test_a_state_per_iteration_read_only_is_not_refused(on_cpu):
    """A state per iteration (``variable_axes``) read-only evaluates: only a carry is
    refused."""
    model = PerIteration()
    v = jax.jit(model.init)(jax.random.key(0), X)
    fp8 = v[FP8_COLLECTION]
    np.testing.assert_array_equal(
        jax.jit(model.apply)(v, X),
        _written_out(v["params"], lambda i, m: _meta(fp8, i), X))
