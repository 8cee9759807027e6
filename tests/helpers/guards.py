"""Guard regions and bad indices for the memory-safety tests (docs/indices.md).

A tensor under test is a view in the middle of one large random byte buffer: a kernel that writes outside the
tensor changes the guard bytes around it, one that reads outside picks up guard bytes (seen as values where the
contract says zero or -inf).
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

GUARD_BYTES = 3 * 64 * 132  # three pages of the largest page size the tests use, either side


class Guarded:
    """``view`` (``shape``, ``dtype``) inside a random byte buffer with ``GUARD_BYTES`` either side."""

    def __init__(self, shape, dtype: torch.dtype, gen: torch.Generator, device="cpu", fill: torch.Tensor | None = None):
        nbytes = math.prod(shape) * dtype.itemsize
        self.buffer = torch.randint(0, 256, (2 * GUARD_BYTES + nbytes,), dtype=torch.uint8, generator=gen).to(device)
        self.inner = slice(GUARD_BYTES, GUARD_BYTES + nbytes)
        self.view = self.buffer[self.inner].view(dtype).view(shape)
        if fill is not None:
            self.view.copy_(fill)
        self.before = self.buffer.clone()

    def assert_guards_intact(self) -> None:
        changed = (self.buffer != self.before).nonzero().flatten()
        outside = changed[(changed < self.inner.start) | (changed >= self.inner.stop)]
        assert outside.numel() == 0, (f"{outside.numel()} bytes outside the tensor changed, first at byte offsets "
                                      f"{(outside[:5] - self.inner.start).tolist()} from its start")


def bad_ids(limit: int) -> st.SearchStrategy[int]:
    """Slot or page ids around ``[-limit, limit)``, its edges and far outside (int32 range)."""
    edges = [-(2**31), -limit - 1, -limit, -1, 0, limit - 1, limit, limit + 1, 10**9, 2**31 - 1]
    return st.one_of(st.sampled_from(edges), st.integers(-2 * limit, 2 * limit))
