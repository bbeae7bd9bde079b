"""Checkpoints of Equinox models with FP8 states that refuse a changed model.

``eqx.tree_serialise_leaves`` writes the leaves' arrays in order, nothing of the tree: a
model whose FP8 states have another history length fails on a shape, but one whose
gradient state changed format (HYBRID's E5M2 to E4M3) would take the other format's scales
without a word. `tree_serialise_leaves` here writes a header first, every array leaf's path
(an FP8 state's path names its format, ``amax_history_float8_e5m2``), shape and dtype;
`tree_deserialise_leaves` compares it with the model it loads into and refuses a
difference, naming the variable, before reading any array. The arrays themselves are
``eqx.tree_serialise_leaves``'s.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from collections.abc import Iterator, Sequence
from typing import IO, Any, BinaryIO

import equinox as eqx
import jax
import numpy as np

__all__ = ["orbax_restore", "tree_deserialise_leaves", "tree_serialise_leaves"]

_MAGIC = b"jax_fp8.equinox checkpoint 1\n"


def _layout(tree: Any) -> list[list[Any]]:
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))[0]
    return [[jax.tree_util.keystr(p), list(np.shape(x)), np.dtype(x.dtype).name]
            for p, x in leaves]


@contextlib.contextmanager
def _opened(path_or_file: str | pathlib.Path | BinaryIO, mode: str) -> Iterator[IO[Any]]:
    if isinstance(path_or_file, (str, pathlib.Path)):
        with open(path_or_file, mode) as f:
            yield f
    else:
        yield path_or_file


def tree_serialise_leaves(path_or_file: str | pathlib.Path | BinaryIO, model: Any) -> None:
    """``eqx.tree_serialise_leaves(path_or_file, model)`` after a header of the model's
    array leaves (path, shape, dtype), which `tree_deserialise_leaves` checks."""
    header = json.dumps(_layout(model)).encode()
    with _opened(path_or_file, "wb") as f:
        f.write(_MAGIC)
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        eqx.tree_serialise_leaves(f, model)


def tree_deserialise_leaves(path_or_file: str | pathlib.Path | BinaryIO, like: Any) -> Any:
    """The model written by `tree_serialise_leaves`, loaded into the structure of ``like``
    (as ``eqx.tree_deserialise_leaves``).

    Raises:
      ValueError: the checkpoint's array leaves differ from ``like``'s (a variable added,
        removed or renamed, another shape or dtype, an FP8 state of another format or
        history length), naming the first such variable; or the file is not such a
        checkpoint.
    """
    with _opened(path_or_file, "rb") as f:
        if f.read(len(_MAGIC)) != _MAGIC:
            raise ValueError("not a jax_fp8.equinox checkpoint (written by jax_fp8.equinox."
                             "tree_serialise_leaves); a plain eqx.tree_serialise_leaves file "
                             "loads with eqx.tree_deserialise_leaves")
        size = int.from_bytes(f.read(8), "little")
        saved = json.loads(f.read(size).decode())
        want = _layout(like)
        _compare({p: (s, d) for p, s, d in saved}, {p: (s, d) for p, s, d in want})
        if [p for p, _, _ in saved] != [p for p, _, _ in want]:
            raise ValueError("checkpoint variables are in another order than the model's: the "
                             "model's structure changed since it was saved")
        return eqx.tree_deserialise_leaves(f, like)


def _compare(saved_by_path: dict[str, tuple[Any, Any]],
             want_by_path: dict[str, tuple[Any, Any]]) -> None:
    for p, (shape, dtype) in want_by_path.items():
        if p not in saved_by_path:
            raise ValueError(f"checkpoint has no variable {p} (shape {tuple(shape)}, "
                             f"{dtype}) of the model it is loaded into: the model changed "
                             f"since it was saved (another layer, FP8 format or recipe)")
        if saved_by_path[p] != (shape, dtype):
            s, d = saved_by_path[p]
            raise ValueError(f"checkpoint variable {p} has shape {tuple(s)}, {d}; the "
                             f"model it is loaded into has shape {tuple(shape)}, {dtype} "
                             f"(another FP8 history length or layer size)")
    for p, (shape, dtype) in saved_by_path.items():
        if p not in want_by_path:
            raise ValueError(f"checkpoint variable {p} (shape {tuple(shape)}, {dtype}) is "
                             f"not in the model it is loaded into: the model changed since "
                             f"it was saved (another layer, FP8 format or recipe)")


def _dotted(path: Sequence[Any]) -> str:
    return ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))))
                    for k in path)


def orbax_restore(checkpointer: Any, directory: Any, like: Any) -> Any:
    """The model saved by ``checkpointer.save(directory, eqx.filter(model,
    eqx.is_array))`` (an orbax ``StandardCheckpointer``), restored into the structure of
    ``like``.

    Orbax refuses a checkpoint whose variables have other names (an FP8 state of another
    format: its arrays' names say the format) and one of another shape, but names no
    variable for the latter; here both are refused before anything is read, naming it.

    Raises:
      ValueError: the checkpoint's arrays differ from ``like``'s (as
        `tree_deserialise_leaves`).
    """
    metadata = checkpointer.metadata(directory)
    tree = getattr(metadata, "item_metadata", metadata)
    saved = {_dotted(p): (list(m.shape), np.dtype(m.dtype).name)
             for p, m in jax.tree_util.tree_flatten_with_path(tree)[0]}
    dynamic, static = eqx.partition(like, eqx.is_array)
    want = {_dotted(p): (list(np.shape(x)), np.dtype(x.dtype).name)
            for p, x in jax.tree_util.tree_flatten_with_path(dynamic)[0]}
    _compare(saved, want)
    return eqx.combine(checkpointer.restore(directory, dynamic), static)
