"""The FP8 variables of a linen layer: made, read and threaded from call to call.

A layer's FP8 state is three `ScalingState` variables (``input``, ``kernel``, ``grad``)
in its FP8 collection (`FP8_COLLECTION` by default). `_meta_variables` makes them (and
names the line to add where the collection does not reach the layer), `_read` gives a
call the meta to use and `_write` threads the meta the call returned to the next call:
into the variables when the collection is mutable, else kept on the apply's root scope
for the rest of the ``apply``. The checks here refuse, at trace time, the uses of lifted
transforms (``nn.scan``, ``nn.remat``, ``nn.vmap``, ...) under which JAX would sum the
amaxes of several calls where FP8 takes their max.
"""

from __future__ import annotations

import re
from typing import Any

import flax.linen as nn
import flax.linen.module as _flax_module
import jax

from jax_fp8 import _compat, _trace_checks, recipe as recipe_lib
from jax_fp8.meta import Fp8Meta, scales_frozen

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


def _module_stack() -> list[nn.Module]:
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


def _meta_variables(module: nn.Module, recipe: recipe_lib.Recipe, collection: str,
                    op: str | None = None, shape: tuple[int, ...] = ()
                    ) -> list[nn.Variable[Any]] | None:
    recipe_lib.check_recipe(recipe, "recipe")
    if not recipe.keeps_state:
        return None  # scales from the operands: no state
    _check_collection_reaches(module, collection, op or type(module).__name__)
    return [module.variable(collection, name, recipe.create_state, name, shape)
            for name in Fp8Meta.STATES]


# A module applied with its FP8 collection immutable cannot write the threaded meta back;
# the meta its call returned is kept for the later calls of the same apply on that apply's
# root scope (a lifted transform's body has its own), keyed by the layer's path, and used
# only while the trace it was made in is still running (values are identical: only the
# dataflow changes). Nothing is kept anywhere else, so no traced value outlives its trace.
_THREADED = "_jax_fp8_threaded"


def _live_traces() -> set[int]:
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


def _threaded(module: nn.Module) -> dict[tuple[str, Any], tuple[Any, Fp8Meta]]:
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


def _read(module: nn.Module, vs: list[nn.Variable[Any]] | None,
          recipe: recipe_lib.Recipe, collection: str, op: str) -> Fp8Meta:
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


def _write(module: nn.Module, vs: list[nn.Variable[Any]] | None, meta: Fp8Meta,
           collection: str) -> None:
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
