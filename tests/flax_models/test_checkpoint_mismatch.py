"""Checkpoints that disagree with the model they are restored into: the right state, or an
error at restore time that names the state.

The matrix: how the model changed between save and restore (FP8 layers moved, added,
removed, renamed, restacked; another history length, FP8 format, margin or recipe) x packed or
unpacked FP8 state x msgpack (flax.serialization) or orbax (StandardCheckpointer,
PyTreeCheckpointer, CheckpointManager, as a user calls them). What is saved and restored
is the model's FP8 collection, as `Fp8TrainState.fp8` holds it (params of a changed model
differ too, and the restore of those is Flax's and orbax's business). Then the full train
state: a packed state restored into a model whose FP8 layers moved, and a bigger packed
state into a smaller model; plain `ScalingState`s restored into a target of another FP8
format (orbax compares keys and shapes only, so the format is in the keys); NNX states.
"""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx, serialization

import jax_fp8
from jax_fp8.flax import Fp8DotGeneral, Fp8TrainState, nnx as fnnx

RECIPE = jax_fp8.DelayedScaling(history_len=8)
IS_STATE = lambda x: isinstance(x, jax_fp8.ScalingState)  # noqa: E731


class Net(nn.Module):
    """Three 8->8 Dense layers; FP8 on those named in ``fp8_on``."""

    names: tuple = ("d0", "d1", "d2")
    fp8_on: tuple = ("d0", "d2")
    recipe: object = RECIPE

    @nn.compact
    def __call__(self, x):
        for name in self.names:
            dg = (functools.partial(Fp8DotGeneral, recipe=self.recipe)
                  if name in self.fp8_on else None)
            x = nn.Dense(8, dot_general_cls=dg, name=name)(x)
        return x


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        dg = functools.partial(Fp8DotGeneral, recipe=RECIPE)
        return nn.Dense(8, dot_general_cls=dg)(x), None


class Stack(nn.Module):
    """``length`` FP8 Dense layers under nn.scan: states of lead shape (length,)."""

    length: int = 3

    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(_Block, variable_axes={"params": 0, "fp8_meta": 0},
                         split_rngs={"params": True}, length=self.length)
        return blocks(name="blocks")(x, None)[0]


MODELS = {
    "base": Net(),
    "moved": Net(fp8_on=("d1", "d2")),
    "added": Net(fp8_on=("d0", "d1", "d2")),
    "renamed": Net(names=("e0", "d1", "d2"), fp8_on=("e0", "d2")),
    "history": Net(recipe=jax_fp8.DelayedScaling(history_len=16)),
    "format": Net(recipe=jax_fp8.DelayedScaling(history_len=8,
                                                fp8_format=jax_fp8.Format.E4M3)),
    "stateless": Net(recipe=jax_fp8.Float8CurrentScaling()),
    # The same states; only how the update reads them differs.
    "retuned": Net(recipe=jax_fp8.DelayedScaling(history_len=8, margin=1,
                                                 amax_compute_algo="most_recent")),
    "stack3": Stack(3),
    "stack2": Stack(2),
}


@functools.cache
def fp8_of(model_name):
    """The model's FP8 collection, every state filled with distinct values."""
    variables = MODELS[model_name].init(jax.random.key(0), jnp.ones((4, 8)))
    fp8 = variables.get("fp8_meta", {})  # none for a stateless recipe
    rng = np.random.default_rng(len(model_name))
    return jax.tree.map(lambda a: jnp.asarray(rng.random(a.shape, np.float32) + 1), fp8)


def as_saved(model_name, packed):
    fp8 = fp8_of(model_name)
    return jax_fp8.pack_states(fp8) if packed else fp8


# --------------------------------------------------------------------------- the backends


def _msgpack(tmp_path, saved, target):
    return serialization.from_bytes(target, serialization.to_bytes(saved))


def _abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def _standard(tmp_path, saved, target):
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "standard", saved)
    ckptr.wait_until_finished()
    return ckptr.restore(tmp_path / "standard", _abstract(target))


def _pytree(tmp_path, saved, target):
    ckptr = ocp.PyTreeCheckpointer()
    ckptr.save(tmp_path / "pytree", saved)
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    return ckptr.restore(tmp_path / "pytree", args=ocp.args.PyTreeRestore(
        item=target, restore_args=restore_args))


def _manager(tmp_path, saved, target):
    with ocp.CheckpointManager(tmp_path / "manager") as mngr:
        mngr.save(3, args=ocp.args.StandardSave(saved))
        mngr.wait_until_finished()
        return mngr.restore(3, args=ocp.args.StandardRestore(_abstract(target)))


BACKENDS = {"msgpack": _msgpack, "orbax_standard": _standard, "orbax_pytree": _pytree,
            "orbax_manager": _manager}

# --------------------------------------------------------------------------- the matrix

# What each restore gives: None = the target's states, restored from the checkpoint's
# states at the same paths; else a regex of the error. Per case: (saved model, target
# model, msgpack packed, msgpack unpacked, orbax packed, orbax unpacked).
ORBAX_KEYS = "tree structures do not match"
ORBAX_SHAPE = "not compatible with the stored shape"

CASES = {
    "same": ("base", "base", None, None, None, None),
    "retuned": ("base", "retuned", None, None, None, None),
    "moved": ("base", "moved",
              r"restoring the packed FP8 states at fp8_meta: the target's state "
              r"\['d1'\]\['Fp8DotGeneral_0'\]\['grad'\] \(float8_e5m2, history 8\) is not in "
              r"the checkpoint; the checkpoint's state \['d0'\].* is not in the target",
              r"\{'d1'\} which are not present", ORBAX_KEYS + r"(.|\n)*float8_e4m3fn_L8_4rows",
              ORBAX_KEYS + r"(.|\n)*d1"),
    "added": ("base", "added",
              r"the target's state \['d1'\]\['Fp8DotGeneral_0'\]\['grad'\].* is not in the "
              r"checkpoint \(checkpoint: 6 states, target: 9; 3 missing, 0 extra",
              r"\{'d1'\} which are not present", ORBAX_KEYS + r"(.|\n)*float8_e4m3fn_L8_6rows",
              ORBAX_KEYS + r"(.|\n)*d1"),
    "removed": ("added", "base",
                r"the checkpoint's state \['d1'\]\['Fp8DotGeneral_0'\]\['grad'\].* is not in "
                r"the target \(checkpoint: 9 states, target: 6; 0 missing, 3 extra",
                None, ORBAX_KEYS, ORBAX_KEYS + r"(.|\n)*d1"),
    "renamed": ("base", "renamed",
                r"the target's state \['e0'\]\['Fp8DotGeneral_0'\]\['grad'\]",
                r"\{'e0'\} which are not present", ORBAX_KEYS, ORBAX_KEYS + r"(.|\n)*e0"),
    "history": ("base", "history",
                r"the state \['d0'\]\['Fp8DotGeneral_0'\]\['grad'\] was saved as float8_e5m2, "
                r"history 8; the target's is float8_e5m2, history 16",
                r"at fp8_meta/d0/Fp8DotGeneral_0/grad: its amax_history was saved with shape "
                r"\(8,\), the target's has \(16,\)",
                ORBAX_KEYS + r"(.|\n)*float8_e4m3fn_L16", ORBAX_SHAPE),
    "format": ("base", "format",
               r"the state \['d0'\]\['Fp8DotGeneral_0'\]\['grad'\] was saved as float8_e5m2, "
               r"history 8; the target's is float8_e4m3fn, history 8",
               r"at fp8_meta/d0/Fp8DotGeneral_0/grad: it was saved as float8_e5m2, the "
               r"target's FP8 format is float8_e4m3fn",
               ORBAX_KEYS + r"(.|\n)*float8_e4m3fn_L8_6rows",
               ORBAX_KEYS + r"(.|\n)*grad.scale_float8_e5m2"),
    "to_stateless": ("base", "stateless",
                     r"the checkpoint's state \['d0'\].* is not in the target",
                     None, ORBAX_KEYS, ORBAX_KEYS),
    "from_stateless": ("stateless", "base",
                       r"the target's state \['d0'\].* is not in the checkpoint",
                       r"\{'d0', 'd2'\}|\{'d2', 'd0'\}", ORBAX_KEYS, ORBAX_KEYS),
    "restacked": ("stack3", "stack2",
                  r"the state \['blocks'\]\['Dense_0'\]\['Fp8DotGeneral_0'\]\['grad'\] was "
                  r"saved as float8_e5m2, history 8, lead shape \(3,\); the target's is "
                  r"float8_e5m2, history 8, lead shape \(2,\)",
                  r"its amax_history was saved with shape \(3, 8\), the target's has \(2, 8\)",
                  ORBAX_KEYS + r"(.|\n)*_2rows_", ORBAX_SHAPE),
}


def _expected(saved, target):
    """The target's states, from the checkpoint's at the same paths."""
    flat = dict(jax.tree_util.tree_flatten_with_path(saved, is_leaf=IS_STATE)[0])
    return jax.tree_util.tree_map_with_path(lambda p, _: flat[p], target, is_leaf=IS_STATE)


def _assert_same_states(got, want):
    structure = functools.partial(jax.tree.structure, is_leaf=IS_STATE)
    leaves = functools.partial(jax.tree.leaves, is_leaf=IS_STATE)
    assert structure(got) == structure(want)
    for x, y in zip(leaves(got), leaves(want)):
        if not IS_STATE(y):  # a parameter
            np.testing.assert_array_equal(x, y)
            continue
        assert x.fp8_dtype == y.fp8_dtype
        for f in ("amax_history", "scale", "scale_inv"):
            np.testing.assert_array_equal(getattr(x, f), getattr(y, f))


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("case", list(CASES))
def test_restore_into_changed_model(tmp_path, case, packed, backend):
    saved_model, target_model, mp_packed, mp_plain, ob_packed, ob_plain = CASES[case]
    # Restored as a user holds it: the collection under its name, as in a train state.
    saved = {"fp8_meta": as_saved(saved_model, packed)}
    target = {"fp8_meta": as_saved(target_model, packed)}
    error = ((mp_packed if packed else mp_plain) if backend == "msgpack"
             else (ob_packed if packed else ob_plain))
    restore = BACKENDS[backend]
    if error is None:
        got = restore(tmp_path, saved, target)
        unpack = lambda t: {"fp8_meta": jax_fp8.unpack_states(t["fp8_meta"])}  # noqa: E731
        _assert_same_states(unpack(got), _expected(unpack(saved), unpack(target)))
        if packed:
            assert jax.tree.structure(got) == jax.tree.structure(target)
    else:
        with pytest.raises(ValueError, match=error):
            restore(tmp_path, saved, target)


def test_msgpack_packed_errors_name_the_fix():
    saved, target = as_saved("base", True), as_saved("moved", True)
    with pytest.raises(ValueError, match="at the top level.*restore only the params and "
                                         "start from the new model's fresh FP8 states"):
        serialization.from_bytes(target, serialization.to_bytes(saved))


# ------------------------------------------------------------ packed <-> unpacked, others


def test_packed_and_unpacked_do_not_restore_into_each_other(tmp_path):
    packed, plain = as_saved("base", True), as_saved("base", False)
    with pytest.raises(ValueError, match=r"not a packed group: it was saved unpacked.*"
                                         r"pack_states"):
        serialization.from_bytes(packed, serialization.to_bytes(plain))
    with pytest.raises(ValueError, match="not present in state dict"):
        serialization.from_bytes(plain, serialization.to_bytes(packed))
    for i, (saved, target) in enumerate([(packed, plain), (plain, packed)]):
        with pytest.raises(ValueError, match=ORBAX_KEYS):
            _standard(tmp_path / str(i), saved, target)


def test_packed_leaves_that_are_not_states_are_keyed_by_path(tmp_path):
    st = jax_fp8.ScalingState.create((), 8)
    saved = jax_fp8.pack_states({"a": st, "step": jnp.int32(3)})
    moved = jax_fp8.pack_states({"a": st, "count": jnp.int32(0)})
    with pytest.raises(ValueError, match=r"lacks the target's leaf \['count'\]"):
        serialization.from_bytes(moved, serialization.to_bytes(saved))
    with pytest.raises(ValueError, match=ORBAX_KEYS):
        _standard(tmp_path, saved, moved)
    same = jax_fp8.pack_states({"a": st, "step": jnp.int32(0)})
    assert int(serialization.from_bytes(same, serialization.to_bytes(saved)).unpack()["step"]) == 3
    assert int(_standard(tmp_path / "ok", saved, same).unpack()["step"]) == 3


# ------------------------------------------------------------------- the keys themselves


def test_keys_name_format_and_row_layout():
    e5 = jax_fp8.ScalingState.create((), 8, jnp.float8_e5m2)
    assert [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(e5)[0]] \
        == [".amax_history_float8_e5m2", ".scale_float8_e5m2", ".scale_inv_float8_e5m2"]
    st = jax_fp8.ScalingState.create((2,), 8)
    keys = lambda tree: [p[0].name for p, _ in jax.tree_util.tree_flatten_with_path(  # noqa: E731
        jax_fp8.pack_states(tree), is_leaf=IS_STATE)[0]]
    (key,) = keys({"a": st, "b": st})
    assert re.fullmatch(r"float8_e4m3fn_L8_4rows_[0-9a-f]{12}", key)
    # The digest is of the paths and lead shapes in row order: any change gives another key.
    others = [keys(t)[0] for t in ({"a": st, "c": st}, {"b": st, "a0": st},
                                   {"a": st, "b": jax_fp8.ScalingState.create((1, 2), 8)},
                                   [st, st])]
    assert len({key, *others}) == 5
    assert keys({"a": st, "b": st}) == [key]  # and it is deterministic
    # Three arrays per group still.
    assert jax_fp8.pack_states({"a": st, "b": st, "c": e5}).num_arrays == 6


# ------------------------------------------------------------------ the full train state


def _train_state(model, pack):
    v = model.init(jax.random.key(0), jnp.ones((4, 8)))
    return Fp8TrainState.create(apply_fn=model.apply, variables=v, tx=optax.sgd(0.1),
                                recipe=RECIPE, pack_fp8=pack)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
def test_train_state_with_moved_fp8_layers_refuses(tmp_path, backend, pack):
    """FP8 on d0 and d2 saved, restored into the same model with FP8 on d1 and d2."""
    saved, target = _train_state(MODELS["base"], pack), _train_state(MODELS["moved"], pack)
    if backend == "msgpack":
        want = r"\['d1'\].*not in the checkpoint" if pack else r"\{'d1'\}"
    else:
        want = ORBAX_KEYS
    with pytest.raises(ValueError, match=want):
        BACKENDS[backend](tmp_path, saved, target)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_bigger_packed_train_state_into_smaller_model_refuses_at_restore(tmp_path, backend):
    saved, target = _train_state(MODELS["added"], True), _train_state(MODELS["base"], True)
    want = (r"at fp8: the checkpoint's state \['d1'\].* is not in the target"
            if backend == "msgpack" else ORBAX_KEYS)
    with pytest.raises(ValueError, match=want):
        BACKENDS[backend](tmp_path, saved, target)


# ---------------------------------------------- plain ScalingStates of another FP8 format


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_plain_states_of_another_format_refuse(tmp_path, backend):
    saved = {"g": jax_fp8.ScalingState.create((), 8, jnp.float8_e5m2)}
    target = {"g": jax_fp8.ScalingState.create((), 8, jnp.float8_e4m3fn)}
    want = ("saved as float8_e5m2, the target's FP8 format is float8_e4m3fn"
            if backend == "msgpack" else ORBAX_KEYS + r"(.|\n)*g.amax_history_float8_e5m2")
    with pytest.raises(ValueError, match=want):
        BACKENDS[backend](tmp_path, saved, target)
    same = {"g": jax_fp8.ScalingState(jnp.arange(8.0), jnp.float32(2), jnp.float32(0.5),
                                      jnp.float8_e5m2)}
    _assert_same_states(BACKENDS[backend](tmp_path / "ok", same, saved), same)


class _NnxNet(nnx.Module):
    def __init__(self, recipe, fp8_on, rngs):
        for name in ("a", "b"):
            layer = (fnnx.Fp8Linear(8, 8, recipe=recipe, rngs=rngs) if name in fp8_on
                     else nnx.Linear(8, 8, rngs=rngs))
            setattr(self, name, layer)


@pytest.mark.parametrize("backend", ["msgpack", "orbax_standard"])
@pytest.mark.parametrize("change", ["format", "history", "moved"])
def test_nnx_state_into_changed_model_refuses(tmp_path, change, backend):
    """NNX: orbax saves nnx.state(model); msgpack its pure dict."""
    saved = nnx.state(_NnxNet(RECIPE, ("a",), nnx.Rngs(0)))
    recipe, fp8_on = {
        "format": (jax_fp8.DelayedScaling(history_len=8, fp8_format=jax_fp8.Format.E4M3),
                   ("a",)),
        "history": (jax_fp8.DelayedScaling(history_len=16), ("a",)),
        "moved": (RECIPE, ("b",))}[change]
    target = nnx.state(_NnxNet(recipe, fp8_on, nnx.Rngs(1)))
    if backend == "msgpack":
        want = {"format": "at a/dot_general/grad: it was saved as float8_e5m2, the target's "
                          "FP8 format is float8_e4m3fn",
                "history": r"at a/dot_general/grad: its amax_history was saved with shape "
                           r"\(8,\), the target's has \(16,\)",
                "moved": r"\{'dot_general'\} which are not present in state dict at path ./b"}
        with pytest.raises(ValueError, match=want[change]):
            _msgpack(tmp_path, saved.to_pure_dict(), target.to_pure_dict())
    else:
        want = {"format": ORBAX_KEYS + r"(.|\n)*a.dot_general.grad.value.scale_float8_e5m2",
                "history": ORBAX_SHAPE, "moved": ORBAX_KEYS}
        with pytest.raises(ValueError, match=want[change]):
            _standard(tmp_path, saved, target)
    # The same model restores.
    same = nnx.state(_NnxNet(RECIPE, ("a",), nnx.Rngs(2)))
    got = (_msgpack(tmp_path, saved.to_pure_dict(), same.to_pure_dict())
           if backend == "msgpack" else _standard(tmp_path / "ok", saved, same))
    _assert_same_states(got, saved.to_pure_dict() if backend == "msgpack" else saved)


# ------------------------------------- jax_fp8.flax.orbax_restore: the fix, and fresh FP8

ORBAX_CHECKPOINTERS = {"standard": ocp.StandardCheckpointer, "pytree": ocp.PyTreeCheckpointer}
FIX = r"fresh_fp8=True.*Never pad or truncate an amax history"


def _save(ckptr, path, tree):
    ckptr.save(path, tree)
    if hasattr(ckptr, "wait_until_finished"):
        ckptr.wait_until_finished()


def _adam_state(model, pack, params_offset=0.0):
    v = model.init(jax.random.key(0), jnp.ones((4, 8)))
    s = Fp8TrainState.create(apply_fn=model.apply, variables=v, tx=optax.adam(0.1),
                             recipe=model.recipe, pack_fp8=pack)
    return s.replace(params=jax.tree.map(lambda a: a + params_offset, s.params))


CHANGES = {   # target model: the error's start
    "history": ("history", {True: r"the target's packed FP8 group fp8/float8_e5m2_L16_2rows_"
                                  r"[0-9a-f]{12} \(2 states of float8_e5m2, history 16\): the "
                                  r"states \['d0'\]\['Fp8DotGeneral_0'\]\['grad'\], \['d2'\]"
                                  r".* is not in the checkpoint \(its groups there: "
                                  r"float8_e4m3fn_L8_4rows_[0-9a-f]{12}, float8_e5m2_L8_2rows",
                            False: r"the FP8 state fp8/d0/Fp8DotGeneral_0/grad \(float8_e5m2, "
                                   r"its amax_history of shape \(16,\)\): the checkpoint's has "
                                   r"shape \(8,\)"}),
    "added": ("added", {True: r"the target's packed FP8 group fp8/float8_e5m2_L8_3rows_.*"
                              r"\['d1'\]\['Fp8DotGeneral_0'\]\['grad'\]",
                        False: r"the target's FP8 state fp8/d1/Fp8DotGeneral_0/grad "
                               r"\(float8_e5m2, its amax_history of shape \(8,\)\) is not in "
                               r"the checkpoint"}),
}


@pytest.mark.parametrize("ckptr", list(ORBAX_CHECKPOINTERS))
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_orbax_restore_names_the_state_and_keeps_params_with_fresh_fp8(tmp_path, change,
                                                                       pack, ckptr):
    """Another history length (where orbax would suggest padding) or one more FP8 layer:
    a jax_fp8 error naming the state and fresh_fp8; with fresh_fp8 the checkpoint's
    params and optimizer state, the target's FP8 state, and the step trains."""
    ckptr = ORBAX_CHECKPOINTERS[ckptr]()
    saved = _adam_state(MODELS["base"], pack, params_offset=1.0)
    _save(ckptr, tmp_path / "ckpt", saved)
    model_name, errors = CHANGES[change]
    target = _adam_state(MODELS[model_name], pack)
    with pytest.raises(ValueError, match=errors[pack] + "(.|\n)*" + FIX) as err:
        jax_fp8.flax.orbax_restore(ckptr, tmp_path / "ckpt", target)
    assert "strict=False` in" not in str(err.value) and "tree structures" not in str(err.value)
    got = jax_fp8.flax.orbax_restore(ckptr, tmp_path / "ckpt", target, fresh_fp8=True)
    jax.tree.map(np.testing.assert_array_equal, got.params, saved.params)
    jax.tree.map(np.testing.assert_array_equal, got.opt_state, saved.opt_state)
    assert jax.tree.structure(got.fp8) == jax.tree.structure(target.fp8)
    jax.tree.map(np.testing.assert_array_equal, got.fp8, target.fp8)
    assert int(got.step) == int(saved.step)

    @jax.jit
    def step(state, x):
        def loss_fn(p, f):
            return jnp.mean(state.apply_model(p, f, x) ** 2)
        return state.apply_gradients(grads=state.value_and_grad(loss_fn)()[1])

    jax_fp8.check_fp8_updated(step(got, jnp.ones((4, 8))).fp8)
    # The model that wrote it restores, FP8 state included.
    same = jax_fp8.flax.orbax_restore(ckptr, tmp_path / "ckpt", _adam_state(MODELS["base"], pack))
    jax.tree.map(np.testing.assert_array_equal, same.fp8, saved.fp8)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
def test_orbax_restore_of_a_plain_train_state_into_fp8_train_state(tmp_path, pack):
    from flax.training import train_state

    model = MODELS["base"]
    v = model.init(jax.random.key(1), jnp.ones((4, 8)))
    plain = train_state.TrainState.create(apply_fn=model.apply, params=v["params"],
                                          tx=optax.adam(0.1))
    ckptr = ocp.StandardCheckpointer()
    _save(ckptr, tmp_path / "plain", plain)
    target = _adam_state(model, pack)
    want = (r"the target's packed FP8 group fp8/float8_e\w+ .* is not in the checkpoint "
            r"\(its groups there: none\)" if pack else
            r"the target's FP8 state fp8/d0/Fp8DotGeneral_0/\w+ .* is not in the checkpoint")
    with pytest.raises(ValueError, match=want + "(.|\n)*saved without FP8 state(.|\n)*" + FIX):
        jax_fp8.flax.orbax_restore(ckptr, tmp_path / "plain", target)
    got = jax_fp8.flax.orbax_restore(ckptr, tmp_path / "plain", target, fresh_fp8=True)
    jax.tree.map(np.testing.assert_array_equal, got.params, plain.params)
    jax.tree.map(np.testing.assert_array_equal, got.fp8, target.fp8)


@pytest.mark.parametrize("change", ["history", "moved"])
def test_orbax_restore_nnx_names_the_state_and_keeps_params_with_fresh_fp8(tmp_path, change):
    saved_model = _NnxNet(RECIPE, ("a",), nnx.Rngs(0))
    ckptr = ocp.StandardCheckpointer()
    _save(ckptr, tmp_path / "nnx", nnx.state(saved_model))
    recipe, fp8_on = {"history": (jax_fp8.DelayedScaling(history_len=16), ("a",)),
                      "moved": (RECIPE, ("b",))}[change]
    model = _NnxNet(recipe, fp8_on, nnx.Rngs(1))
    fresh = jax.tree.map(jnp.copy, fnnx.fp8_state(model))
    want = {"history": r"the FP8 state a/dot_general/grad/value \(float8_e5m2, its "
                       r"amax_history of shape \(16,\)\): the checkpoint's has shape \(8,\)",
            "moved": r"FP8 state (a|b)/dot_general/\w+/value .* (is not in the checkpoint|"
                     r"is not in the model it is restored into)"}[change]
    with pytest.raises(ValueError, match=want + "(.|\n)*" + FIX):
        jax_fp8.flax.orbax_restore(ckptr, tmp_path / "nnx", nnx.state(model))
    state = jax_fp8.flax.orbax_restore(ckptr, tmp_path / "nnx", nnx.state(model),
                                       fresh_fp8=True)
    nnx.update(model, state)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model, nnx.Param),
                 nnx.state(saved_model, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, fnnx.fp8_state(model), fresh)
