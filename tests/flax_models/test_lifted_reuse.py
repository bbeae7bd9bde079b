"""A block under a lifted transform (nn.remat, nn.jit, nn.vmap with the FP8 collection
broadcast) called twice in one apply: its FP8 state is the one state of a layer used
twice, and its staged amaxes are the max over the two calls, by `state.apply_model` and by
`model.apply` with the collection mutable alike, bit for bit those of the two GEMMs written
out with the meta threaded. With the collection read-only a lifted body cannot pass the
threaded state on (a lifted transform returns only mutable collections): evaluation works,
and a differentiated computation is refused at trace time naming the mutable apply
(JAX would add the two calls' amaxes). A block called once that calls its layer twice
threads inside the body whichever way it is applied."""

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

RECIPE = jax_fp8.DelayedScaling(history_len=4)
DG = functools.partial(Fp8DotGeneral, recipe=RECIPE)
DN = (((1,), (0,)), ((), ()))
X = rand(0, (2, 4, 8), 2.0)
TWICE = (r"read-only in this apply and the block holding it, under the lifted transform "
         r"`{t}`, is called a second time in one differentiated computation.*"
         r"mutable=\['fp8_meta'\].*state.apply_model")


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(8, dot_general_cls=DG)(x))


def _lift(kind):
    if kind == "remat":
        return nn.remat(Block)
    if kind == "jit":
        return nn.jit(Block)
    return nn.vmap(Block, variable_axes={"params": None, FP8_COLLECTION: None},
                   split_rngs={"params": False}, in_axes=0, out_axes=0)


class CalledTwice(nn.Module):
    """The lifted block's one instance applied twice."""
    kind: str

    @nn.compact
    def __call__(self, x):
        block = _lift(self.kind)(name="block")
        return block(block(x) * 3.0)


def _x(kind):
    return X if kind == "vmap" else X[0]   # nn.vmap maps the leading axis


def _model_and_state(kind, pack_fp8):
    model = CalledTwice(kind)
    v = jax.jit(model.init)(jax.random.key(0), _x(kind))
    return model, v, Fp8TrainState.create(apply_fn=model.apply, variables=v,
                                          tx=optax.sgd(0.0), recipe=RECIPE,
                                          pack_fp8=pack_fp8)


def _written_out(params, meta, x):
    """The two calls' GEMMs, the meta threaded from the first to the second."""
    dense = params["block"]["Dense_0"]
    out, meta = jax_fp8.fp8_dot_general(x, dense["kernel"], DN, meta)
    h = jnp.tanh(out + dense["bias"]) * 3.0
    out, meta = jax_fp8.fp8_dot_general(h, dense["kernel"], DN, meta)
    return jnp.tanh(out + dense["bias"])


def _written_out_grads(kind, params, fp8, x):
    states = fp8["block"]["Dense_0"]["Fp8DotGeneral_0"]

    def loss(states):
        meta = jax_fp8.Fp8Meta(*(states[n] for n in jax_fp8.Fp8Meta.STATES))
        f = functools.partial(_written_out, params, meta)
        y = jax.vmap(f)(x) if kind == "vmap" else f(x)     # one meta for the batch
        return jnp.sum(jnp.sin(y))

    grads = jax.jit(jax.grad(loss))(states)
    return {"block": {"Dense_0": {"Fp8DotGeneral_0": grads}}}


def _unpacked(fp8):
    return jax_fp8.unpack_states(fp8) if isinstance(fp8, jax_fp8.PackedStates) else fp8


KINDS = ["remat", "jit", "vmap"]


@pytest.mark.parametrize("pack_fp8", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("kind", KINDS)
def test_mutable_paths_stage_the_max_over_both_calls(on_cpu, kind, pack_fp8):
    model, v, state = _model_and_state(kind, pack_fp8)
    x = _x(kind)
    want = _written_out_grads(kind, v["params"], v[FP8_COLLECTION], x)

    def by_apply_model(p, f):
        return jnp.sum(jnp.sin(state.apply_model(p, f, x)))

    def by_mutable_apply(p, f):
        out, _ = model.apply({"params": p, FP8_COLLECTION: f}, x, mutable=[FP8_COLLECTION])
        return jnp.sum(jnp.sin(out))

    for loss in (by_apply_model, by_mutable_apply):
        _, grads = jax.jit(lambda s, loss=loss: s.value_and_grad(loss)())(state)
        got = jax_fp8.amax_cotangents(_unpacked(grads[FP8_COLLECTION]))
        jax.tree.map(np.testing.assert_array_equal, got, jax_fp8.amax_cotangents(want))
    # The max, not the sum, of the two calls' input amaxes.
    staged = jax_fp8.amax_cotangents(want)["block"]["Dense_0"]["Fp8DotGeneral_0"]
    first = np.float32(np.max(np.abs(np.asarray(x))))
    assert staged["input"] >= first and staged["input"] < 2 * first


@pytest.mark.parametrize("pack_fp8", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("kind", KINDS)
def test_read_only_apply_differentiated_names_the_fix(on_cpu, kind, pack_fp8):
    model, v, state = _model_and_state(kind, pack_fp8)
    x = _x(kind)

    def loss(p, f):
        return jnp.sum(jnp.sin(model.apply({"params": p, FP8_COLLECTION: f}, x)))

    with pytest.raises(ValueError, match=TWICE.format(t=kind)):
        jax.jit(lambda s: s.value_and_grad(loss)())(state)
    with pytest.raises(ValueError, match=TWICE.format(t=kind)):   # by jax.grad, eagerly
        jax.grad(loss, argnums=1)(state.params, state.fp8)


@pytest.mark.parametrize("kind", KINDS)
def test_read_only_evaluation_runs(on_cpu, kind):
    """Not differentiated, nothing is staged: the read-only apply evaluates, the outputs
    of the mutable apply and of the GEMMs written out."""
    model, v, state = _model_and_state(kind, True)
    x = _x(kind)
    states = v[FP8_COLLECTION]["block"]["Dense_0"]["Fp8DotGeneral_0"]
    meta = jax_fp8.Fp8Meta(*(states[n] for n in jax_fp8.Fp8Meta.STATES))
    f = functools.partial(_written_out, v["params"], meta)
    want = jax.jit(jax.vmap(f) if kind == "vmap" else f)(x)
    np.testing.assert_array_equal(jax.jit(model.apply)(v, x), want)
    np.testing.assert_array_equal(
        model.apply({"params": state.params, FP8_COLLECTION: state.fp8}, x), want)
    np.testing.assert_array_equal(jax.jit(state.apply_model)(state.params, state.fp8, x),
                                  want)


class CallsItsLayerTwice(nn.Module):
    """A lifted block called once whose layer is called twice inside it."""
    kind: str

    @nn.compact
    def __call__(self, x):
        class Inner(nn.Module):
            @nn.compact
            def __call__(self, x):
                dense = nn.Dense(8, dot_general_cls=DG)
                return jnp.tanh(dense(jnp.tanh(dense(x)) * 3.0))

        if self.kind == "remat":
            inner = nn.remat(Inner)
        elif self.kind == "jit":
            inner = nn.jit(Inner)
        else:
            inner = nn.vmap(Inner, variable_axes={"params": None, FP8_COLLECTION: None},
                            split_rngs={"params": False}, in_axes=0, out_axes=0)
        return inner(name="block")(x)


@pytest.mark.parametrize("kind", KINDS)
def test_one_lifted_call_threads_inside_whichever_way_applied(on_cpu, kind):
    model = CallsItsLayerTwice(kind)
    x = _x(kind)
    v = jax.jit(model.init)(jax.random.key(0), x)
    want = _written_out_grads(kind, v["params"], v[FP8_COLLECTION], x)

    def loss(f, mutable):
        variables = {"params": v["params"], FP8_COLLECTION: f}
        out = (model.apply(variables, x, mutable=[FP8_COLLECTION])[0] if mutable
               else model.apply(variables, x))
        return jnp.sum(jnp.sin(out))

    for mutable in (False, True):
        grads = jax.jit(jax.grad(loss), static_argnums=1)(v[FP8_COLLECTION], mutable)
        jax.tree.map(np.testing.assert_array_equal, jax_fp8.amax_cotangents(grads),
                     jax_fp8.amax_cotangents(want))


def test_a_scan_of_remat_blocks_read_only_is_not_refused(on_cpu):
    """nn.scan traces its body twice (Flax's broadcast pass, then lax.scan's): one remat
    call per trace is one call, and the read-only apply differentiates as the mutable one."""
    class Layer(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return Block()(h), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.scan(nn.remat(Layer), variable_axes={"params": 0, FP8_COLLECTION: 0},
                           split_rngs={"params": True}, length=3)()(x, None)[0]

    model, x = Stack(), X[0]
    v = jax.jit(model.init)(jax.random.key(0), x)

    def loss(f, mutable):
        variables = {"params": v["params"], FP8_COLLECTION: f}
        out = (model.apply(variables, x, mutable=[FP8_COLLECTION])[0] if mutable
               else model.apply(variables, x))
        return jnp.sum(jnp.sin(out))

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    jax.tree.map(np.testing.assert_array_equal, grad(v[FP8_COLLECTION], False),
                 grad(v[FP8_COLLECTION], True))


def test_the_branches_of_a_lifted_cond_read_only_are_one_call(on_cpu):
    """nn.cond traces both branches, each calling the block: only one runs, so the
    read-only apply differentiates as the mutable one (no refusal)."""
    class Cond(nn.Module):
        @nn.compact
        def __call__(self, x, pred):
            block = Block(name="block")
            if self.is_initializing():
                return block(x)
            return nn.cond(pred, lambda m, x: m(x), lambda m, x: m(x) * 2.0, block, x)

    model, x = Cond(), X[0]
    v = jax.jit(model.init)(jax.random.key(0), x, True)

    def loss(f, mutable):
        variables = {"params": v["params"], FP8_COLLECTION: f}
        out = (model.apply(variables, x, True, mutable=[FP8_COLLECTION])[0] if mutable
               else model.apply(variables, x, True))
        return jnp.sum(jnp.sin(out))

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    jax.tree.map(np.testing.assert_array_equal, grad(v[FP8_COLLECTION], False),
                 grad(v[FP8_COLLECTION], True))
