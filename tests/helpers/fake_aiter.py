"""A stand-in for the parts of aiter the ROCm dispatch calls, modelled on aiter's source (ROCm/aiter tags v0.1.7 ..
v0.1.20), not on our wiring: per release family it has that release's module paths and keyword sets, it makes the
checks aiter makes (``AITER_CHECK`` / ``assert``), and it computes what aiter's kernels compute, including where
they read memory a caller did not mean (those reads raise ``AssertionError`` here: on a GPU they return garbage
or fault). Every call is recorded.

Facts it encodes (file: what):
- ``aiter/ops/cache.py``, ``csrc/kernels/cache_kernels.cu``: ``indexer_k_quant_and_cache`` and
  ``cp_gather_indexer_k_quant_cache`` from 0.1.7, their ``preshuffle`` keyword from 0.1.13; the store skips slot < 0
  but not slot >= capacity; scale = max(amax, 1e-4) / fp8 max (ue8m0: 2^ceil(log2)), value = x * (1 / scale); the
  gather looks up each output row's sequence in ``cu_seq_lens`` and does not skip rows past ``cu_seq_lens[-1]``.
- ``aiter/ops/triton/{,attention/}pa_mqa_logits.py`` and ``gluon/pa_mqa_logits.py``: before 0.1.8 the signature is
  ``(..., max_model_len, ChunkK=64, SplitKV=5)`` (page 1 only); from 0.1.8 ``Preshuffle``/``KVBlockSize``; it asserts
  ``ChunkK % KVBlockSize == 0 or KVBlockSize % ChunkK == 0`` (ChunkK 256) and ``block_size == KVBlockSize``;
  ``Preshuffle`` needs the gluon kernel (gfx942/gfx950/gfx1250 with Triton >= 3.5, or the AOT bundle with Triton
  < 3.4); gfx1250 asserts ``KVBlockSize == 1`` without preshuffle and ``ChunkK % KVBlockSize == 0`` with it; the
  non-preshuffle kernel reads the block table as one slot per token (``KVBlockSize`` ignored); only visited chunks
  are written. The kernels tile all heads at once (``ChunkQ = heads``: a power of two, declared divisible by 16).
- ``fp8_mqa_logits.py``: a power-of-two head count is asserted; ``clean_logits`` from 0.1.15, whose result is a
  column slice of a 256-aligned buffer; the module moved to ``aiter.ops.triton.attention`` in 0.1.10.
- ``aiter/ops/topk.py``, ``csrc/kernels/topk_per_row_kernels.cu``: ``top_k_per_row_decode(logits, next_n, seqLens,
  indices, numRows, stride0, stride1)`` and ``top_k_per_row_prefill(logits, rowStarts, rowEnds, indices, numRows,
  stride0, stride1)`` from 0.1.7; prefill gets ``values`` after ``indices`` in 0.1.8; both get ``k=2048`` in 0.1.14
  (k is fixed at 2048 before: the kernel writes 2048 entries per row) and ``stable=False`` in 0.1.20. Row r is read
  at ``logits + r * stride0`` with contiguous columns (``stride1`` is ignored); decode's row covers
  ``[0, seqLens[r // next_n] - next_n + r % next_n + 1)``. A row no longer than k gets its columns in order then -1;
  a longer one a top-k set in no order (here: descending column, ties broken towards high columns), as absolute
  columns (prefill adds ``rowStart``; before 0.1.14 a long prefill row is read from column 0, not ``rowStart``;
  0.1.7's prefill returns columns minus ``rowStart``). ``stable=True``: ties to the smallest column, ascending
  column order. The ranking key is the float's bits xor 0x7fffffff unless the sign is set (0.1.14 on: so a NaN
  with the sign bit set ranks below -inf); 0.1.8-0.1.13 test ``x < 0`` instead, so -0.0 ranks below -inf (0.1.7's
  half-precision first pass is modelled with the 0.1.14 key). ``seqLens`` / ``indices`` must be int32 (0.1.20 reads
  an int64 ``seqLens`` as int32 words). Functions under ``@compile_ops`` (cache ops; top-k before 0.1.17) show the
  signature ``(*args, **kwargs)``, as aiter's ``torch_compile_guard`` wrapper does.
- ``aiter/ops/quant.py`` ``rotate_activation(out, input)`` (0.1.14; ``scale``, ``group_size``, ``shuffle_scale``
  keywords for its fp4 path later), ``csrc/kernels/dsv4_rotate_quant.cu``: bf16/fp16 in, fp32 butterflies
  (strides 1, 2, 4, ... in natural Sylvester order), times ``1/sqrt(dim)`` in fp32, one rounding to ``out``'s type;
  dim 128, 256, 512 or 1024.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass

import torch

GLUON_ARCHS = ("gfx942", "gfx950", "gfx1250")


@dataclass(frozen=True)
class Machine:
    version: tuple[int, int, int]
    gfx_arch: str = "gfx942"
    triton: tuple[int, int] = (3, 5)
    aot: bool = False  # AITER_ENABLE_AOT_GLUON_PA_MQA_LOGITS=1 with the bundle installed

    @property
    def gluon(self) -> bool:
        if self.gfx_arch not in GLUON_ARCHS:
            return False
        return self.triton >= (3, 5) or (self.aot and self.triton < (3, 4))


class AiterFault(AssertionError):
    """What would be a garbage read, a memory fault or an aiter assertion on the GPU."""


def _compiled(fn):
    """As aiter's ``@compile_ops`` wraps a function: the signature shows only ``(*args, **kwargs)``."""
    def op(*args, **kwargs):
        return fn(*args, **kwargs)
    op.__name__ = fn.__name__
    return op


def _order_keys(x: torch.Tensor, sign_bit: bool) -> torch.Tensor:
    """aiter's twiddle_in for fp32 (select largest): ascending key = descending value; int64 holding uint32."""
    bits = x.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    negative = (bits >> 31).bool() if sign_bit else x < 0
    return torch.where(negative, bits, bits ^ 0x7FFFFFFF)


def _select(row: torch.Tensor, k: int, sign_bit: bool, stable: bool) -> list[int]:
    """Columns of a top-k set of ``row`` (longer than k), in the order aiter emits them."""
    cols = torch.arange(row.numel())
    by_tie = cols if stable else cols.flip(0)  # ties: lowest columns first (stable), else highest
    chosen = by_tie[torch.argsort(_order_keys(row, sign_bit)[by_tie], stable=True)[:k]]
    return sorted(chosen.tolist(), reverse=not stable)


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """Walsh-Hadamard butterflies over the last dim in fp32, strides 1, 2, 4, ... (Sylvester natural order)."""
    y = x.float().clone()
    n = y.shape[-1]
    h = 1
    while h < n:
        pairs = y.view(*y.shape[:-1], n // (2 * h), 2, h)
        a, b = pairs[..., 0, :].clone(), pairs[..., 1, :].clone()
        pairs[..., 0, :], pairs[..., 1, :] = a + b, a - b
        h *= 2
    return y * torch.tensor(n ** -0.5, dtype=torch.float32)


def _byte_offset(block: int, off: int, d: torch.Tensor, page: int, preshuffle: bool) -> torch.Tensor:
    base = block * page * 132
    if preshuffle:  # csrc/kernels/cache_kernels.cu: TILE 16, token tiles of 16 x head_dim, 16x16 tiles inside
        return base + (off // 16) * (16 * 128) + (d // 16) * 256 + (off % 16) * 16 + d % 16
    return base + off * 128 + d


def _scale_offset(block: int, off: int, page: int) -> int:
    return block * page * 132 + page * 128 + off * 4


def install(monkeypatch, machine: Machine):
    """Put the stand-in modules of ``machine``'s aiter release into ``sys.modules``; returns the call record."""
    calls: list[tuple[str, dict]] = []
    v = machine.version
    cache_preshuffle = v >= (0, 1, 13)
    new_paths = v >= (0, 1, 10)
    d = torch.arange(128)

    def check(cond, message):
        if not cond:
            raise AiterFault(message)

    def _store(k, kv_cache, slot_mapping, quant_block_size, scale_fmt, preshuffle=False):
        calls.append(("indexer_k_quant_and_cache", dict(k=k, kv_cache=kv_cache, slot_mapping=slot_mapping,
                                                        quant_block_size=quant_block_size, scale_fmt=scale_fmt,
                                                        preshuffle=preshuffle)))
        check(kv_cache.dim() == 3, f"kv_cache must be [num_blocks, block_size, cache_stride], got {kv_cache.shape}")
        check(slot_mapping.dtype == torch.int64, "slot_mapping is read as int64")
        check(k.shape[1] % quant_block_size == 0, "head_dim must be divisible by quant_block_size")
        blocks, page, _ = kv_cache.shape
        if preshuffle:
            check(page % 16 == 0, f"preshuffle requires cache_block_size to be a multiple of 16, got {page}")
        raw = kv_cache.view(torch.uint8).reshape(-1)
        fmax = torch.finfo(kv_cache.dtype).max
        for t in range(min(k.shape[0], slot_mapping.shape[0])):
            slot = int(slot_mapping[t])
            if slot < 0:
                continue
            check(slot < blocks * page, f"slot {slot} past the cache ({blocks * page} slots): out-of-bounds write")
            x = k[t].float()
            scale = torch.clamp(x.abs().max(), min=1e-4) / fmax
            if scale_fmt == "ue8m0":
                scale = torch.exp2(torch.ceil(torch.log2(scale)))
            vals = (x * (1.0 / scale)).clamp(-fmax, fmax).to(kv_cache.dtype).view(torch.uint8)
            raw[_byte_offset(slot // page, slot % page, d, page, preshuffle)] = vals
            so = _scale_offset(slot // page, slot % page, page)
            raw[so:so + 4] = scale.reshape(1).float().view(torch.uint8)

    def _gather(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, preshuffle=False):
        calls.append(("cp_gather_indexer_k_quant_cache", dict(kv_cache=kv_cache, dst_k=dst_k, dst_scale=dst_scale,
                                                              block_table=block_table, cu_seq_lens=cu_seq_lens,
                                                              preshuffle=preshuffle)))
        blocks, page, _ = kv_cache.shape
        if preshuffle:
            check(page % 16 == 0, f"preshuffle requires cache_block_size to be a multiple of 16, got {page}")
        check(dst_scale.shape[1] * dst_scale.element_size() == 4, "one fp32 scale per row (quant block 128)")
        raw = kv_cache.view(torch.uint8).reshape(-1)
        out_k, out_s = dst_k.view(torch.uint8), dst_scale.view(torch.uint8).reshape(-1, 4)
        cu = cu_seq_lens.tolist()
        for row in range(dst_k.shape[0]):
            batch = [b for b in range(block_table.shape[0]) if cu[b] <= row < cu[b + 1]]
            check(batch, f"row {row} is past cu_seq_lens[-1]={cu[-1]}: aiter reads an uninitialised batch index")
            b = batch[-1]
            pos = row - cu[b]
            check(pos // page < block_table.shape[1], f"row {row}: block-table column {pos // page} past the table")
            block = int(block_table[b, pos // page])
            check(0 <= block < blocks, f"row {row}: page {block} is not in the cache")
            out_k[row] = raw[_byte_offset(block, pos % page, d, page, preshuffle)]
            so = _scale_offset(block, pos % page, page)
            out_s[row] = raw[so:so + 4]

    def _logits(q, keys, scales, weights):
        """``sum_h w[h] * relu(q[h] . k[s] * scale[s])`` in fp32 for one query row."""
        return (torch.relu((q.float() @ keys.float().T) * scales[None, :]) * weights[:, None]).sum(0)

    def _paged(q_fp8, kv_cache, weights, out_logits, context_lens, kv_indices, max_model_len, Preshuffle, KVBlockSize,
               ChunkK):
        batch, next_n, heads, hidden = q_fp8.shape
        check(heads & (heads - 1) == 0 and heads % 16 == 0, f"ChunkQ = heads = {heads}: arange needs a power of two")
        _, block_size, _, _ = kv_cache.shape
        check(ChunkK % KVBlockSize == 0 or KVBlockSize % ChunkK == 0, f"ChunkK {ChunkK} vs KVBlockSize {KVBlockSize}")
        check(block_size == KVBlockSize, f"kv_cache block size {block_size} != KVBlockSize {KVBlockSize}")
        if Preshuffle:
            check(KVBlockSize % 16 == 0, f"Preshuffle mode only supports KVBlockSize aligned to 16, {KVBlockSize}")
            check(machine.gluon, "Preshuffle mode is only supported on gluon kernel.")
            if machine.gfx_arch == "gfx1250":
                check(ChunkK % KVBlockSize == 0, "gfx1250 preshuffle requires ChunkK % KVBlockSize == 0")
        elif machine.gfx_arch == "gfx1250" and machine.gluon:
            check(KVBlockSize == 1, "gfx1250 base kernel requires KVBlockSize==1")
        raw = kv_cache.view(torch.uint8).reshape(-1)
        fp8 = kv_cache.dtype
        out_logits.fill_(float("nan"))  # columns aiter does not visit keep whatever was there
        for b in range(batch):
            ctx = int(context_lens[b])
            keys, scales = [], []
            for s in range(ctx):
                if Preshuffle:
                    col, off = s // KVBlockSize, s % KVBlockSize
                else:  # one slot per token: the token index is the block-table column, KVBlockSize is ignored
                    col, off = s, 0
                check(col < kv_indices.shape[1], f"batch {b} token {s}: block-table column {col} past the table")
                block = int(kv_indices[b, col])
                check(0 <= block < raw.numel() // (KVBlockSize * 132), f"page {block} is not in the cache")
                keys.append(raw[_byte_offset(block, off, d, KVBlockSize, Preshuffle)].view(fp8))
                so = _scale_offset(block, off, KVBlockSize)
                scales.append(raw[so:so + 4].view(torch.float32))
            visited = min(math.ceil(ctx / ChunkK) * ChunkK, max_model_len)
            for j in range(next_n):
                row = b * next_n + j
                out_logits[row, :visited] = float("-inf")
                visible = min(max(ctx - next_n + j + 1, 0), max_model_len)
                if visible:
                    out_logits[row, :visible] = _logits(q_fp8[b, j], torch.stack(keys[:visible]),
                                                        torch.cat(scales[:visible]), weights[row])

    def deepgemm_fp8_paged_mqa_logits_old(q_fp8, kv_cache_fp8, weights, out_logits, context_lens, kv_indices,
                                          max_model_len, ChunkK=64, SplitKV=5):
        calls.append(("deepgemm_fp8_paged_mqa_logits", dict(kv_cache=kv_cache_fp8, KVBlockSize=None)))
        _paged(q_fp8, kv_cache_fp8, weights, out_logits, context_lens, kv_indices, max_model_len, False, 1, ChunkK)

    def deepgemm_fp8_paged_mqa_logits(q_fp8, kv_cache, weights, out_logits, context_lens, kv_indices, max_model_len,
                                      Preshuffle=False, KVBlockSize=1, ChunkK=256, TotalCuCount=None, WavePerEU=2,
                                      VarCtxSchedule=None):
        calls.append(("deepgemm_fp8_paged_mqa_logits", dict(q_fp8=q_fp8, kv_cache=kv_cache, weights=weights,
                                                            out_logits=out_logits, context_lens=context_lens,
                                                            kv_indices=kv_indices, max_model_len=max_model_len,
                                                            Preshuffle=Preshuffle, KVBlockSize=KVBlockSize)))
        _paged(q_fp8, kv_cache, weights, out_logits, context_lens, kv_indices, max_model_len, Preshuffle, KVBlockSize,
               ChunkK)

    def _ragged(Q, KV, kv_scales, weights, cu_starts, cu_ends, aligned):
        seq_len, heads, head_size = Q.shape
        check(heads & (heads - 1) == 0, "num q. heads should be power of 2.")
        check(head_size & (head_size - 1) == 0, "head size should be power of 2.")
        n = KV.shape[0]
        width = -(-n // 256) * 256 if aligned else n
        logits = torch.full((seq_len, width), float("-inf"))[:, :n]
        for t in range(seq_len):
            lo, hi = max(int(cu_starts[t]), 0), min(int(cu_ends[t]), n)
            if hi > lo:
                logits[t, lo:hi] = _logits(Q[t], KV[lo:hi], kv_scales[lo:hi], weights[t])
        return logits

    def fp8_mqa_logits_old(Q, KV, kv_scales, weights, cu_starts, cu_ends):
        calls.append(("fp8_mqa_logits", dict(Q=Q, KV=KV)))
        return _ragged(Q, KV, kv_scales, weights, cu_starts, cu_ends, aligned=False)

    def fp8_mqa_logits(Q, KV, kv_scales, weights, cu_starts, cu_ends, clean_logits=True):
        calls.append(("fp8_mqa_logits", dict(Q=Q, KV=KV, clean_logits=clean_logits)))
        return _ragged(Q, KV, kv_scales, weights, cu_starts, cu_ends, aligned=True)

    def _read_row(logits, r, stride0, start, length):
        """``length`` fp32 values at ``logits + r * stride0 + start`` (stride1 ignored: columns contiguous)."""
        check(logits.dtype == torch.float32, f"logits is read as fp32, got {logits.dtype}")
        first = logits.storage_offset() + r * stride0 + start
        check(first >= 0 and first + length <= logits.untyped_storage().nbytes() // 4,
              f"row {r}: columns [{start}, {start + length}) at stride0 {stride0} read past the logits tensor")
        return torch.as_strided(logits, (length,), (1,), first)

    def _topk_rows(logits, indices, num_rows, stride0, k, windows, stable, relative):
        """Write each row's top-k into ``indices`` as aiter does; ``windows[r] = (start, end)``."""
        check(indices.dtype == torch.int32 and indices.is_contiguous(), "indices is written as contiguous int32")
        check(indices.numel() >= num_rows * k, f"{num_rows} rows of {k} indices: writes past indices "
                                               f"{list(indices.shape)}")
        flat = indices.view(-1)
        for r in range(num_rows):
            start, end = windows[r]
            length = end - start
            if length <= k:
                out = [(c - start if relative else c + start) if c < length else -1 for c in range(k)]
            else:
                if v < (0, 1, 14) and not relative:
                    start = 0  # the one-block kernel reads the row from column 0 (fixed in aiter #2901)
                row = _read_row(logits, r, stride0, start, length)
                out = [c + (0 if relative else start) for c in _select(row, k, v < (0, 1, 8) or v >= (0, 1, 14),
                                                                        stable)]
            flat[r * k:(r + 1) * k] = torch.tensor(out, dtype=torch.int32)

    def _int32_words(t, name):
        if v >= (0, 1, 20):  # aiter_tensor_t: the pointer is read as int32 whatever the dtype
            return t.contiguous().view(-1).view(torch.int32)
        check(t.dtype == torch.int32, f"{name}: expected scalar type Int, got {t.dtype}")
        return t

    def _decode(logits, next_n, seqLens, indices, numRows, stride0, stride1, k=2048, stable=False):
        calls.append(("top_k_per_row_decode", dict(logits=logits, next_n=next_n, seqLens=seqLens, indices=indices,
                                                   numRows=numRows, stride0=stride0, stride1=stride1, k=k,
                                                   stable=stable)))
        if numRows <= 0:
            return
        lens = _int32_words(seqLens, "seqLens")
        windows = [(0, int(lens[r // next_n]) - next_n + r % next_n + 1) for r in range(numRows)]
        _topk_rows(logits, indices, numRows, stride0, k, windows, stable, relative=False)

    def _prefill(logits, rowStarts, rowEnds, indices, values, numRows, stride0, stride1, k=2048, stable=False):
        calls.append(("top_k_per_row_prefill", dict(logits=logits, rowStarts=rowStarts, rowEnds=rowEnds,
                                                    indices=indices, values=values, numRows=numRows,
                                                    stride0=stride0, stride1=stride1, k=k, stable=stable)))
        if numRows <= 0:
            return
        starts, ends = _int32_words(rowStarts, "rowStarts"), _int32_words(rowEnds, "rowEnds")
        windows = [(int(starts[r]), int(ends[r])) for r in range(numRows)]
        _topk_rows(logits, indices, numRows, stride0, k, windows, stable, relative=v < (0, 1, 8))
        if values is not None:
            for r in range(numRows):
                cols = indices[r].long()
                row = _read_row(logits, r, stride0, 0, int(cols.max()) + 1) if cols.max() >= 0 else None
                values[r] = torch.where(cols >= 0, row[cols.clamp(min=0)], 0.0) if row is not None else 0.0

    if v >= (0, 1, 20):
        def top_k_per_row_decode(logits, next_n, seqLens, indices, numRows, stride0, stride1, k=2048, stable=False):
            _decode(logits, next_n, seqLens, indices, numRows, stride0, stride1, k, stable)

        def top_k_per_row_prefill(logits, rowStarts, rowEnds, indices, values, numRows, stride0, stride1, k=2048,
                                  stable=False):
            _prefill(logits, rowStarts, rowEnds, indices, values, numRows, stride0, stride1, k, stable)
    elif v >= (0, 1, 14):
        def top_k_per_row_decode(logits, next_n, seqLens, indices, numRows, stride0, stride1, k=2048):
            _decode(logits, next_n, seqLens, indices, numRows, stride0, stride1, k)

        def top_k_per_row_prefill(logits, rowStarts, rowEnds, indices, values, numRows, stride0, stride1, k=2048):
            _prefill(logits, rowStarts, rowEnds, indices, values, numRows, stride0, stride1, k)
    elif v >= (0, 1, 8):
        def top_k_per_row_decode(logits, next_n, seqLens, indices, numRows, stride0, stride1):
            _decode(logits, next_n, seqLens, indices, numRows, stride0, stride1)

        def top_k_per_row_prefill(logits, rowStarts, rowEnds, indices, values, numRows, stride0, stride1):
            _prefill(logits, rowStarts, rowEnds, indices, values, numRows, stride0, stride1)
    else:
        def top_k_per_row_decode(logits, next_n, seqLens, indices, numRows, stride0, stride1):
            _decode(logits, next_n, seqLens, indices, numRows, stride0, stride1)

        def top_k_per_row_prefill(logits, rowStarts, rowEnds, indices, numRows, stride0, stride1):
            _prefill(logits, rowStarts, rowEnds, indices, None, numRows, stride0, stride1)
    if v < (0, 1, 17):
        top_k_per_row_decode, top_k_per_row_prefill = _compiled(top_k_per_row_decode), _compiled(top_k_per_row_prefill)

    def rotate_activation(out, input, scale=None, group_size=None, shuffle_scale=True):
        calls.append(("rotate_activation", dict(out=out, input=input)))
        check(input.dtype in (torch.bfloat16, torch.float16) and out.dtype == input.dtype,
              f"bf16/fp16 rotate: out is stored as the input's type, got {input.dtype} -> {out.dtype}")
        check(input.shape[-1] in (128, 256, 512, 1024), "dim must be 128, 256, 512 or 1024")
        out.copy_(_rotate(input).to(out.dtype))

    if cache_preshuffle:
        def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt, preshuffle=False):
            _store(k, kv_cache, slot_mapping, quant_block_size, scale_fmt, preshuffle)

        def cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, preshuffle=False):
            _gather(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, preshuffle)
    else:
        def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt):
            _store(k, kv_cache, slot_mapping, quant_block_size, scale_fmt)

        def cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens):
            _gather(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens)

    indexer_k_quant_and_cache = _compiled(indexer_k_quant_and_cache)
    cp_gather_indexer_k_quant_cache = _compiled(cp_gather_indexer_k_quant_cache)
    paged_fn = deepgemm_fp8_paged_mqa_logits if v >= (0, 1, 8) else deepgemm_fp8_paged_mqa_logits_old
    paged_fn.__name__ = "deepgemm_fp8_paged_mqa_logits"
    ragged_fn = fp8_mqa_logits if v >= (0, 1, 15) else fp8_mqa_logits_old
    ragged_fn.__name__ = "fp8_mqa_logits"
    triton_pkg = "aiter.ops.triton.attention" if new_paths else "aiter.ops.triton"
    modules = {
        "aiter": {},
        "aiter.ops": {},
        "aiter.ops.cache": {"indexer_k_quant_and_cache": indexer_k_quant_and_cache,
                            "cp_gather_indexer_k_quant_cache": cp_gather_indexer_k_quant_cache},
        "aiter.ops.triton": {},
        f"{triton_pkg}.pa_mqa_logits": {"deepgemm_fp8_paged_mqa_logits": paged_fn},
        f"{triton_pkg}.fp8_mqa_logits": {"fp8_mqa_logits": ragged_fn},
        "aiter.ops.topk": {"top_k_per_row_decode": top_k_per_row_decode,
                           "top_k_per_row_prefill": top_k_per_row_prefill},
        "aiter.ops.quant": {"rotate_activation": _compiled(rotate_activation)} if v >= (0, 1, 14) else {},
    }
    if new_paths:
        modules["aiter.ops.triton.attention"] = {}
    for name in list(sys.modules):
        if name == "aiter" or name.startswith("aiter."):
            monkeypatch.delitem(sys.modules, name)
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        for key, value in attrs.items():
            setattr(module, key, value)
        monkeypatch.setitem(sys.modules, name, module)
    return calls
