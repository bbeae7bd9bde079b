"""What the sharding workers read from a partitioned program, and how they compare its results
with the one-device step's (the workers import it by basename, as they import helpers)."""

import collections

import jax
import numpy as np

from jax_fp8.devtools import compilation, hlo


def gathers(lowered) -> dict:
    """{dtype: [bytes of each all-gather]} of the partitioned program of `lowered`, the dtype
    that of the gathered operand."""
    out = collections.defaultdict(list)
    for c in hlo.collectives(compilation.partitioned(lowered)):
        if c.opcode == "all-gather":
            out[c.dtypes[0]].append(c.bytes)
    return dict(out)


def bits_equal(a, b) -> bool:
    """Whether the trees a and b have as many leaves, each leaf of a holding the bytes of
    b's."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb))
