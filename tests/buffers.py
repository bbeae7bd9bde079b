"""Where device buffers lie: address spans, and placing arrays far apart on purpose.

The CUDA update's launch describes every buffer as an offset from the lowest one, 32-bit
while the call's buffers span at most 16 GB and 64-bit past that; these helpers let a
test (or scripts/sanitize_driver.py) reach the 64-bit case on one GPU.
"""

from __future__ import annotations

import jax
import numpy as np

__all__ = ["WIDE_SPAN_BYTES", "buffer_span", "put_far_from"]

WIDE_SPAN_BYTES = (1 << 32) * 4  # past this, the CUDA launcher needs 64-bit offsets


def buffer_span(tree) -> int:
    """Bytes between the lowest and highest device buffer address in `tree`."""
    addrs = [a.addressable_data(0).unsafe_buffer_pointer() for a in jax.tree.leaves(tree)]
    return max(addrs) - min(addrs)


def put_far_from(near, far_host, device, max_gb: int = 40):
    """Places `far_host` on `device` more than WIDE_SPAN_BYTES (16 GB) away from the
    already placed `near`, as a large model's amaxes in XLA's temporary buffer sit far
    from its FP8 state.

    The allocator reuses free space near earlier buffers, so 1 GB fillers (and each
    too-near try) are kept alive until a placement lands far enough. Returns
    ``(far, keep_alive)``; ``far`` is None when no placement within ``max_gb`` tries was
    far enough.
    """
    keep = []
    for _ in range(max_gb):
        far = jax.device_put(far_host, device)
        if buffer_span((near, far)) > WIDE_SPAN_BYTES:
            return far, keep
        keep.append(far)
        keep.append(jax.device_put(np.zeros((1 << 28,), np.float32), device))
    return None, keep
