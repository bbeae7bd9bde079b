"""Installing the interception: the attributes a converting call replaces, put back after it.

`installed` replaces each ``(owner, attribute, replacement)`` for the duration of a
converting call, reference counted per attribute over threads and nested calls: all or
none (a replacement that fails to go in takes back those that went in before it, and the
error is raised). A call the conversion leaves alone goes to `through` ``(owner,
attribute)``: the function that was installed there when the replacement went in (a
wrapper another library installed after ``import jax_fp8`` included), not the one found at
import. When the last converting call ends, each attribute gets that function back; one
that another library replaced meanwhile keeps that library's function (its wrapper calls
the replacement, which passes every call on).

`conversion_key` is the part of ``jax.jit``'s cache key (and of JAX's trace context, which
keys the traces of ``lax.scan`` / ``lax.cond`` bodies, ``jax.checkpoint`` and
``shard_map``) that tells a trace made while a converting call converts the GEMMs of a
module from one made elsewhere: a function traced in one is traced anew in the other, so
no trace of a converted module's GEMMs is reused outside it (or the other way round).
Part of `jax_fp8.interception`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from jax_fp8 import _compat

__all__ = ["conversion_key", "installed", "through"]

Patch = tuple[Any, str, Any]

# Part of jit's cache key and of the trace context: None outside a converted module, else
# what decides how the running module's GEMMs convert (`jax_fp8.interception.running`).
conversion_key = _compat.jit_key_state(
    "jax_fp8_conversion",
    "Set by jax_fp8's model converters while a converted module runs: what decides how "
    "its GEMMs convert (None elsewhere).")

_lock = threading.Lock()
# (id(owner), attribute) -> [count, owner, replacement, function found at install, owned]
# ("owned": the attribute was the owner's own, not found on its class).
_installed: dict[tuple[int, str], list[Any]] = {}
# (id(owner), attribute) -> the function a call left alone goes to (the one found when the
# replacement last went in; kept after it came out, for wrappers that hold the replacement).
_through: dict[tuple[int, str], Any] = {}
# (id(owner), attribute) -> a function another library installed over the replacement
# while it was in (it calls the replacement): left in place, and not passed through to.
_over: dict[tuple[int, str], Any] = {}


def through(owner: Any, name: str) -> Any:
    """The function a call of ``owner.name`` that the conversion leaves alone goes to: the
    one installed there when the replacement went in (the current one, if it never did)."""
    found = _through.get((id(owner), name))
    return getattr(owner, name) if found is None else found


def _install(owner: Any, name: str, replacement: Any) -> None:
    key = (id(owner), name)
    entry = _installed.get(key)
    if entry is not None:
        entry[0] += 1
        return
    found = getattr(owner, name)
    own = name in getattr(owner, "__dict__", {}) or isinstance(owner, type) \
        or not hasattr(owner, "__dict__")
    if found is replacement or found is _over.get(key):
        # The replacement is in already (another library's function put it back, or
        # calls it): the function to pass calls on to stays the one recorded before.
        _installed[key] = [1, owner, replacement, None, own]
        return
    setattr(owner, name, replacement)
    _through[key] = found
    _installed[key] = [1, owner, replacement, found, own]


def _uninstall(owner: Any, name: str) -> None:
    key = (id(owner), name)
    entry = _installed[key]
    entry[0] -= 1
    if entry[0]:
        return
    del _installed[key]
    _, _, replacement, found, own = entry
    current = getattr(owner, name)
    if found is None:
        return                                  # not put in by this install
    if current is not replacement:
        _over[key] = current                    # another library's, over the replacement
        return
    if own:
        setattr(owner, name, found)
    else:   # a method of the owner's class (a primitive's bind): uncovered again
        delattr(owner, name)


@contextlib.contextmanager
def installed(patches: Sequence[Patch]) -> Iterator[None]:
    """Replaces each ``(owner, attribute, replacement)`` of ``patches`` for the duration;
    all or none: a replacement that fails to go in takes back the ones before it."""
    done: list[Patch] = []
    try:
        with _lock:
            for patch in patches:
                _install(*patch)
                done.append(patch)
        yield
    finally:
        with _lock:
            failed: BaseException | None = None
            for owner, name, _ in reversed(done):
                try:
                    _uninstall(owner, name)
                except Exception as err:  # noqa: BLE001  (put back every other one first)
                    failed = failed or err
        if failed is not None:
            raise failed


def installed_now() -> dict[tuple[Any, str], int]:
    """``{(owner, attribute): count}`` of the replacements in now (over all threads)."""
    with _lock:
        return {(entry[1], name): entry[0] for (_, name), entry in _installed.items()}
