"""The static layout of a packed FP8 state (`jax_fp8.packing`), and its JSON form.

A `_Layout` says where each state of the original tree lives in the packed groups (its
group, first row and lead shape), and names the groups' tree keys (what a checkpoint
records: FP8 dtype, history length, row count and a digest of the row layout, see
`group_key`). A function taking or returning packed states is serialized by
``jax.export`` with its layout as JSON: `_serialize_layout` / `_deserialize_layout`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jax_fp8 import meta as meta_lib


def path_name(path: Iterable[Any]) -> str:
    """A tree path as text: ``['Dense_0']['Fp8DotGeneral_0']['input']`` (as
    ``jax.tree_util.keystr``, spelled here so that the digests in saved keys do not
    depend on the JAX version)."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(f"[{key.key!r}]")
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(f".{key.name}")
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(f"[{key.idx}]")
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            parts.append(f"[{key.key}]")
        else:
            parts.append(str(key))
    return "".join(parts)


def _digest(value: Any) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:12]


def group_key(fp8_dtype: DTypeLike, history_len: int,
              rows: Sequence[tuple[str, tuple[int, ...]]]) -> str:
    """The tree key of a packed group: FP8 dtype, history length, row count and a digest
    of ``rows``, its states' (path text, lead shape) in row order."""
    n = sum(math.prod(lead) for _, lead in rows)
    return (f"{jnp.dtype(fp8_dtype).name}_L{int(history_len)}_{n}rows_"
            f"{_digest(tuple(rows))}")


def other_key(path: str) -> str:
    """The tree key of a leaf that is not a state, from its path text."""
    return f"other_{_digest(path)}"


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Static: where each state of the original tree lives in the packed groups."""

    treedef: Any                      # of the original tree, ScalingStates as leaves
    slots: tuple[Any, ...]            # per leaf: (group index, first row, lead shape) or None
    groups: tuple[Any, ...]           # per group: (fp8_dtype, history_len)
    paths: tuple[str, ...]            # per leaf: its path text (`path_name`)

    @functools.cached_property
    def rows(self) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]:
        """Per group: its states' (path text, lead shape), in row order."""
        out: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in self.groups]
        for slot, path in zip(self.slots, self.paths):
            if slot is not None:
                out[slot[0]].append((path, slot[2]))
        return tuple(tuple(r) for r in out)

    @functools.cached_property
    def top_keys(self) -> tuple[str, ...] | None:
        """The keys of the unpacked tree when it is a dict with string keys (a Flax
        collection), in its order; else None."""
        skeleton = jax.tree.unflatten(self.treedef, [None] * self.treedef.num_leaves)
        if type(skeleton) is not dict or not all(isinstance(k, str) for k in skeleton):
            return None
        return tuple(skeleton)

    @functools.cached_property
    def keys(self) -> tuple[str, ...]:
        """The tree keys of the groups, then of the other leaves."""
        return (tuple(group_key(d, n, r) for (d, n), r in zip(self.groups, self.rows))
                + tuple(other_key(p) for slot, p in zip(self.slots, self.paths)
                        if slot is None))


class _Leaf:
    """A leaf of the skeleton a serialized layout's tree structure is rebuilt from."""


_EXPORTABLE = ("dicts with string keys, lists, tuples, None and Fp8Metas (the nodes of a "
               "Flax FP8 collection or a list of Fp8Metas)")


def _encode_tree(treedef: jax.tree_util.PyTreeDef) -> Any:
    """The structure ``treedef`` as JSON-able data, for the node types an FP8 state's tree
    holds; other node types raise ValueError (a serialized function must rebuild them)."""
    node = treedef.node_data()
    if node is None:
        return "*"
    kind, aux = node
    children = [_encode_tree(c) for c in treedef.children()]
    if kind is type(None):
        return ["None"]
    if kind is dict and all(isinstance(k, str) for k in aux):
        return ["dict", list(aux), children]
    if kind in (list, tuple):
        return [kind.__name__, children]
    if kind is meta_lib.Fp8Meta:
        return ["Fp8Meta", json.loads(meta_lib._serialize_aux(aux)), children]
    what = (f"a dict with a {type(next(k for k in aux if not isinstance(k, str))).__name__} "
            "key" if kind is dict else f"a {kind.__module__}.{kind.__qualname__} node")
    raise ValueError(
        f"jax.export cannot serialize this packed FP8 state: its unpacked tree holds {what}, "
        f"and a serialized packed state holds only {_EXPORTABLE}. Pack a tree of those "
        "(e.g. flax.core.unfreeze(collection) before jax_fp8.pack_states, string keys), or "
        "export a function of the unpacked states (jax_fp8.unpack_states(packed), whose "
        "ScalingStates and Fp8Metas serialize).")


def _skeleton(encoded: Any) -> Any:
    """A tree of the structure `_encode_tree` encoded, with `_Leaf` leaves."""
    if encoded == "*":
        return _Leaf()
    kind = encoded[0]
    if kind == "None":
        return None
    if kind == "dict":
        return dict(zip(encoded[1], (_skeleton(c) for c in encoded[2])))
    if kind in ("list", "tuple"):
        children = [_skeleton(c) for c in encoded[1]]
        return children if kind == "list" else tuple(children)
    if kind == "Fp8Meta":
        (recipe,) = meta_lib._deserialize_aux(json.dumps(encoded[1]).encode())
        input_, kernel, grad = (_skeleton(c) for c in encoded[2])
        return meta_lib.Fp8Meta(input_, kernel, grad, recipe=recipe)
    raise ValueError(f"not a serialized jax_fp8 packed-state layout (node {kind!r})")


def _serialize_layout(layout: _Layout) -> bytes:
    tree = _encode_tree(layout.treedef)
    if jax.tree.structure(_skeleton(tree)) != layout.treedef:  # every node was understood
        raise ValueError(f"jax.export cannot serialize this packed FP8 state's tree "
                         f"{layout.treedef}: a serialized packed state holds only "
                         f"{_EXPORTABLE}")
    return json.dumps({
        "tree": tree,
        "slots": [None if s is None else [s[0], s[1], list(s[2])] for s in layout.slots],
        "groups": [[np.dtype(d).name, int(n)] for d, n in layout.groups],
        "paths": list(layout.paths)}).encode()


def _deserialize_layout(data: bytes) -> _Layout:
    fields = json.loads(data.decode())
    return _Layout(
        jax.tree.structure(_skeleton(fields["tree"])),
        tuple(None if s is None else (s[0], s[1], tuple(s[2])) for s in fields["slots"]),
        tuple((np.dtype(getattr(jnp, d)), n) for d, n in fields["groups"]),
        tuple(fields["paths"]))
