"""A model's FP8 states packed into one stacked state per (FP8 dtype, history length).

A model with N FP8 tensors holds 3N small arrays (history, scale, scale_inv per
tensor), and a jitted train step pays JAX's host cost for each array it takes and
returns. `pack_states` gathers the states into one stacked `ScalingState` per (FP8
dtype, history length), 3 arrays per group, and `PackedStates.unpack()` hands the
per-tensor states back *inside* the step (row pieces of the packed arrays; one
`jax_fp8_split_rows` custom call per packed scale vector). The fused update runs on
the stacked groups, its fastest layout.

    fp8 = jax_fp8.pack_states(variables["fp8_meta"])       # outside jit, once
    ...                                                    # inside the step:
    out = model.apply({"params": p, "fp8_meta": fp8.unpack()}, x)
    new_fp8 = jax_fp8.new_fp8_state(fp8, fp8_grads, recipe)  # grads w.r.t. fp8 (packed)

`jax_fp8.flax.Fp8TrainState` keeps its FP8 state packed this way by default. A packed
Flax collection (a dict with string keys) is a `PackedCollection`, which is also a
read-only mapping of the unpacked collection: Flax's apply takes it as it is,
``model.apply({"params": p, "fp8_meta": state.fp8}, x)``, and pytree functions still see
the packed groups.

Checkpoints: the rows of a group are positional, so what is saved must say whose they
are. Each group's tree key names its FP8 dtype, history length, number of rows and a
digest of its row layout (the tree path and lead shape of each state, in row order):
``float8_e4m3fn_L1024_6rows_0123456789ab``. A restore that compares keys (orbax) into a
state whose FP8 layers differ (added, removed, moved, renamed, restacked, another format
or history length) finds other keys and refuses; flax.serialization
(`jax_fp8.flax.serialization`) also stores the paths and names the first state that
differs. A packed state restores only into the same layout. The layout (where each
state lives, the groups' keys, its JSON form for ``jax.export``) is
`jax_fp8._packing_layout`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export

from jax_fp8 import _compat, _fp8_grads, _hints, _trace_checks
from jax_fp8._packing_layout import _deserialize_layout, _Layout, _serialize_layout, path_name
from jax_fp8._primitives import split as split_lib
from jax_fp8.state import HoldsStates, ScalingState

if TYPE_CHECKING:
    from _collections_abc import dict_items, dict_keys, dict_values


def _is_state(x: Any) -> bool:
    return isinstance(x, ScalingState)


@dataclasses.dataclass(frozen=True)
class PackedStates(HoldsStates):
    """FP8 states packed by (FP8 dtype, history length); a registered pytree.

    Its children's tree keys (what a checkpoint records) say which states each group's
    rows are: ``float8_e4m3fn_L1024_6rows_<digest of the row layout>`` per group, and
    ``other_<digest of the path>`` per other leaf; so a restore into a state packed from
    other FP8 layers finds other keys and refuses (see the module docstring).

    Packing a dict with string keys (a Flax collection) gives a `PackedCollection`, this
    class that is also a read-only mapping of the unpacked states.

    Attributes:
      groups: tuple of stacked ScalingStates, group g of shape [R_g, L_g] (history).
      others: the original tree's leaves that are not ScalingStates, in order.
      layout: static; how to rebuild the original tree (`unpack`).
    """

    groups: tuple[Any, ...]
    others: tuple[Any, ...]
    layout: _Layout

    def __new__(cls, groups: tuple[Any, ...] = (), others: tuple[Any, ...] = (),
                layout: Any = None) -> PackedStates:
        del groups, others
        # A packed Flax collection (a dict with string keys) is also a read-only mapping
        # of its unpacked states, which Flax's apply takes: the class follows the layout,
        # so every way of making one (pack_states, unflatten, a restore) agrees.
        if cls is PackedStates and getattr(layout, "top_keys", None) is not None:
            cls = PackedCollection
        return super().__new__(cls)

    def unpack(self) -> Any:
        """The original pytree of ScalingStates (row slices of the packed groups); of
        packed FP8 gradients (`jax_fp8.AmaxGrad` groups), an AmaxGrad per state.

        Raises:
          ValueError: the groups are differentiated at a level outside a loop body
            (``lax.scan``, ``fori_loop``, ``while_loop``, ``nn.scan``) that unpacks them:
            JAX would sum the iterations' amaxes, where FP8 takes their max (the rule
            an unpacked state follows, `jax_fp8._trace_checks.claim`).
        """
        _trace_checks.check_not_closed_over_by_loop(
            jax.tree.leaves(self.groups),
            _trace_checks.CLOSED_OVER.format(what="the packed FP8 state", loop="{loop}"))
        pieces = []  # per group: its states' (history, scale, scale_inv), in row order
        for g, group in enumerate(self.groups):
            lead = [slot[2] for slot in self.layout.slots if slot and slot[0] == g]
            sizes = tuple(math.prod(shape) for shape in lead)
            if isinstance(group, _fp8_grads.AmaxGrad):   # packed FP8 gradients
                starts = np.cumsum((0,) + sizes)
                pieces.append(iter(zip(lead, [group.amax[a:b] for a, b in
                                              zip(starts[:-1], starts[1:])])))
                continue
            parts = [_split_rows(a, sizes) for a in
                     (group.amax_history, group.scale, group.scale_inv)]
            pieces.append(iter(zip(lead, *parts)))
        leaves, others = [], iter(self.others)
        for slot in self.layout.slots:
            if slot is None:
                leaves.append(next(others))
                continue
            g = slot[0]
            if isinstance(self.groups[g], _fp8_grads.AmaxGrad):
                lead, amax = next(pieces[g])
                leaves.append(_fp8_grads.AmaxGrad(amax.reshape(lead)))
                continue
            lead, h, s, si = next(pieces[g])
            leaves.append(ScalingState(h.reshape(lead + h.shape[1:]), s.reshape(lead),
                                       si.reshape(lead), fp8_dtype=self.groups[g].fp8_dtype))
        return jax.tree.unflatten(self.layout.treedef, leaves)

    @property
    def num_arrays(self) -> int:
        return len(jax.tree.leaves(self))

    def slot_info(self) -> list[tuple[Any, np.dtype, int]]:
        """(path in the unpacked tree, fp8_dtype, history_len) for each packed state."""
        n = len(self.layout.slots)
        paths = jax.tree_util.tree_flatten_with_path(
            jax.tree.unflatten(self.layout.treedef, list(range(n))))[0]
        out = []
        for path, k in paths:
            slot = self.layout.slots[k]
            if slot is not None:
                dtype, length = self.layout.groups[slot[0]]
                out.append((path, dtype, length))
        return out


def _read_only_message(op: str) -> str:
    updates = "; ".join(f"{h.framework}: {h.update}" for h in _hints.imported())
    return (f"{op}: a PackedStates is read-only (its mapping methods show the unpacked "
            f"states). Change the packed state through the FP8 update ({updates}), or "
            "unpack it into a dict of its own: dict(packed) or jax_fp8.unpack_states(packed).")


# dict, not dict[str, Any]: a subscripted base would be another class statement.
class PackedCollection(PackedStates, dict):  # type: ignore[type-arg]
    """A `PackedStates` of a Flax collection (a dict with string keys), which is also a
    read-only mapping of the unpacked collection, so Flax's ``apply`` takes it where the
    collection goes: ``model.apply({"params": params, "fp8_meta": state.fp8}, x)`` runs
    the layers on ``state.fp8.unpack()`` (the same numbers), and a gradient with respect
    to it is packed like it.

    Only the mapping methods (``keys``, ``[key]``, ``items``, ``values``, ``in``, ``len``,
    ``dict(...)``) see the unpacked states; pytree functions (jit and its donation, grad,
    optax, orbax, flax.serialization, the fused update) see the packed groups, as for any
    `PackedStates`. `pack_states` makes one whenever the packed tree is such a dict.
    Methods that would change it in place raise TypeError.
    """

    def _view(self) -> dict[str, Any]:
        """The unpacked collection, made once per trace: Flax reads it once per top-level
        module. A concrete state's is computed eagerly (it holds no tracer); a traced
        state's is kept while its own trace is the current one; anything else is made
        anew (so no traced value outlives its trace)."""
        leaves = jax.tree.leaves((self.groups, self.others))
        traces = {id(_compat.trace_of(x)) for x in leaves if isinstance(x, jax.core.Tracer)}
        cached: tuple[Any, dict[str, Any]] | None = self.__dict__.get("_view_cache")
        if not traces:
            if cached is None:
                with jax.ensure_compile_time_eval():
                    cached = self.__dict__["_view_cache"] = (None, self.unpack())
            return cached[1]
        trace = _compat.current_trace()
        if traces != {id(trace)}:
            return cast("dict[str, Any]", self.unpack())
        if cached is None or cached[0] is not trace:
            cached = self.__dict__["_view_cache"] = (trace, self.unpack())
        return cached[1]

    @property
    def _keys(self) -> tuple[str, ...]:
        keys = self.layout.top_keys
        assert keys is not None, "a PackedCollection's layout is a collection's"
        return keys

    def __getitem__(self, key: str) -> Any:
        return self._view()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __reversed__(self) -> Iterator[str]:
        return reversed(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def keys(self) -> dict_keys[Any, None]:
        return dict.fromkeys(self._keys).keys()

    def items(self) -> dict_items[Any, Any]:
        return self._view().items()

    def values(self) -> dict_values[Any, Any]:
        return self._view().values()

    def get(self, key: str, default: Any = None) -> Any:
        return self._view().get(key, default)

    def copy(self) -> dict[str, Any]:
        """The unpacked collection, as a new dict."""
        return dict(self._view())

    def __or__(self, other: Any) -> dict[Any, Any]:
        return {**self._view(), **other}

    def __ror__(self, other: Any) -> dict[Any, Any]:
        return {**other, **self._view()}

    def __eq__(self, other: object) -> bool:
        # Not dict's equality, which would compare the (empty) storage of the dict base.
        return PackedStates.__eq__(self, other) if isinstance(other, PackedStates) else False

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None

    def __reduce__(self) -> tuple[type[PackedStates],
                                  tuple[tuple[Any, ...], tuple[Any, ...], _Layout]]:
        # Pickle and copy as a PackedStates, not as the dict of its unpacked states.
        return (PackedStates, (self.groups, self.others, self.layout))

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(_read_only_message(type(self).__name__))

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _split_rows(a: jax.Array, sizes: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """a [R, ...] -> consecutive row blocks of the given sizes.

    Its gradient is ONE concatenation of the blocks' cotangents, rather than what JAX
    would build for separate slices: a zero-padded [R, ...] array per block, summed
    (O(blocks x R) work for a group of hundreds of states). The scale vectors split in
    one custom call (`_primitives/split.py`: no slice per state for XLA to fuse, launch
    or autotune); the histories, which a step does not read, as slices.
    """
    return tuple(split_lib.split_rows(a, sizes))


def _split_rows_fwd(a: jax.Array,
                    sizes: tuple[int, ...]) -> tuple[tuple[jax.Array, ...], None]:
    return _split_rows(a, sizes), None


def _split_rows_bwd(sizes: tuple[int, ...], _: None,
                    cotangents: Sequence[jax.Array]) -> tuple[jax.Array]:
    del sizes
    return (jnp.concatenate(cotangents, axis=0),)


_split_rows.defvjp(_split_rows_fwd, _split_rows_bwd)


def _flatten_with_keys(
        p: PackedStates) -> tuple[list[tuple[jax.tree_util.GetAttrKey, Any]], _Layout]:
    keys = [jax.tree_util.GetAttrKey(k) for k in p.layout.keys]
    return list(zip(keys, [*p.groups, *p.others])), p.layout


def _unflatten(layout: _Layout, children: Sequence[Any]) -> PackedStates:
    g = len(layout.groups)
    return PackedStates(tuple(children[:g]), tuple(children[g:]), layout)


for _cls in (PackedStates, PackedCollection):
    # (ignore: JAX's stub types the children Iterable; it passes a sequence, which
    # `_unflatten` slices)
    jax.tree_util.register_pytree_with_keys(
        _cls, _flatten_with_keys, _unflatten,  # type: ignore[arg-type]
        flatten_func=lambda p: ([*p.groups, *p.others], p.layout))


# A serialized function taking or returning packed states names them so (deserializing
# it needs `import jax_fp8`); the layout travels as JSON (its tree's structure, slots,
# groups and paths).
for _cls, _name in ((PackedStates, "jax_fp8.PackedStates"),
                    (PackedCollection, "jax_fp8.packing.PackedCollection")):
    jax_export.register_pytree_node_serialization(
        _cls, serialized_name=_name, serialize_auxdata=_serialize_layout,
        deserialize_auxdata=_deserialize_layout)


def pack_states(tree: Any) -> PackedStates:
    """Packs every ScalingState of ``tree`` into one stacked state per (dtype, L).

    Args:
      tree: any pytree holding ScalingStates (e.g. a Flax "fp8_meta" collection, or a
        list of Fp8Metas); states may have leading axes (stacked layers).
    Returns:
      PackedStates, whose ``unpack()`` returns a tree equal to ``tree``. Copies the
      states once (concatenation); call it outside the train step, once.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_state)
    keys: list[tuple[Any, int]] = []
    rows_of: dict[tuple[Any, int], int] = {}
    parts: dict[tuple[Any, int], list[ScalingState]] = {}
    slots: list[tuple[int, int, tuple[int, ...]] | None] = []
    others: list[Any] = []
    for _, leaf in flat:
        if not _is_state(leaf):
            slots.append(None)
            others.append(leaf)
            continue
        key = (leaf.fp8_dtype, int(leaf.amax_history.shape[-1]))
        if key not in rows_of:
            keys.append(key)
            rows_of[key] = 0
            parts[key] = []
        lead = tuple(int(d) for d in leaf.scale.shape)
        slots.append((keys.index(key), rows_of[key], lead))
        rows_of[key] += math.prod(lead)
        parts[key].append(leaf)
    groups = []
    for key in keys:
        dtype, hist_len = key
        states = parts[key]
        groups.append(ScalingState(
            jnp.concatenate([jnp.reshape(s.amax_history, (-1, hist_len)) for s in states]),
            jnp.concatenate([jnp.reshape(s.scale, (-1,)) for s in states]),
            jnp.concatenate([jnp.reshape(s.scale_inv, (-1,)) for s in states]),
            fp8_dtype=dtype))
    paths = tuple(path_name(path) for path, _ in flat)
    return PackedStates(tuple(groups), tuple(others),
                        _Layout(treedef, tuple(slots), tuple(keys), paths))


def unpack_states(tree: Any) -> Any:
    """``tree.unpack()`` for a PackedStates, any other tree unchanged.

    A `PackedCollection` is unpacked once per trace (its mapping view): two uses of one
    packed state in one differentiated function get the same states, so the second use
    is refused as for an unpacked state (`jax_fp8._trace_checks.claim`) instead of JAX adding
    the two uses' amaxes through the packed arrays."""
    if isinstance(tree, PackedCollection):
        return dict(tree._view())
    return tree.unpack() if isinstance(tree, PackedStates) else tree


__all__ = ["PackedCollection", "PackedStates", "pack_states", "unpack_states"]
