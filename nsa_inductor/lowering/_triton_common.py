"""``@triton.jit`` helpers the ops' Triton kernels share (imported only on the GPU path and by tests).

The cache is passed to the kernels twice: viewed as fp8 for the values and as fp32 for the scales, so byte offsets
of DESIGN §3 become element offsets (a scale's byte offset is always a multiple of 4). A token is 128 fp8 values
and a 4-byte scale: 132 bytes, 33 fp32 words; these sizes are literals in the kernels. Every launcher writes every
element of its outputs and never reads a device value on the host, so all of them are CUDA-graph safe.
"""

from __future__ import annotations

import triton
import triton.language as tl


def interpreted(kernel) -> bool:
    """True under TRITON_INTERPRET=1, where kernels run in numpy on the host."""
    return not isinstance(kernel, triton.runtime.JITFunction)


@triton.jit
def readable_page(page, ok, num_pages):
    """A block-table entry as a page to read, and where it may be read (docs/indices.md): ids in
    ``[-num_pages, 0)`` wrap like Python indices, ids outside ``[-num_pages, num_pages)`` are not read."""
    page = tl.where(page < 0, page + num_pages, page)
    ok = ok & (page >= 0) & (page < num_pages)
    return tl.where(ok, page, 0), ok


@triton.jit
def value_offsets(page, pos, d, PAGE_SIZE: tl.constexpr, PRESHUFFLE: tl.constexpr):
    """Byte offset of value ``d`` of position ``pos`` in ``page`` (DESIGN §3); inputs broadcast."""
    base = page.to(tl.int64) * (PAGE_SIZE * 132)
    if PRESHUFFLE:
        inner = (pos // 16) * 2048 + (d // 16) * 256 + (pos % 16) * 16 + d % 16
    else:
        inner = pos * 128 + d
    return base + inner


@triton.jit
def scale_offsets(page, pos, PAGE_SIZE: tl.constexpr):
    """fp32-word offset of the scale of position ``pos`` in ``page``: after the page's ``PAGE_SIZE*128`` value bytes."""
    return page.to(tl.int64) * (PAGE_SIZE * 33) + PAGE_SIZE * 32 + pos


@triton.jit
def round_to_bf16(x):
    """fp32 -> nearest bf16 (ties to even), kept in fp32, by integer arithmetic on the bits: the same on GPUs and
    in the interpreter, whose own bf16 cast rounds differently. NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)
