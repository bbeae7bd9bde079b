"""Flax linen: FP8 dot_general / einsum modules and a TrainState that keeps FP8 state apart.

Usage:

    dense = nn.Dense(features, dot_general_cls=jax_fp8.flax.Fp8DotGeneral)
    variables = model.init(rng, x)           # {"params": ..., "fp8_meta": ...}
    state = Fp8TrainState.create(apply_fn=model.apply, variables=variables, tx=optax.adamw(...))

    @jax.jit
    def train_step(state, x, y):
        def loss_fn(params, fp8):
            logits = state.apply_model(params, fp8, x)
            return xent(logits, y)
        loss, grads = state.value_and_grad(loss_fn)()   # {"params": ..., "fp8_meta": ...}
        return state.apply_gradients(grads=grads), loss

    logits = state.apply_model(state.params, state.fp8, x)      # evaluation

The FP8 state lives in its own variable collection ("fp8_meta"), one ``ScalingState``
per tensor (``input``, ``kernel``, ``grad``) under each FP8 module. The optimizer only
ever sees ``params``; the FP8 collection is replaced, once per step, by the result of one
fused ``update_states`` call (`jax_fp8.new_fp8_state`).

Several uses of one module per step: each call consumes the meta the previous call
returned (written back to the variables when the collection is mutable, else kept for
the rest of the ``apply``), so the amaxes of all calls combine by max (``jax_fp8.meta``).
Under ``nn.scan`` give the collection ``variable_axes={"fp8_meta": 0}`` (a state per
layer, or per iteration of weights tied by ``variable_broadcast="params"``), or
``variable_carry="fp8_meta"`` for one module reused by every iteration (applied with the
collection mutable: Flax carries no read-only collection, and a read-only ``apply``
raises ValueError naming ``mutable=``); a layer that the
collection does not reach (a lifted transform not given it, or ``model.apply`` without it)
raises ValueError naming the line to add. A collection broadcast into a loop body
(``variable_broadcast``) is read there and never written (its threaded meta is kept for
the later calls instead): init and evaluation work, and differentiating it inside a loop
body raises ValueError at trace time (the iterations' amaxes would be summed), naming the
fix. Into an ``nn.vmap`` body (axis None) it is written like any mutable collection, so a
lifted block called twice threads from one call to the next; with the collection
read-only a lifted block (``nn.remat``, ``nn.jit``, ``nn.vmap``) called twice in one
differentiated computation raises ValueError naming the mutable apply.

A loop cannot skip the FP8 update silently: `Fp8TrainState.apply_gradients` refuses
parameter gradients alone while the state holds delayed-scaling states, and
differentiating the layers w.r.t. the parameters but not the FP8 collection raises at
trace time (`jax_fp8._trace_checks.claim`); `jax_fp8.frozen_scales` opts out of both. Under
``optax.MultiSteps`` the amaxes of the microbatches are combined by max and the FP8
state is updated once per optimizer step.

One recipe: the layers create their states from their ``recipe`` (default
``DelayedScaling()``) and `Fp8TrainState` updates them with its own; the two must agree
(``Fp8TrainState.create`` checks every state and names the first that does not).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import flax.linen.module as _flax_module
import jax
import jax.numpy as jnp
from flax import struct
from flax.training import train_state

from jax_fp8 import _compat, _fp8_grads, _trace_checks, recipe as recipe_lib, state as state_lib
from jax_fp8.dot_general import fp8_dot_general
from jax_fp8.einsum import fp8_einsum
from jax_fp8.flax import multi_steps
from jax_fp8.meta import Fp8Meta, new_fp8_state, scales_frozen
from jax_fp8.packing import PackedStates, pack_states, unpack_states
from jax_fp8.ragged_dot import fp8_ragged_dot
from jax_fp8.recipe import Recipe
from jax_fp8.recipes.delayed import DelayedScaling
from jax_fp8.state import ScalingState

FP8_COLLECTION = "fp8_meta"


_MISSING = ("{op} at {where}: {why} Flax would raise ScopeCollectionNotFound. {fix}")
_NOT_PASSED = ("the variables given to apply hold no state of this layer in the collection "
               "{c!r} (the FP8 scaling states, made by init).")
_APPLY_FIX = ("Pass it: model.apply({{'params': params, {c!r}: variables[{c!r}]}}, x), or "
              "with an Fp8TrainState, state.apply_model(state.params, state.fp8, x) (for "
              "evaluation too).")
_NOT_LIFTED = ("the collection {c!r} does not reach this layer inside `{t}`: a lifted "
               "transform passes only the collections it is given.")
_LIFT_FIX = ("Add it, e.g. nn.scan(..., variable_axes={{'params': 0, {c!r}: 0}}) (a state "
             "per layer), nn.scan(..., variable_carry={c!r}) (one module reused by every "
             "iteration) or nn.vmap(..., variable_axes={{'params': None, {c!r}: None}}).")


def _module_stack() -> list:
    """The modules whose methods are running, outermost first (Flax keeps them in
    ``flax.linen.module._context.module_stack``, which it does not make public; checked
    at import)."""
    return list(getattr(_flax_module._context, "module_stack", None) or [])


if not hasattr(getattr(_flax_module, "_context", None), "module_stack"):
    raise ImportError(  # pragma: no cover - a Flax that moved it
        "jax_fp8.flax needs flax.linen.module._context.module_stack (the modules being "
        "called) of this flax, which it no longer has; the guard on FP8 state read-only in "
        "lifted transforms depends on it. Install a flax version jax_fp8 supports, or "
        "report it.")


def _check_collection_reaches(module: nn.Module, collection: str, op: str) -> None:
    if module.has_variable(collection, Fp8Meta.STATES[0]) or \
            module.is_mutable_collection(collection):
        return
    where = module.scope.path_text if module.scope is not None else "?"
    lifted = [p.split("(")[0] for p in getattr(module.scope, "debug_path", ()) if "(" in p]
    if lifted:
        why, fix = _NOT_LIFTED.format(c=collection, t=lifted[-1]), _LIFT_FIX
    else:
        why, fix = _NOT_PASSED.format(c=collection), _APPLY_FIX
    raise ValueError(_MISSING.format(op=op, where=where, why=why,
                                     fix=fix.format(c=collection)))


def _meta_variables(module: nn.Module, recipe, collection, op: str | None = None,
                    shape: tuple = ()):
    recipe_lib.check_recipe(recipe, "recipe")
    if not recipe.keeps_state:
        return None  # scales from the operands: no state
    _check_collection_reaches(module, collection, op or type(module).__name__)
    dtypes = recipe.state_dtypes()
    return [module.variable(collection, name, ScalingState.create, shape, recipe.history_len,
                            dtypes[name]) for name in Fp8Meta.STATES]


# A module applied with its FP8 collection immutable cannot write the threaded meta back;
# the meta its call returned is kept for the later calls of the same apply on that apply's
# root scope (a lifted transform's body has its own), keyed by the layer's path, and used
# only while the trace it was made in is still running (values are identical: only the
# dataflow changes). Nothing is kept anywhere else, so no traced value outlives its trace.
_THREADED = "_jax_fp8_threaded"


def _live_traces() -> set:
    """ids of the current trace and of every trace it is nested in."""
    ids, trace = set(), _compat.current_trace()
    while trace is not None:
        ids.add(id(trace))
        trace = _compat.parent_trace(trace)
    return ids


def _usable(meta: Fp8Meta) -> bool:
    """Whether every traced leaf of ``meta`` belongs to a trace that is still running
    around the current one (a value of a finished trace must never be used again)."""
    tracers = [x for x in jax.tree.leaves(meta) if isinstance(x, jax.core.Tracer)]
    if not tracers:
        return True
    live = _live_traces()
    return all(id(_compat.trace_of(t)) in live for t in tracers)


def _scope(module: nn.Module) -> Any:
    scope = module.scope
    assert scope is not None, "a module being called is bound"
    return scope


def _threaded(module: nn.Module) -> dict:
    root = _scope(module).root
    store = getattr(root, _THREADED, None)
    if store is None:
        store = {}
        setattr(root, _THREADED, store)
    return store


def _from_outside(meta: Fp8Meta) -> bool:
    """Whether the layer's FP8 variables come from outside the trace it runs in: a
    collection a lifted transform broadcasts (nn.scan's ``variable_broadcast``, nn.vmap's
    axis None) is closed over by the transform's body, never one of the body's own values
    (values it carries or scans over are)."""
    trace = _compat.current_trace()
    for x in jax.tree.leaves(meta):
        own = _compat.trace_of(x)
        if own is not trace and not (own is None and _compat.parent_trace(trace) is None):
            return True
    return False


def _broadcast_into_vmap(meta: Fp8Meta) -> bool:
    """Whether the layer runs in the body of a ``vmap`` (nn.vmap with the collection's axis
    None) on FP8 variables that come straight from the trace around it: the threaded meta
    is unbatched (its values are those read), so the body may write it and the lifted
    transform hands it to the next call, as it does outside any transform."""
    trace = _compat.current_trace()
    if not _compat.is_batch_trace(trace):
        return False
    around = _compat.parent_trace(trace)
    return all(_compat.trace_of(x) is around
               or (_compat.trace_of(x) is None and _compat.parent_trace(around) is None)
               for x in jax.tree.leaves(meta))


def _writable(module: nn.Module, meta: Fp8Meta, collection: str) -> bool:
    """Whether the threaded meta is written to the layer's variables (else kept for the
    later calls of this apply): the collection is mutable and its values are the body's
    own, or come into an nn.vmap body unbatched."""
    return module.is_mutable_collection(collection) and (
        not _from_outside(meta) or _broadcast_into_vmap(meta))


# Read-only FP8 variables read afresh by a layer inside a lifted transform's body, per
# apply (on the apply's root scope): {(collection, layer path): [the trace the transform
# was called in, one per call]}. A lifted body is traced anew per call, so a meta it
# threads cannot reach the next call unless the collection is mutable.
_LIFTED_READS = "_jax_fp8_lifted_reads"

_LIFTED_TWICE = (
    "{op} at {where}: this layer's FP8 state (the collection {c!r}) is read-only in this "
    "apply and the block holding it, under the lifted transform `{t}`, is called a second "
    "time in one differentiated computation. A lifted transform passes out only mutable "
    "collections, so the state the first call threaded cannot reach the second and JAX "
    "would add up the two calls' amaxes, where FP8 takes their max. Apply the model with "
    "the collection mutable: `out, _ = model.apply(variables, x, mutable=[{c!r}])`, or "
    "with an Fp8TrainState `state.apply_model(state.params, state.fp8, x)`, which "
    "threads the state through every call (the max over the calls).")


def _apply_root(module: nn.Module) -> Any:
    """The root scope of the ``apply`` (or ``init``) running the layer: a lifted
    transform's body has a root of its own (its debug path names the transform), the
    apply's is the innermost root without one among the modules being called."""
    for m in reversed(_module_stack()):
        scope = getattr(m, "scope", None)
        if scope is not None and not scope.root.debug_path:
            return scope.root
    return _scope(module).root


def _check_lifted_read_once(module: nn.Module, meta: Fp8Meta, collection: str,
                            op: str) -> None:
    """Raises ValueError when a read-only FP8 state is read afresh by a second call of a
    lifted block (nn.remat, nn.jit, nn.vmap, ...) in one differentiated computation."""
    lifted = [p.split("(")[0] for p in _scope(module).debug_path if "(" in p]
    if not lifted or scales_frozen():
        return
    chain, trace = [], _compat.current_trace()
    while trace is not None:
        chain.append(trace)
        trace = _compat.parent_trace(trace)
    if not any(_compat.is_differentiation_trace(t) for t in chain):
        return
    leaf = jax.tree.leaves(meta)[0]
    own = _compat.trace_of(leaf)
    if own is None:
        return  # a constant: not differentiated
    # The trace the transform was called in: the one around a staging transform's
    # (nn.remat, nn.jit) body, which takes the variables as its arguments, else the one
    # the variables live in (nn.vmap's axis None passes them as they are).
    trace = _compat.current_trace()
    while trace is not None:
        if _compat.traced_for(trace) in _trace_checks.BRANCHES:
            return  # the branches of one nn.cond / nn.switch: only one runs
        if trace is own:
            break
        trace = _compat.parent_trace(trace)
    called_in = _compat.parent_trace(own) if _compat.staged_argument(leaf) else own
    root = _apply_root(module)
    store = getattr(root, _LIFTED_READS, None)
    if store is None:
        store = {}
        setattr(root, _LIFTED_READS, store)
    seen = store.setdefault((collection, _scope(module).path), [])
    if any(t is called_in for t in seen):
        raise ValueError(_LIFTED_TWICE.format(op=op, where=_scope(module).path_text,
                                              c=collection, t=lifted[-1]))
    seen.append(called_in)


_BROADCAST = (
    "{op} at {where}: its FP8 state (the collection {c!r}) is differentiated but broadcast "
    "into a `{loop}` body (nn.scan's variable_broadcast): every iteration would use the one "
    "state and JAX would add up the iterations' amaxes, where FP8 takes their max. For "
    "weights tied across the iterations broadcast only the parameters and give the FP8 "
    "state a place of its own: nn.scan(..., variable_broadcast='params', variable_axes="
    "{{{c!r}: 0}}) (a state per iteration, the one that needs nothing else), or "
    "nn.scan(..., variable_broadcast='params', variable_carry={c!r}) (one state for every "
    "iteration, its amaxes the max over them; a carried collection must exist before the "
    "scan, so at init call the body once outside it). Init and evaluation may broadcast it.")


def _check_not_broadcast(module: nn.Module, meta: Fp8Meta, collection: str, op: str) -> None:
    """Raises ValueError when differentiated FP8 variables are closed over by a loop body
    (a broadcast collection): the amaxes of the iterations would be summed."""
    for x in jax.tree.leaves(meta):
        own = _compat.trace_of(x)
        if own is None or not _compat.is_differentiation_trace(own):
            continue
        trace = _compat.current_trace()
        while trace is not None and trace is not own:
            loop = _compat.traced_for(trace)
            if loop in _trace_checks.LOOPS:
                where = _scope(module).path_text
                if not any("(" in p for p in getattr(module.scope, "debug_path", ())):
                    # No lifted transform: a jax loop inside the loss closes over it.
                    raise ValueError(f"{op} at {where}: " + _trace_checks.CLOSED_OVER.format(
                        what=f"its FP8 state (the collection {collection!r})", loop=loop))
                raise ValueError(_BROADCAST.format(op=op, where=where, c=collection,
                                                   loop=loop))
            trace = _compat.parent_trace(trace)


_CARRIED_READ_ONLY = (
    "{op} at {where}: its FP8 state (the collection {c!r}) is carried from iteration to "
    "iteration by `nn.scan` (variable_carry={c!r}), and this apply holds the collection "
    "read-only; Flax's scan leaves a read-only collection out of the carry its body "
    "returns (JAX would raise that the body's carry input and output differ). "
    "Apply the model with the collection mutable: `out, _ = model.apply(variables, x, "
    "mutable=[{c!r}])` (evaluation and training alike: the same outputs, and under "
    "differentiation the amaxes the max over the iterations), or with an Fp8TrainState "
    "`state.apply_model(state.params, state.fp8, x)`; or give the FP8 state a row per "
    "iteration instead: nn.scan(..., variable_axes={{{c!r}: 0}}).")


def _check_not_carried_read_only(module: nn.Module, meta: Fp8Meta, collection: str,
                                 op: str) -> None:
    """Raises ValueError when a read-only FP8 collection is carried by a lifted nn.scan
    (its leaves are the scan body's carry, ``c[0]``, the carried variable groups):
    Flax leaves an immutable collection out of the carry the body returns."""
    if not any(p.startswith("scan(") for p in _scope(module).debug_path):
        return
    carried = re.compile(r"c\[0\]\[\d+\]\[" + re.escape(repr(collection)) + r"\]")
    for x in jax.tree.leaves(meta):
        name = _compat.staged_argument(x)
        if (name is not None and carried.match(name)
                and _compat.traced_for(_compat.trace_of(x)) == "scan"):
            raise ValueError(_CARRIED_READ_ONLY.format(
                op=op, where=_scope(module).path_text, c=collection))


def _read(module: nn.Module, vs, recipe, collection, op: str) -> Fp8Meta:
    if vs is None:
        return Fp8Meta(recipe=recipe)
    meta = Fp8Meta(*(v.value for v in vs))
    _check_not_broadcast(module, meta, collection, op)
    if not module.is_mutable_collection(collection):
        _check_not_carried_read_only(module, meta, collection, op)
    if _writable(module, meta, collection):
        return meta
    entry = _threaded(module).get((collection, _scope(module).path))
    if (entry is not None and meta.input is not None and entry[0] is meta.input.amax_history
            and _usable(entry[1])):
        return entry[1]
    if not module.is_mutable_collection(collection):
        _check_lifted_read_once(module, meta, collection, op)
    return meta


def _write(module: nn.Module, vs, meta: Fp8Meta, collection):
    # Thread the meta: the next call of this module consumes what this one returned, so
    # the amaxes of all calls combine by max.
    if vs is None:
        return
    if module.is_mutable_collection(collection) and module.is_initializing():
        # The values are those just created: writing the returned meta would only add a
        # dependence on the data (which nn.scan refuses for a broadcast collection), and
        # init is never differentiated.
        return
    read = Fp8Meta(*(v.value for v in vs))
    if _writable(module, read, collection):
        for v, name in zip(vs, Fp8Meta.STATES):
            v.value = getattr(meta, name)
        return
    # Immutable, or closed over by a loop body (nn.scan's broadcast collection, whose
    # value must not depend on the body's data): keep the threaded meta for the
    # later calls of this apply instead of writing it (its values are those read).
    _threaded(module)[(collection, _scope(module).path)] = (vs[0].value.amax_history, meta)


class Fp8DotGeneral(nn.Module):
    """Drop-in ``dot_general_cls`` for ``nn.Dense`` / ``nn.DenseGeneral``: FP8 GEMMs.

    Attributes:
      recipe: DelayedScaling (the default: the states, history length and FP8 format,
        live in ``collection``) or any recipe without state (Float8CurrentScaling,
        Float8BlockScaling, MXFP8BlockScaling).
      collection: the variable collection holding the FP8 state.
      min_fp8_flops: GEMMs with fewer FLOPs (2 * batch * M * N * K) run in the operands'
        dtype, not FP8 (`jax_fp8.fp8_dot_general`); 0 (the default): every GEMM is FP8.

    Example:

        dg = functools.partial(Fp8DotGeneral, recipe=jax_fp8.Float8BlockScaling())
        nn.Dense(1024, dot_general_cls=dg)
    """

    recipe: Recipe = DelayedScaling()
    collection: str = FP8_COLLECTION
    min_fp8_flops: float = 0

    @nn.compact
    def __call__(self, lhs: jax.Array | None = None, rhs: Any = None,
                 dimension_numbers: Any = None, precision: Any = None,
                 preferred_element_type: Any = None, **kwargs: Any) -> jax.Array:
        del kwargs  # e.g. out_sharding
        if lhs is None:  # nn.Dense calls dot_general_cls() to make the dot_general
            raise TypeError(
                "Fp8DotGeneral was given as an instance where a class is taken: use "
                "nn.Dense(..., dot_general_cls=Fp8DotGeneral) or dot_general_cls="
                "functools.partial(Fp8DotGeneral, recipe=...); an instance goes in "
                "nn.Dense(..., dot_general=Fp8DotGeneral(...))")
        vs = _meta_variables(self, self.recipe, self.collection)
        used = _read(self, vs, self.recipe, self.collection, "Fp8DotGeneral")
        out, meta = fp8_dot_general(lhs, rhs, dimension_numbers, used, precision,
                                    preferred_element_type, min_fp8_flops=self.min_fp8_flops)
        _write(self, vs, meta, self.collection)
        return out


class Fp8Einsum(nn.Module):
    """Two-operand FP8 einsum: ``Fp8Einsum()("bsd,dh->bsh", x, kernel)``; rhs is the kernel.
    Attributes as `Fp8DotGeneral`'s."""

    recipe: Recipe = DelayedScaling()
    collection: str = FP8_COLLECTION
    min_fp8_flops: float = 0

    @nn.compact
    def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array, precision: Any = None,
                 preferred_element_type: Any = None) -> jax.Array:
        del precision
        vs = _meta_variables(self, self.recipe, self.collection)
        used = _read(self, vs, self.recipe, self.collection, "Fp8Einsum")
        out, meta = fp8_einsum(eqn, lhs, rhs, used,
                               preferred_element_type=preferred_element_type,
                               min_fp8_flops=self.min_fp8_flops)
        _write(self, vs, meta, self.collection)
        return out


class _WeightFp8(nn.Module):
    """The FP8 state of one weight of a module, for every GEMM that multiplies it.

    What `jax_fp8.flax.fp8_model` creates, named ``<weight>_fp8``, for a converted
    module's own ``dot_general`` / ``einsum`` calls with a parameter ``<weight>`` as an
    operand: its variables are those of an `Fp8DotGeneral` / `Fp8Einsum` of that name
    (``input``, ``kernel``, ``grad``), whichever of the two GEMMs a call is; the weight is
    the rhs (the kernel). Calls: ``("dot_general", (lhs, rhs, dimension_numbers),
    precision, preferred_element_type)``, ``("einsum", (eqn, lhs, rhs), ...)`` or
    ``("ragged_dot", (lhs, rhs, group_sizes), ...)``: a mixture-of-experts layer's grouped
    GEMM (`jax_fp8.fp8_ragged_dot`) of an expert weight rhs [G, K, N], whose states are one
    per expert (leading axis G). Attributes as `Fp8DotGeneral`'s.
    """

    recipe: Recipe = DelayedScaling()
    collection: str = FP8_COLLECTION
    min_fp8_flops: float = 0

    @nn.compact
    def __call__(self, kind: str, args: tuple[Any, Any, Any], precision=None,
                 preferred_element_type=None):
        op = {"dot_general": "Fp8DotGeneral", "einsum": "Fp8Einsum"}.get(kind, "fp8_ragged_dot")
        shape = (args[1].shape[0],) if kind == "ragged_dot" else ()
        vs = _meta_variables(self, self.recipe, self.collection, op, shape)
        used = _read(self, vs, self.recipe, self.collection, op)
        if kind == "ragged_dot":
            out, meta = fp8_ragged_dot(*args, used, precision=precision,
                                       preferred_element_type=preferred_element_type,
                                       min_fp8_flops=self.min_fp8_flops)
        elif kind == "dot_general":
            out, meta = fp8_dot_general(*args, used, precision, preferred_element_type,
                                        min_fp8_flops=self.min_fp8_flops)
        else:
            out, meta = fp8_einsum(*args, used, preferred_element_type=preferred_element_type,
                                   min_fp8_flops=self.min_fp8_flops)
        _write(self, vs, meta, self.collection)
        return out


def split_fp8(variables: Mapping[str, Any], collection: str = FP8_COLLECTION,
              ) -> tuple[dict[str, Any], Any]:
    """``{"params": p, "fp8_meta": f, ...}`` -> (everything but the FP8 collection, f)."""
    variables = dict(variables)
    fp8 = variables.pop(collection, {})
    return variables, fp8


def _is_combined(grads, params, collection) -> bool:
    """True for the gradient of `fp8_value_and_grad`: {"params": ..., collection: ...}:
    its parameter part of the structure of ``params``, or its FP8 part FP8 gradients
    (`jax_fp8.AmaxGrad`s; the parameter part then is what the optimizer takes, e.g. the
    gradient of ``optax.LookaheadParams``' fast parameters)."""
    if not (isinstance(grads, Mapping) and set(grads) == {"params", collection}):
        return False
    is_grad = lambda x: isinstance(x, _fp8_grads.AmaxGrad)  # noqa: E731
    return (jax.tree.structure(grads["params"]) == jax.tree.structure(params)  # type: ignore[operator]
            or any(is_grad(x) for x in jax.tree.leaves(grads[collection], is_leaf=is_grad)))


class Fp8TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` plus the FP8 state, outside the optimizer.

    ``params`` and ``opt_state`` are exactly those of a plain TrainState (the FP8
    collection never reaches optax: no Adam moments, clipping or weight decay for it).
    ``fp8`` holds the FP8 collection; `apply_gradients` replaces it with one fused
    ``update_states`` call driven by the FP8 gradients. Under ``optax.MultiSteps``,
    ``fp8_pending`` holds the max of the amaxes seen since the last optimizer step (a
    list of float32 arrays, one per state of ``fp8`` in tree order); else None.
    """

    fp8: Any = None
    # {FP8 dtype name: number of states}: in the tree (and so in every checkpoint), so a
    # restore into a state of another FP8 format fails on the keys instead of relabelling.
    fp8_formats: Any = None
    fp8_pending: Any = None
    recipe: Recipe = struct.field(
        pytree_node=False, default=DelayedScaling())
    fp8_collection: str = struct.field(pytree_node=False, default=FP8_COLLECTION)

    @classmethod
    def create(cls, *, apply_fn: Callable[..., Any], tx: Any, variables: Any = None,
               params: Any = None, fp8: Any = None, recipe: recipe_lib.Recipe | None = None,
               fp8_collection: str = FP8_COLLECTION, pack_fp8: bool = True,
               **kwargs: Any) -> Fp8TrainState:
        """From ``variables`` (as returned by ``model.init``), or ``params`` and ``fp8``.

        Args:
          apply_fn: the model's ``apply``.
          tx: the optax transformation of the parameters (it never sees the FP8 state).
          variables: ``model.init``'s result: ``"params"`` and the FP8 collection only,
            else ValueError (pass ``params=`` and ``fp8=`` and keep other collections
            yourself).
          params: the parameters, in place of ``variables``.
          fp8: the FP8 collection, with ``params`` (default: none).
          recipe: the recipe the FP8 states were made by (default ``DelayedScaling()``):
            every FP8 state must follow it (history length and FP8 dtypes; the layers'
            ``recipe`` attribute), else ValueError. A current or blockwise recipe keeps
            no state: the FP8 collection must then be empty.
          fp8_collection: the name of the FP8 collection (the layers' ``collection``).
          pack_fp8: keep the FP8 collection packed into one stacked state per (FP8
            dtype, history length) (`jax_fp8.pack_states`, the default): the step then
            takes 3 arrays per group instead of 3 per FP8 tensor, which cuts JAX's
            per-argument host cost, the fused update runs on stacked states, and a
            checkpoint records each group's FP8 dtype. The layers still see their own
            states. False keeps the collection as the model made it.
          **kwargs: other fields of Flax's ``TrainState``.

        With ``tx`` an ``optax.MultiSteps`` (alone or inside a chain), the FP8 state is
        updated once per optimizer step from the max of its microbatches' amaxes.
        """
        if variables is not None:
            if params is not None or fp8 is not None:
                raise ValueError("pass either variables, or params (and fp8), not both")
            rest, fp8 = split_fp8(variables, fp8_collection)
            if set(rest) != {"params"}:
                raise ValueError(f"variables has collections {sorted(rest)}; expected only "
                                 f"'params' and {fp8_collection!r}. Pass params= and fp8= "
                                 "and keep the other collections yourself")
            params = rest["params"]
        recipe = recipe_lib.default() if recipe is None else recipe
        recipe_lib.check_recipe(recipe, "recipe")
        fp8 = {} if fp8 is None else fp8
        state_lib.check_states_follow(recipe, fp8, "fp8")
        counts: dict = {}
        for _, dtype, _ in state_lib.states_info(fp8):
            counts[dtype.name] = counts.get(dtype.name, 0) + 1
        formats = {name: jnp.int32(n) for name, n in sorted(counts.items())}
        if pack_fp8 and not isinstance(fp8, PackedStates):
            fp8 = pack_states(fp8)
        new = super().create(apply_fn=apply_fn, params=params, tx=tx, fp8=fp8,
                             fp8_formats=formats, recipe=recipe,
                             fp8_collection=fp8_collection, **kwargs)
        if counts:
            new = new.replace(fp8_pending=multi_steps.zero_pending(fp8, new.opt_state,
                                                                   "Fp8TrainState"))
        return new

    def variables(self, params: Any = None, fp8: Any = None) -> dict:
        """The model's variables; a packed FP8 state is handed to the layers unpacked."""
        fp8 = self.fp8 if fp8 is None else fp8
        return {"params": self.params if params is None else params,
                self.fp8_collection: unpack_states(fp8)}

    def apply_model(self, params: Any, fp8: Any, *args: Any,
                    mutable: str | Sequence[str] = (), **kwargs: Any) -> Any:
        """``apply_fn`` with the FP8 collection mutable (so reused modules thread their state).

        For training (inside the loss) and evaluation alike:
        ``state.apply_model(state.params, state.fp8, x)``. Returns the output; with extra
        ``mutable`` collections, (output, their updates).
        """
        extra = [mutable] if isinstance(mutable, str) else list(mutable)
        out, updates = self.apply_fn(self.variables(params, fp8), *args,
                                     mutable=[self.fp8_collection, *extra], **kwargs)
        if extra:
            updates = dict(updates)
            updates.pop(self.fp8_collection, None)
            return out, updates
        return out

    def value_and_grad(self, loss_fn: Callable, has_aux: bool = False,
                       ) -> Callable[..., tuple[Any, dict]]:
        """``loss_fn(params, fp8, *args)`` -> f(*args) = ``(loss[, aux]), grads``.

        The gradient is w.r.t. ``self.params`` and ``self.fp8``: ``grads`` is
        ``{"params": ..., fp8_collection: ...}``, what `apply_gradients` takes as
        ``grads=``. Inside ``loss_fn`` apply the model with
        ``self.apply_model(params, fp8, ...)``.
        """
        vg = fp8_value_and_grad(loss_fn, has_aux, collection=self.fp8_collection)
        return functools.partial(vg, self.params, self.fp8)

    def apply_gradients(self, *, grads: Any, fp8_grads: Any = None,
                        axis_name: Any = None, **kwargs: Any) -> Fp8TrainState:
        """The optimizer step on ``params``, and the FP8 state from ONE ``update_states``.

        Args:
          grads: ``{"params": ..., fp8_collection: ...}`` as `value_and_grad` returns
            them, or the gradient w.r.t. ``params`` alone with ``fp8_grads``.
          fp8_grads: the gradient w.r.t. ``fp8`` (same structure as ``self.fp8``).
          axis_name: inside ``jax.pmap`` (or ``shard_map``), the mapped axis (or axes)
            whose devices' amaxes the update max-reduces first (one ``pmax``), so every
            replica of the FP8 state gets the same update. Required under ``pmap``.

        Raises:
          ValueError: the state holds delayed-scaling states and no FP8 gradient was
            given (their scales would never change), unless inside
            `jax_fp8.frozen_scales`, where the FP8 state is kept as it is; or traced
            inside ``jax.pmap`` without ``axis_name``.

        Under ``optax.MultiSteps`` the FP8 gradients' amaxes are combined by max into
        ``fp8_pending`` and the FP8 state is updated only when the optimizer applies.
        """
        if _is_combined(grads, self.params, self.fp8_collection):
            if fp8_grads is not None:
                raise ValueError("Fp8TrainState.apply_gradients: grads already holds the FP8 "
                                 "gradients (as value_and_grad returns them); pass it "
                                 "alone, without fp8_grads")
            grads, fp8_grads = grads["params"], grads[self.fp8_collection]
        new = super().apply_gradients(grads=grads, **kwargs)
        if not state_lib.states_info(self.fp8):
            return new  # no delayed-scaling state: nothing to update
        if fp8_grads is None:
            if scales_frozen():
                return new
            raise ValueError(
                f"Fp8TrainState.apply_gradients: no FP8 gradients, but the state holds "
                f"{len(state_lib.states_info(self.fp8))} delayed-scaling states, whose "
                f"scales would never change. Pass grads={{'params': ..., "
                f"{self.fp8_collection!r}: ...}} as `loss, grads = state.value_and_grad("
                f"loss_fn)(...)` returns them, or fp8_grads= (the gradient w.r.t. "
                f"state.fp8: jax.value_and_grad(loss_fn, argnums=(0, 1))(state.params, "
                f"state.fp8)). To keep the scales frozen on purpose, call it inside "
                f"`with jax_fp8.frozen_scales():`.")
        _trace_checks.check_amaxes_reduced(axis_name, "Fp8TrainState.apply_gradients")
        if self.fp8_pending is None:
            return new.replace(fp8=new_fp8_state(self.fp8, fp8_grads, self.recipe,
                                                 axis_name=axis_name))
        state_lib.check_states_follow(self.recipe, self.fp8, "fp8")
        if scales_frozen():
            return new  # the FP8 state and its pending amaxes stay as they are
        applied = (multi_steps.gradient_step(new.opt_state, "Fp8TrainState")
                   != multi_steps.gradient_step(self.opt_state, "Fp8TrainState"))
        fp8, pending = multi_steps.accumulate(self.fp8, fp8_grads, self.fp8_pending, applied,
                                              self.recipe, axis_name)
        return new.replace(fp8=fp8, fp8_pending=pending)


def fp8_value_and_grad(loss_fn: Callable, has_aux: bool = False,
                       collection: str = FP8_COLLECTION) -> Callable[..., tuple[Any, dict]]:
    """``loss_fn(params, fp8, *args)`` -> f(params, fp8, *args) = ``(loss[, aux]), grads``.

    ``grads`` is ``{"params": <gradient w.r.t. params>, collection: <FP8 gradients>}``,
    what `Fp8TrainState.apply_gradients` takes as ``grads=`` (`Fp8TrainState.value_and_grad`
    binds ``params`` and ``fp8`` to the state's). The FP8 gradients are `jax_fp8.AmaxGrad`s
    (the structure of ``fp8``): they refuse arithmetic, so a transform written over all of
    ``grads`` (a loss scale, a clip, a sum) raises at trace time instead of changing the
    amaxes; apply such transforms to ``grads["params"]``. NNX's
    `jax_fp8.flax.nnx.fp8_value_and_grad` returns the same ``(loss[, aux]), grads``.
    """
    vg = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=has_aux)

    def f(params, fp8, *args, **kwargs):
        value, (grads, fp8_grads) = vg(params, fp8, *args, **kwargs)
        return value, {"params": grads,
                       collection: _fp8_grads.fp8_grads_from_cotangents(fp8_grads)}

    return f
