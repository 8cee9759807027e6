"""The Triton kernels on a GPU: cache bytes bit-identical to the torch reference on the same GPU, logits within
1e-3 of a float64 model with identical -inf masks, every output element written, and CUDA-graph capture."""

from __future__ import annotations

import importlib

import pytest
import torch

from nsa_inductor.indexer import hadamard_matrix
from nsa_inductor.layout import KCacheLayout
from nsa_inductor.lowering import _host_plans as host_plans
from helpers.ops64 import FN, FNUZ, WEIGHT_MODES, adversarial_k, adversarial_topk_logits, assert_fp8_close, \
    assert_rows_close, assert_topk_valid, eager_topk_rows, integer_rows, \
    head_gate_partials64, paged_logits64, random_cache, random_fp8, random_paged_cache, ragged_logits64, topk_logits
from helpers.guards import Guarded
from helpers.op_calls import CASES as OP_CALLS
from helpers.reference64 import assert_logits_close, batched_logits64

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]

LAYOUTS = [(1, False), (64, False), (64, True), (16, True)]
DEV = "cuda"


def _tk(op: str):
    """The Triton module of ``op``."""
    return importlib.import_module(f"nsa_inductor.lowering.{op}.triton")


def _op_ref(op: str):
    """The torch reference module of ``op``."""
    return importlib.import_module(f"nsa_inductor.lowering.{op}.reference")


def _native_fp8_types() -> list[torch.dtype]:
    """fp8 types Triton computes with on this GPU (fnuz only on AMD)."""
    return [FN, FNUZ] if torch.version.hip else [FN]


def _k_rows(dtype, gen) -> torch.Tensor:
    random_rows = torch.randn(4093, 128, generator=gen) * torch.logspace(-4, 4, 4093)[:, None]
    ties = torch.arange(-64, 64).float()[None, :] * 2.0 ** -torch.arange(0, 16).float()[:, None]  # fp8 ties
    return torch.cat([random_rows, ties, adversarial_k(float(torch.finfo(dtype).max)).float()]).bfloat16()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
@pytest.mark.parametrize("dtype", _native_fp8_types())
def test_quant_cache_store_bit_exact(layout, scale_fmt, dtype):
    from nsa_inductor.lowering.quant_cache_store import reference

    page_size, preshuffle = layout
    gen = torch.Generator().manual_seed(0)
    k = _k_rows(dtype, gen).to(DEV)
    num_slots = k.shape[0] + 300
    slots = torch.randperm(num_slots, generator=gen)[: k.shape[0]]
    slots[::7] = -1
    slots = slots.to(DEV)
    cache = torch.randint(0, 256, (-(-num_slots // page_size), page_size * 132), dtype=torch.uint8,
                          generator=gen).to(DEV)
    want = cache.clone()
    reference.quant_cache_store(k, want, slots, page_size, preshuffle, scale_fmt, dtype)
    _tk("quant_cache_store").quant_cache_store(k, cache, slots, page_size, preshuffle, scale_fmt, dtype)
    diff = (cache != want).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at {diff[:5].tolist()}"


@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16])
def test_quant_cache_store_input_epilogue_bit_exact(input_dtype):
    """The rotation epilogue done in the kernel gives the bytes of storing the eagerly scaled and rounded K."""
    from nsa_inductor.lowering.quant_cache_store import reference

    gen = torch.Generator().manual_seed(3)
    y = (torch.randn(4096, 128, generator=gen) * torch.logspace(-3, 3, 4096)[:, None]).to(DEV)
    slots = torch.randperm(4096 + 64, generator=gen)[:4096].to(DEV)
    cache = torch.randint(0, 256, (-(-(4096 + 64) // 64), 64 * 132), dtype=torch.uint8, generator=gen).to(DEV)
    want = cache.clone()
    reference.quant_cache_store((y * 128**-0.5).to(input_dtype), want, slots, 64, False, "ue8m0", FN)
    _tk("quant_cache_store").quant_cache_store(y, cache, slots, 64, False, "ue8m0", FN, 128**-0.5, input_dtype)
    diff = (cache != want).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at {diff[:5].tolist()}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [FN, FNUZ])
def test_gather_k_exact_and_fully_written(layout, dtype):
    from nsa_inductor.lowering.gather_k import reference

    page_size, preshuffle = layout
    gen = torch.Generator().manual_seed(1)
    lengths = [1000, 0, 37, 2049, 64]
    cache, block_table = (t.to(DEV) for t in random_paged_cache(lengths, page_size, dtype, gen, spare_pages=3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    num_tokens = int(cu[-1]) + 50
    poisoned = (torch.full((num_tokens, 128), 0x7F, dtype=torch.uint8, device=DEV).view(dtype),
                torch.full((num_tokens,), float("nan"), device=DEV))
    k, scale = _tk("gather_k").gather_k(cache, block_table, cu, page_size, preshuffle, num_tokens, dtype, out=poisoned)
    want_k, want_scale = reference.gather_k(cache, block_table, cu, page_size, preshuffle, num_tokens, dtype)
    assert torch.equal(k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(scale, want_scale)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("next_n", [1, 2])
def test_paged_mqa_logits(layout, heads, next_n):
    page_size, preshuffle = layout
    gen = torch.Generator().manual_seed(2)
    ctx = [0, 1, 1000, 4099]
    max_len = 9000  # far above the longest context
    cache, block_table = random_paged_cache(ctx, page_size, FN, gen)
    q = random_fp8((len(ctx), next_n, heads, 128), FN, gen)
    weights = torch.randn(len(ctx) * next_n, heads, generator=gen)
    context_lens = torch.tensor(ctx, dtype=torch.int32)
    cpu_args = (q, cache, weights, context_lens, block_table, max_len, page_size, preshuffle)
    gpu_args = tuple(a.to(DEV) if isinstance(a, torch.Tensor) else a for a in cpu_args)
    out = torch.full((len(ctx) * next_n, max_len), float("nan"), device=DEV)
    got = _tk("paged_mqa_logits").paged_mqa_logits(*gpu_args, out=out)
    want = paged_logits64(*cpu_args)
    assert_logits_close(got, want)
    assert_logits_close(torch.ops.nsa.paged_mqa_logits(*gpu_args), want)


def test_paged_mqa_logits_nan_scale_gives_nan():
    """A key whose scale is NaN (its K row held NaN, docs/indices.md) has NaN logits, as eager's relu gives: the
    kernel multiplies the scale after the head sum, where a GPU max(NaN, 0) inside the relu used to drop it."""
    gen = torch.Generator().manual_seed(5)
    page_size, token = 64, 71
    cache, block_table = random_paged_cache([200], page_size, FN, gen)
    page = int(block_table[0, token // page_size])
    scale_at = page_size * 128 + 4 * (token % page_size)
    cache[page, scale_at:scale_at + 4] = torch.tensor([float("nan")]).view(torch.uint8)
    q = random_fp8((1, 1, 64, 128), FN, gen)
    cpu_args = (q, cache, torch.randn(1, 64, generator=gen), torch.tensor([200], dtype=torch.int32), block_table, 256,
                page_size, False)
    got = torch.ops.nsa.paged_mqa_logits(*(a.to(DEV) if isinstance(a, torch.Tensor) else a for a in cpu_args)).cpu()
    want = paged_logits64(*cpu_args)
    assert got[0, token].isnan() and want[0, token].isnan()
    others = torch.arange(256) != token
    assert_logits_close(got[:, others], want[:, others])


@pytest.mark.parametrize("heads", [32, 64])
def test_mqa_logits_causal_prefill(heads):
    gen = torch.Generator().manual_seed(3)
    lengths = [700, 333, 1]
    tokens = sum(lengths)
    q = random_fp8((tokens, heads, 128), FN, gen)
    k = random_fp8((tokens, 128), FN, gen)
    k_scale = torch.rand(tokens, generator=gen) + 0.05
    weights = torch.randn(tokens, heads, generator=gen)
    starts = torch.repeat_interleave(torch.tensor([0, 700, 1033]), torch.tensor(lengths)).int()
    ks, ke = starts, torch.arange(1, tokens + 1, dtype=torch.int32)
    cpu_args = (q, k, k_scale, weights, ks, ke)
    gpu_args = [a.to(DEV) for a in cpu_args]
    out = torch.full((tokens, tokens), float("nan"), device=DEV)
    got = _tk("mqa_logits").mqa_logits(*gpu_args, out=out)
    want = ragged_logits64(*cpu_args)
    assert_logits_close(got, want)
    assert_logits_close(torch.ops.nsa.mqa_logits(*gpu_args), want)


@pytest.mark.parametrize("batch, tokens, heads, keys, dim, dtype", [
    (64, 1, 64, 8192, 128, torch.bfloat16), (1, 1, 64, 32768, 128, torch.bfloat16),
    (3, 2, 64, 1000, 128, torch.bfloat16),
    (2, 5, 128, 77, 128, torch.float16), (1, 300, 64, 300, 128, torch.bfloat16), (2, 64, 32, 129, 48, torch.float16),
    (4, 1, 3, 5, 16, torch.bfloat16), (2, 3, 4, 9, 320, torch.bfloat16), (0, 1, 64, 10, 128, torch.bfloat16),
    (2, 1, 64, 0, 128, torch.bfloat16)])
def test_batched_mqa_logits_matches_float64_and_eager(batch, tokens, heads, keys, dim, dtype):
    """Both tilings (decode and prefill row counts), odd sizes, a head dim past the kernel's (the reference runs),
    empty batches, with and without masks; against float64 and against eager's fp32 matmuls on this GPU."""
    gen = torch.Generator().manual_seed(7)
    args = [t.to(DEV) for t in (torch.randn(batch, tokens, heads, dim, generator=gen).to(dtype),
                                torch.randn(batch, keys, dim, generator=gen).to(dtype),
                                torch.randn(batch, tokens, heads, generator=gen))]
    got = torch.ops.nsa.batched_mqa_logits(*args, dim**-0.5)
    assert_logits_close(got, batched_logits64(*args, dim**-0.5), rtol=1e-5)
    scores = torch.matmul(args[0].float(), args[1].transpose(-1, -2).float().unsqueeze(1)) * dim**-0.5
    eager = torch.matmul(args[2].unsqueeze(-2), scores.relu()).squeeze(-2)
    assert_logits_close(got, eager, rtol=1e-5)
    scaled = torch.ops.nsa.batched_mqa_logits(*args, 1.0, torch.tensor(dim**-0.5, device=DEV))
    assert_logits_close(scaled, eager, rtol=1e-5)
    tk = _tk("batched_mqa_logits")
    for config in (tk.BatchedConfig(False, keys_in_m=False), tk.BatchedConfig(tokens < tk.ROWS_IN_M_FROM)):
        assert_logits_close(tk.batched_mqa_logits(*args, dim**-0.5, config=config), eager, rtol=1e-5)
    lengths = torch.randint(0, keys + 1, (batch, 1, 1), generator=gen)
    visible = torch.arange(keys)[None, None] < lengths + torch.arange(tokens)[None, :, None] - tokens + 1
    for mask in (visible, torch.rand(batch, tokens, keys, generator=gen) < 0.3, visible[:, :1].expand_as(visible)):
        mask = mask.to(DEV)  # causal with a random context length, scattered, one mask for all rows (stride 0)
        want = eager.masked_fill(~mask, float("-inf"))
        assert_logits_close(torch.ops.nsa.batched_mqa_logits(*args, dim**-0.5, None, mask), want, rtol=1e-5)
        for config in (tk.BatchedConfig(False, keys_in_m=False), tk.BatchedConfig(tokens < tk.ROWS_IN_M_FROM)):
            got = tk.batched_mqa_logits(*args, dim**-0.5, None, mask, config=config)
            assert_logits_close(got, want, rtol=1e-5)
            filled = tk.batched_mqa_logits(*args, dim**-0.5, None, mask, -1e30, config=config)
            assert torch.equal(filled, got.masked_fill(~mask, -1e30))


def test_fnuz_ops_on_this_gpu():
    """On NVIDIA fnuz arithmetic runs the torch reference; on AMD the Triton kernels use float8e4b8. Either way the
    bytes are the reference's run on the CPU (a bf16 amax over 240 is a power of two or far from one, so both devices'
    log2 give one scale, and dividing by a power of two rounds alike)."""
    from nsa_inductor.lowering.quant_cache_store import reference

    gen = torch.Generator().manual_seed(4)
    k = _k_rows(FNUZ, gen)[:300]
    want = torch.zeros(6, 64 * 132, dtype=torch.uint8)
    reference.quant_cache_store(k, want, torch.arange(300), 64, True, "ue8m0", FNUZ)
    cache = torch.zeros_like(want, device=DEV)
    torch.ops.nsa.quant_cache_store(k.to(DEV), cache, torch.arange(300, device=DEV), 64, True, "ue8m0", FNUZ)
    assert torch.equal(cache.cpu(), want)
    q = random_fp8((1, 1, 64, 128), FNUZ, gen)
    weights = torch.randn(1, 64, generator=gen)
    cpu_args = (q, cache.cpu(), weights, torch.tensor([300], dtype=torch.int32),
                torch.tensor([[0, 1, 2, 3, 4]], dtype=torch.int32), 512, 64, True)
    gpu_args = tuple(a.to(DEV) if isinstance(a, torch.Tensor) else a for a in cpu_args)
    assert_logits_close(torch.ops.nsa.paged_mqa_logits(*gpu_args), paged_logits64(*cpu_args))


@pytest.mark.parametrize("rows, cols, k, with_lengths", [(64, 65536, 2048, True), (64, 65536, 2048, False),
                                                        (64, 8192, 2048, False), (1300, 1300, 1300, True),
                                                        (3, 100, 0, False)])
def test_topk_indices_is_eager_topk_as_sets(rows, cols, k, with_lengths):
    logits = topk_logits(rows, cols, 0.05, seed=rows).to(DEV)
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, min(cols, 9000), (rows,), generator=gen).int().to(DEV) if with_lengths else None
    offset = torch.randint(0, 7, (rows,), generator=gen).to(DEV)
    out = torch.full((rows, k), 12345, dtype=torch.int32, device=DEV)  # poisoned: every slot must be written
    got = _tk("topk_indices").topk_indices(logits, k, lengths, offset, out=out)
    assert [sorted(r) for r in got.tolist()] == eager_topk_rows(logits, k, lengths, offset)


@pytest.mark.parametrize("rows, cols, k", [(64, 8192, 2048), (8, 20000, 2048), (20, 20000, 2048), (3, 3000, 2500),
                                           (2, 9000, 5000), (2, 300, 300)])
@pytest.mark.parametrize("kind", ["ties", "close", "nan", "tail", "randn"])
@pytest.mark.parametrize("pad, sorted_", [("neg1", False), ("neg1", True), ("column", True)])
@pytest.mark.parametrize("path", ["bisect", "radix_split", "radix_row"])
def test_topk_indices_meets_the_contract(rows, cols, k, kind, pad, sorted_, path):
    """DeepSeek-V3.2 decode width, a streamed row (> 8192 columns), adversarial values; both pads and orders; every
    path (the radix paths' boundary bin holds every column of the "close" rows; 20 rows of 20 segments: the split
    path's bounds launch)."""
    logits = adversarial_topk_logits(rows, cols, kind, seed=cols)
    lengths = torch.randint(0, cols + 1, (rows,), generator=torch.Generator().manual_seed(k)).int()
    lengths[0] = cols
    offset = -torch.arange(rows)
    out = torch.full((rows, k), 12345, dtype=torch.int32, device=DEV)
    got = _tk("topk_indices").topk_indices(logits.to(DEV), k, lengths.to(DEV), offset.to(DEV), pad, sorted_, out=out,
                                           path=path)
    assert_topk_valid(logits, got.cpu(), k, lengths, offset, pad, sorted_)


@pytest.mark.parametrize("rows, cols", [(20, 20000), (8, 65536)])
@pytest.mark.parametrize("kind", ["ties", "close", "nan", "tail", "randn"])
@pytest.mark.parametrize("pad, sorted_", [("neg1", False), ("column", True)])
def test_topk_window_meets_the_contract(rows, cols, kind, pad, sorted_):
    """The split path binned by each row's window (the launcher's choice without lengths) on rows with lengths too,
    where it would not choose it: adversarial values, lengths down to 0 and below k."""
    logits = adversarial_topk_logits(rows, cols, kind, seed=cols + 1)
    lengths = torch.randint(0, cols + 1, (rows,), generator=torch.Generator().manual_seed(rows)).int()
    lengths[0] = cols
    out = torch.full((rows, 2048), 12345, dtype=torch.int32, device=DEV)
    got = _tk("topk_indices").topk_indices(logits.to(DEV), 2048, lengths.to(DEV), None, pad, sorted_, out=out,
                                           path="radix_split", window=True)
    assert_topk_valid(logits, got.cpu(), 2048, lengths, None, pad, sorted_)


@pytest.mark.parametrize("rows, cols, lengths, path", [
    (64, 8192, None, "bisect"), (300, 8192, (1, 8192), "radix_row"), (8, 20000, None, "radix_split"),
    (64, 65536, None, "radix_split"), (64, 65536, (7680, 8704), "radix_split"), (2, 32768, (0, 32769), "radix_split")])
@pytest.mark.parametrize("kind", ["ties", "randn"])
@pytest.mark.parametrize("sorted_", [False, True])
def test_topk_indices_is_deterministic(rows, cols, lengths, path, kind, sorted_):
    """The same call gives the same output, slot for slot, in set order too: which ties are taken and where each
    entry lands never depend on the order in which programs run (every path: 64 rows of 65536 without lengths bin
    by their window after a bounds launch, with an engine's lengths by four programs a row; 2 rows sort by ranks)."""
    logits = adversarial_topk_logits(rows, cols, kind, seed=rows).to(DEV)
    row_lengths = None if lengths is None else torch.randint(
        *lengths, (rows,), generator=torch.Generator().manual_seed(cols)).int().to(DEV)
    calls = [_tk("topk_indices").topk_indices(logits, 2048, row_lengths, None, "neg1", sorted_, path=path)
             for _ in range(3)]
    for got in calls[1:]:
        assert torch.equal(got, calls[0])


def _aiter_topk_refusal() -> str | None:
    from nsa_inductor.capability import aiter_refusal, capability

    return aiter_refusal(capability(), "topk_indices", sorted=False)


@pytest.mark.skipif(not torch.version.hip, reason="aiter runs on ROCm only")
@pytest.mark.parametrize("rows, cols, k", [(64, 8192, 2048), (8, 20000, 512), (3, 3000, 2500), (1, 1, 1)])
@pytest.mark.parametrize("kind", ["ties", "close", "tail", "randn"])  # (a NaN with the sign bit set: docs/rocm.md)
@pytest.mark.parametrize("pad", ["neg1", "column"])
def test_aiter_topk_indices_meets_the_contract(rows, cols, k, kind, pad):
    """aiter's top_k_per_row_decode behind the op's adaptation (never run yet: the first AMD run tests our reading)."""
    if _aiter_topk_refusal() is not None:
        pytest.skip(f"aiter's top-k is not used here: {_aiter_topk_refusal()}")
    logits = adversarial_topk_logits(rows, cols, kind, seed=cols)
    lengths = torch.randint(0, cols + 9, (rows,), generator=torch.Generator().manual_seed(k)).int()
    offset = torch.arange(rows)
    logits.masked_fill_(torch.arange(cols)[None, :] < offset[:, None], float("-inf"))
    got = importlib.import_module("nsa_inductor.lowering.topk_indices.aiter").topk_indices(
        logits.to(DEV), k, lengths.to(DEV), offset.to(DEV), pad)
    assert_topk_valid(logits, got.cpu(), k, lengths, offset, pad)


@pytest.mark.parametrize("rows, width", [(8, 8192), (1, 8192), (64, 32768)])
def test_topk_indices_replays_in_cuda_graph_with_new_lengths(rows, width):
    """The split radix path's per-row arrival counts start from zero on every replay; sorted by chunks (8 and 64
    rows) and by ranks (1 row); 64 rows of 32768 columns (512 segments a launch) run its bounds launch."""
    tk = _tk("topk_indices")
    assert tk.path_for(rows, width, 2048) == "radix_split"
    assert tk.sort_for(rows, 2048, "radix_split") == ("ranks" if rows == 1 else "chunks")
    logits = topk_logits(rows, width, 0.0, seed=3).to(DEV)
    lengths = torch.full((rows,), width, dtype=torch.int32, device=DEV)
    new_lengths = torch.tensor([5000, 1, 2047, 2048, 2049, 0, width - 1, width], dtype=torch.int32).repeat(8)[:rows]
    for sorted_ in (False, True):
        torch.ops.nsa.topk_indices(logits, 2048, lengths, None, "neg1", sorted_)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = torch.ops.nsa.topk_indices(logits, 2048, lengths, None, "neg1", sorted_)
        lengths.copy_(new_lengths)
        logits.copy_(topk_logits(rows, width, 0.1, seed=4))
        graph.replay()
        torch.cuda.synchronize()
        assert_topk_valid(logits.cpu(), got.cpu(), 2048, lengths.cpu(), None, "neg1", sorted_)
        lengths.fill_(width)


@pytest.mark.parametrize("mode", ["split", "round"])
@pytest.mark.parametrize("rows", [1, 64, 1000, 4096, 8191])
def test_head_gate_gemm_deepseek_v32_size(rows, mode):
    """weights_proj of DeepSeek-V3.2: x [M, 7168] bf16, W [64, 7168] fp32, 4 splits (the pass's choice for K=7168).
    Partials against the torch reference on this GPU, their sum against the float64 model; every element written
    (each size's tiles: decode's, prefill's 32- and 128-row ones with a last partial tile)."""
    from nsa_inductor.lowering.head_gate_gemm import reference

    _, round_weight = WEIGHT_MODES[mode]
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 7168, generator=gen).bfloat16().to(DEV)
    weight = (torch.randn(64, 7168, generator=gen) * 7168**-0.5).to(DEV)
    out = torch.full((4, rows, 64), float("nan"), device=DEV)
    got = _tk("head_gate_gemm").head_gate_gemm(x, weight, 4, round_weight, out=out)
    assert_rows_close(got, reference.head_gate_gemm(x, weight, 4, round_weight))
    total = torch.ops.nsa.head_gate_gemm(x, weight, 4, round_weight).sum(0, keepdim=True)
    assert_rows_close(total, head_gate_partials64(x, weight, 1, round_weight))


def test_head_gate_gemm_captures_in_cuda_graph():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(64, 7168, generator=gen).bfloat16().to(DEV)
    weight = torch.randn(64, 7168, generator=gen).to(DEV)
    torch.ops.nsa.head_gate_gemm(x, weight, 4, False)  # compile the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        partials = torch.ops.nsa.head_gate_gemm(x, weight, 4, False)
    x.copy_(torch.randn(64, 7168, generator=gen).bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(partials, torch.ops.nsa.head_gate_gemm(x, weight, 4, False))


@pytest.mark.parametrize("mode", ["split", "round", "bf16"])
@pytest.mark.parametrize("rows", [1, 5, 8, 64, 256, 4096])
def test_wk_gate_gemm_deepseek_v32_size(rows, mode):
    """wk [128, 7168] bf16 and weights_proj [64, 7168] in one launch, the pass's split counts for these rows:
    partials against the torch reference on this GPU, sums against the float64 model, every element written; the K
    sum rounded to bf16 against cuBLAS's ``F.linear(x, wk)``: a few values one bf16 ulp apart (summation order)."""
    from nsa_inductor.lowering.wk_gate_gemm import reference
    from nsa_inductor.patterns.wk_gate_gemm import splits_for

    dtype, round_weight = WEIGHT_MODES[mode]
    gate_splits, k_splits = splits_for(rows, 7168)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 7168, generator=gen).bfloat16().to(DEV)
    gate_weight = (torch.randn(64, 7168, generator=gen) * 7168**-0.5).to(dtype).to(DEV)
    k_weight = (torch.randn(128, 7168, generator=gen) * 7168**-0.5).bfloat16().to(DEV)
    out = (torch.full((gate_splits, rows, 64), float("nan"), device=DEV),
           torch.full((k_splits, rows, 128), float("nan"), device=DEV))
    got = _tk("wk_gate_gemm").wk_gate_gemm(x, gate_weight, k_weight, gate_splits, k_splits, round_weight, out=out)
    want = reference.wk_gate_gemm(x, gate_weight, k_weight, gate_splits, k_splits, round_weight)
    for g, w in zip(got, want):  # the reference's fp32 GEMM sums in cuBLAS's order: 3e-5 of a row's norm
        assert_rows_close(g, w, rtol=3e-5)
    assert_rows_close(got[0].sum(0, keepdim=True), head_gate_partials64(x, gate_weight, 1, round_weight))
    assert_rows_close(got[1].sum(0, keepdim=True), head_gate_partials64(x, k_weight, 1, False))
    k = got[1].sum(0).bfloat16().float()
    cublas = torch.nn.functional.linear(x, k_weight).float()
    ulp = 2.0 ** (torch.frexp(cublas.abs().clamp(min=1e-30))[1].float() - 8)
    # one bf16 ulp, or (where the sum cancels to a small result) fp32 rounding of the summands' magnitudes
    magnitude = torch.nn.functional.linear(x.float().abs(), k_weight.float().abs())
    assert ((k - cublas).abs() <= torch.maximum(ulp, magnitude * 2.0**-16)).all(), "more than one bf16 ulp from cuBLAS"
    assert float((k != cublas).float().mean()) <= 0.05


def test_wk_gate_gemm_captures_in_cuda_graph():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(64, 7168, generator=gen).bfloat16().to(DEV)
    gate_weight = torch.randn(64, 7168, generator=gen).to(DEV)
    k_weight = torch.randn(128, 7168, generator=gen).bfloat16().to(DEV)
    call = (gate_weight, k_weight, 8, 16, False)
    torch.ops.nsa.wk_gate_gemm(x, *call)  # compile the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gates, keys = torch.ops.nsa.wk_gate_gemm(x, *call)
    x.copy_(torch.randn(64, 7168, generator=gen).bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    want = torch.ops.nsa.wk_gate_gemm(x, *call)
    assert torch.equal(gates, want[0]) and torch.equal(keys, want[1])


def _k_side_then_logits(inputs, side_stream: bool, join: bool, delay: int = 0):
    """The decode step's K side (projections, then the store of the new tokens) and the logits reading both, with
    the K side on the side stream held back by ``delay`` cycles: a reader that does not join sees the old cache."""
    from nsa_inductor.lowering import _streams

    x, gate_w, wk_w, cache, slots, q, lens, table = inputs
    if delay:
        side = _streams._side(x.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(delay)
    gate_p, k_p = torch.ops.nsa.wk_gate_gemm(x, gate_w, wk_w, 2, 2, False, stream="fork" if side_stream else "current")
    torch.ops.nsa.quant_cache_store(k_p, cache, slots, 64, False, "ue8m0", FN, round_k=True, k_split_sum=True,
                                    stream="side" if side_stream else "current")
    return torch.ops.nsa.paged_mqa_logits(q, cache, gate_p, lens, table, 128, 64, False, join_side_stream=join)


def _k_side_inputs(gen):
    batch = 8
    lens = torch.randint(1, 129, (batch,), generator=gen, dtype=torch.int32)
    table = torch.randperm(2 * batch, generator=gen).int().view(batch, 2)
    slots = (table.long().gather(1, ((lens - 1) // 64)[:, None].long())[:, 0] * 64 + (lens - 1) % 64)
    return [t.to(DEV) for t in (torch.randn(batch, 512, generator=gen).bfloat16(), torch.randn(64, 512, generator=gen),
                                torch.randn(128, 512, generator=gen).bfloat16(), random_cache(2 * batch, 64, FN, gen),
                                slots, random_fp8((batch, 1, 64, 128), FN, gen), lens, table)]


def test_the_k_side_on_the_side_stream_is_joined_by_the_logits():
    """Called eagerly the flagged ops run on the current stream (a held-back side stream does not delay them). In a
    CUDA graph (replayed with new activations) the K side runs on the side stream: with the join, logits and cache
    equal the one-stream run's; with the join after the logits (the check can fail) they do not."""
    from nsa_inductor.lowering import _streams

    gen = torch.Generator().manual_seed(11)
    inputs = _k_side_inputs(gen)
    copies = [[t.clone() for t in inputs] for _ in range(2)]
    want = _k_side_then_logits(copies[0], side_stream=False, join=False)
    eager = _k_side_then_logits(copies[1], side_stream=True, join=False, delay=10**7)
    torch.cuda.synchronize()
    assert torch.equal(eager, want) and torch.equal(copies[1][3], copies[0][3])

    new_x = torch.randn(8, 512, generator=gen).bfloat16().to(DEV)
    reference = [t.clone() for t in inputs]
    reference[0].copy_(new_x)
    want = _k_side_then_logits(reference, side_stream=False, join=False)
    replayed = {}
    for join in (True, False):
        graph_inputs = [t.clone() for t in inputs]
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = _k_side_then_logits(graph_inputs, side_stream=True, join=join, delay=10**6)
            if not join:
                _streams.join_side_stream(new_x.device)  # after the logits: a capture must end joined
        for t, source in zip(graph_inputs, inputs):
            t.copy_(source)
        graph_inputs[0].copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        replayed[join] = logits, graph_inputs[3]
    assert torch.equal(replayed[True][0], want) and torch.equal(replayed[True][1], reference[3])
    assert not torch.equal(replayed[False][0], want), "a reader that does not join saw the K side's results anyway"


def test_ops_capture_in_cuda_graph():
    gen = torch.Generator().manual_seed(5)
    page_size, heads, batch = 64, 64, 4
    cache = torch.zeros(batch * 4, page_size * 132, dtype=torch.uint8, device=DEV)
    block_table = torch.arange(batch * 4, dtype=torch.int32, device=DEV).view(batch, 4)
    k = torch.randn(batch, 128, generator=gen).bfloat16().to(DEV)
    slots = torch.tensor([0, 300, 600, 900], device=DEV)
    ctx = torch.tensor([1, 45, 46, 200], dtype=torch.int32, device=DEV)
    q = random_fp8((batch, 1, heads, 128), FN, gen).to(DEV)
    weights = torch.randn(batch, heads, generator=gen).to(DEV)
    cu = torch.tensor([0, 1, 46, 92, 292], dtype=torch.int32, device=DEV)
    ks, ke = torch.zeros(batch, dtype=torch.int32, device=DEV), ctx.clone()

    def step():
        torch.ops.nsa.quant_cache_store(k, cache, slots, page_size, False, "ue8m0")
        k8, k_scale = torch.ops.nsa.gather_k(cache, block_table, cu, page_size, False, 300)
        paged = torch.ops.nsa.paged_mqa_logits(q, cache, weights, ctx, block_table, 256, page_size, False)
        ragged = torch.ops.nsa.mqa_logits(q[:, 0], k8, k_scale, weights, ks, ke)
        return paged, ragged

    for _ in range(3):  # compile the kernels outside the capture; the third call replays host plans
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # each op in full (no plan is replayed while a graph is captured)
        paged, ragged = step()
    k.copy_(torch.randn(batch, 128, generator=gen).bfloat16())
    ctx.copy_(torch.tensor([0, 64, 130, 255], dtype=torch.int32))
    ke.copy_(ctx)
    graph.replay()
    torch.cuda.synchronize()
    want_paged, want_ragged = step()
    assert torch.equal(paged, want_paged)
    assert torch.equal(ragged, want_ragged)


def _rotation_rows(rows: int, gen) -> torch.Tensor:
    """q/k-like rows of varied magnitude, plus rows whose +-1 sums are exact in any order (the last all -0.0: a
    GEMM sums it to +0)."""
    varied = torch.randn(rows, 128, generator=gen) * torch.logspace(-3, 3, rows)[:, None]
    negative_zeros = torch.full((1, 128), -0.0, dtype=torch.bfloat16)
    return torch.cat([varied.bfloat16(), integer_rows(63, gen), negative_zeros]).to(DEV)


# docs/numerics.md, fused rotation: a general matrix's 2^-17 truncation is relative to the products summed, so a sum
# near 0 in a row of large values may move by more than a step of the grid there (measured: 2 subnormal steps)
GENERAL_ROTATION_ERROR_BELOW_ONE = 2.0**-6


@pytest.mark.parametrize("rows", [1, 64, 512, 4096, 16384, 32768])
@pytest.mark.parametrize("matrix", ["hadamard", "hadamard_bf16", "random_fp32"])
@pytest.mark.parametrize("dtype", _native_fp8_types())
def test_rotate_act_quant_against_the_cublas_reference(rows, matrix, dtype):
    """DeepSeek decode sizes (B x 64 heads rows) and a prefill's (from ``PRESPLIT_MIN_ROWS`` rows the fp32 rotation
    is split once before the launch): within the rotation contract of the reference on the same GPU (a cuBLAS fp32
    GEMM); rows with exact sums bit-identical; outputs fully written."""
    gen = torch.Generator().manual_seed(rows)
    x = _rotation_rows(rows, gen)
    h = hadamard_matrix(128) if matrix != "random_fp32" else torch.randn(128, 128, generator=gen) / 11
    h = (h.bfloat16() if matrix == "hadamard_bf16" else h).to(DEV)
    fmax = float(torch.finfo(dtype).max)
    args = (h, 128**-0.5, False, 128, "ue8m0", dtype, fmax)
    got = _tk("rotate_act_quant").rotate_act_quant(x, *args)
    want = _op_ref("rotate_act_quant").rotate_act_quant(x, *args)
    loose = matrix == "random_fp32"
    assert_fp8_close(got, want, values_frac=1e-2 if loose else 1e-4, scales_frac=2e-2 if loose else 1e-3,
                     error_below_one=GENERAL_ROTATION_ERROR_BELOW_ONE if loose else None)
    if not loose:
        exact = slice(rows, None)
        assert torch.equal(got[0][exact].view(torch.uint8), want[0][exact].view(torch.uint8))
        assert torch.equal(got[1][exact], want[1][exact])


@pytest.mark.parametrize("matrix", ["hadamard", "random_fp32"])
def test_rotate_act_quant_rotation_split_once_gives_the_same_bytes(matrix):
    """A prefill's q with its RoPE: the fp32 rotation split once before the launch gives the bytes of the split in
    every program for a +-1 Hadamard (the same bf16 planes and dot); for another matrix (both dots, the hi one summed
    onto the lo one's result, a tile's loop of the second launch) the same within the rotation's contract."""
    gen = torch.Generator().manual_seed(3)
    x = _rotation_rows(300 * 64 - 64, gen).view(300, 64, 128)
    h = hadamard_matrix(128) if matrix == "hadamard" else torch.randn(128, 128, generator=gen) / 11
    args = (h.to(DEV), 128**-0.5, False, 128, "ue8m0", FN, 448.0, *_rope_tables(300, 64, gen), False)
    once = _tk("rotate_act_quant").rotate_act_quant(x, *args, presplit=True)
    each = _tk("rotate_act_quant").rotate_act_quant(x, *args, presplit=False)
    if matrix == "hadamard":
        assert torch.equal(once[0].view(torch.uint8), each[0].view(torch.uint8))
        assert torch.equal(once[1].view(torch.int32), each[1].view(torch.int32))
    else:
        nan = each[1].isnan().squeeze(-1)  # (tokens at positions outside the tables)
        assert torch.equal(once[1].isnan().squeeze(-1), nan) and nan.any()
        assert_fp8_close((once[0][~nan], once[1][~nan]), (each[0][~nan], each[1][~nan]), values_frac=1e-2,
                         scales_frac=2e-2)


@pytest.mark.parametrize("block_t", [None, 1, 2])
def test_quant_cache_store_rotation_prologue_against_reference(block_t):
    """The k side: the store's rotation prologue and ``/ sqrt(128)`` epilogue within the contract, untouched bytes
    kept, exact rows bit-identical; the launcher's tiles (dot tiles of 16 at this size), one token and two tokens a
    program (the fp32 row path)."""
    gen = torch.Generator().manual_seed(5)
    k = _rotation_rows(1000, gen)
    layout = KCacheLayout(64)
    slots = torch.randperm(64 * 40, generator=gen)[: k.shape[0]].to(DEV)
    slots[7] = -1
    cache = torch.randint(0, 256, (40, layout.page_bytes), dtype=torch.uint8, generator=gen).to(DEV)
    want = cache.clone()
    args = ("ue8m0", FN, 128**0.5, torch.bfloat16, True, hadamard_matrix(128).to(DEV))
    _tk("quant_cache_store").quant_cache_store(k, cache, slots, 64, False, *args, block_t=block_t)
    _op_ref("quant_cache_store").quant_cache_store(k, want, slots, 64, False, *args)
    keep = slots[slots >= 0]
    assert_fp8_close(layout.load(cache, keep, FN), layout.load(want, keep, FN), values_frac=1e-4, scales_frac=1e-3)
    exact = slots[1000:]
    assert torch.equal(cache.view(-1)[layout.value_offsets(exact)], want.view(-1)[layout.value_offsets(exact)])
    written = torch.zeros(cache.numel(), dtype=torch.bool, device=DEV)
    written[layout.value_offsets(keep).flatten()] = True
    written[layout.scale_offsets(keep).flatten()] = True
    assert torch.equal(cache.view(-1)[~written], want.view(-1)[~written])


def _rope_tables(tokens: int, rope_dim: int, gen):
    """Tables as strided views of one ``[P, 2, rope_dim/2]`` buffer, positions with a wrapped one (-1) and two
    outside the tables (NaN rows)."""
    from nsa_inductor.indexer import rope_cos_sin

    table = rope_cos_sin(rope_dim, 4096, 10000.0).to(DEV)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    positions[:3] = torch.tensor([-1, 4096, -4097])[:tokens]
    return table[:, 0], table[:, 1], positions.to(DEV)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tokens, heads, block_m", [(1, 64, None), (64, 64, None), (300, 64, None), (7, 3, 2)])
def test_rotate_act_quant_rope_prologue_bit_exact(interleaved, tokens, heads, block_m):
    """The RoPE prologue computes eager's bf16 rows bit for bit on the GPU (products rounded alone: ``mul.rn``):
    with the identity as rotation every output is one product, so the fp8 bytes and scales equal the reference's
    (torch's RoPE kernels on the same GPU); the row path and the dot tiles."""
    gen = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, heads, 128, generator=gen) * 4).bfloat16().to(DEV)
    args = (torch.eye(128, device=DEV), 1.0, False, 128, "fp32", FN, 448.0, *_rope_tables(tokens, 64, gen), interleaved)
    got = _tk("rotate_act_quant").rotate_act_quant(x, *args, block_m=block_m)
    want = _op_ref("rotate_act_quant").rotate_act_quant(x, *args)
    nan = want[0].float().isnan()
    assert torch.equal(got[0].float().isnan(), nan) and torch.equal(got[1].isnan(), want[1].isnan())
    assert torch.equal(got[0].view(torch.uint8)[~nan], want[0].view(torch.uint8)[~nan])
    assert torch.equal(got[1].nan_to_num(), want[1].nan_to_num())


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotation, round_k", [(None, False), (None, True), ("hadamard", True)])
def test_quant_cache_store_rope_prologue_against_reference(interleaved, rotation, round_k):
    """The store's RoPE prologue on bf16 rows or fp32 rows it rounds first (``round_k``): bit-exact alone (no
    rotation), within the rotation's contract before a Hadamard; untouched bytes kept."""
    gen = torch.Generator().manual_seed(8)
    k = (torch.randn(500, 128, generator=gen) * 4).to(DEV)
    k = k if round_k else k.bfloat16()
    layout = KCacheLayout(64)
    slots = torch.randperm(64 * 10, generator=gen)[:500].to(DEV)
    cache = torch.randint(0, 256, (10, layout.page_bytes), dtype=torch.uint8, generator=gen).to(DEV)
    want = cache.clone()
    matrix = None if rotation is None else hadamard_matrix(128).to(DEV)
    args = ("ue8m0", FN, 1.0 if matrix is None else 128**-0.5, torch.bfloat16, False, matrix,
            *_rope_tables(500, 64, gen), interleaved, round_k)
    _tk("quant_cache_store").quant_cache_store(k, cache, slots, 64, False, *args)
    _op_ref("quant_cache_store").quant_cache_store(k, want, slots, 64, False, *args)
    written = torch.zeros(cache.numel(), dtype=torch.bool, device=DEV)
    written[layout.value_offsets(slots).flatten()] = True
    written[layout.scale_offsets(slots).flatten()] = True
    assert torch.equal(cache.view(-1)[~written], want.view(-1)[~written])
    (got_v, got_s), (want_v, want_s) = layout.load(cache, slots, FN), layout.load(want, slots, FN)
    nan = want_s.isnan()
    assert torch.equal(got_s.isnan(), nan) and int(nan.sum()) == 2
    if matrix is None:
        assert torch.equal(got_v[~nan].view(torch.uint8), want_v[~nan].view(torch.uint8))
        assert torch.equal(got_s[~nan], want_s[~nan])
    else:
        assert_fp8_close((got_v[~nan], got_s[~nan]), (want_v[~nan], want_s[~nan]), values_frac=1e-3, scales_frac=1e-2)


@pytest.mark.parametrize("splits", [0, 16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_quant_cache_store_layer_norm_prologue_is_atens(tokens, splits):
    """The LayerNorm prologue normalises each row in ATen's CUDA order: the fp32 rows and so the cache bytes equal
    the reference's (``F.layer_norm`` on the GPU, then the same rounding, RoPE and quantization), rows of one token a
    program and 16-token tiles, wide dynamic range, a constant row (variance 0); with ``splits``, the rows are the
    rounded sum of split-K partials (``k_split_sum``: summed in the kernel in the reference's order)."""
    gen = torch.Generator().manual_seed(9)
    scale = torch.exp(2 * torch.randn(tokens, 1, generator=gen))
    k = (torch.randn(tokens, 128, generator=gen) + torch.randn(tokens, 1, generator=gen)) * scale
    k[0] = 3.0
    k = k.bfloat16().float()  # as the indexer's: wk's bf16 rows in fp32
    if splits:
        k = (k[None] + torch.randn(splits, tokens, 128, generator=gen) * scale) / splits
    k = k.to(DEV)
    weight = (1 + 0.1 * torch.randn(128, generator=gen)).to(DEV)
    bias = (0.1 * torch.randn(128, generator=gen)).to(DEV)
    layout = KCacheLayout(64)
    slots = torch.randperm(64 * 10, generator=gen)[:tokens].to(DEV)
    cache = torch.randint(0, 256, (10, layout.page_bytes), dtype=torch.uint8, generator=gen).to(DEV)
    want = cache.clone()
    args = ("ue8m0", FN, 1.0, torch.bfloat16, False, None, *_rope_tables(tokens, 64, gen), True, True, weight, bias,
            1e-6, splits > 0)
    _tk("quant_cache_store").quant_cache_store(k, cache, slots, 64, False, *args)
    _op_ref("quant_cache_store").quant_cache_store(k, want, slots, 64, False, *args)
    assert torch.equal(cache, want)


def test_rotation_ops_capture_in_cuda_graph():
    """Both rotation paths replay in a CUDA graph with new inputs (no host sync, no data-dependent allocation)."""
    gen = torch.Generator().manual_seed(6)
    h = hadamard_matrix(128).to(DEV)
    x = torch.randn(8, 64, 128, generator=gen).bfloat16().to(DEV)
    k = torch.randn(8, 128, generator=gen).bfloat16().to(DEV)
    cache = torch.zeros(4, 64 * 132, dtype=torch.uint8, device=DEV)
    slots = torch.tensor([0, 3, -1, 64, 65, 200, 255, 7], device=DEV)

    def step():
        torch.ops.nsa.quant_cache_store(k, cache, slots, 64, False, "ue8m0", FN, 128**-0.5, torch.bfloat16, False, h)
        return torch.ops.nsa.rotate_act_quant(x, h, 128**-0.5, False, 128, "ue8m0", FN, 448.0)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        values, scales = step()
    x.copy_(torch.randn(8, 64, 128, generator=gen).bfloat16())
    k.copy_(torch.randn(8, 128, generator=gen).bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    replayed = cache.clone()
    want_values, want_scales = step()
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8)) and torch.equal(scales, want_scales)
    assert torch.equal(replayed, cache)


def _bad_ids(limit: int, count: int, gen) -> torch.Tensor:
    """In-range ids, the edges of [-limit, limit) and far outside, shuffled."""
    edges = torch.tensor([-(2**31), -limit - 1, -limit, -1, limit, limit + 1, 10**9, 2**31 - 1])
    ids = torch.cat([edges, torch.randint(-2 * limit, 2 * limit, (count,), generator=gen)])
    return ids[torch.randperm(ids.numel(), generator=gen)]


@pytest.mark.parametrize("tagged", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_quant_cache_store_writes_only_inside_the_cache(layout, tagged):
    """docs/indices.md on the device: out-of-range slots write nothing, the bytes around the cache stay as they were
    (the last tokens found by the scan or by tags)."""
    from nsa_inductor.lowering.quant_cache_store import reference

    page_size, preshuffle = layout
    gen = torch.Generator().manual_seed(11)
    num_pages = 4
    slots = _bad_ids(num_pages * page_size, 200, gen).unique()  # unique: duplicates are another test's subject
    slots = slots[torch.randperm(slots.numel(), generator=gen)].to(DEV)
    k = (torch.randn(slots.numel(), 128, generator=gen) * 3).bfloat16().to(DEV)
    cache = Guarded((num_pages, page_size * 132), torch.uint8, gen, device=DEV)
    want = cache.view.clone()
    reference.quant_cache_store(k, want, slots, page_size, preshuffle, "ue8m0", FN)
    _tk("quant_cache_store").quant_cache_store(k, cache.view, slots, page_size, preshuffle, "ue8m0", FN, tagged=tagged)
    torch.cuda.synchronize()
    cache.assert_guards_intact()
    assert torch.equal(cache.view, want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_k_and_paged_logits_read_only_inside_the_cache(layout):
    """Block tables full of unreadable ids, cu_seqlens not starting at 0: results as the reference gives them (guard
    bytes never show up), no byte around the cache or the outputs written."""
    from nsa_inductor.lowering.gather_k import reference as gather_ref
    from nsa_inductor.lowering.paged_mqa_logits import reference as paged_ref

    page_size, preshuffle = layout
    gen = torch.Generator().manual_seed(12)
    num_pages, batch, max_pages = 6, 4, 5
    cache = Guarded((num_pages, page_size * 132), torch.uint8, gen, device=DEV,
                    fill=random_paged_cache([1], page_size, FN, gen, spare_pages=num_pages - 1)[0].to(DEV))
    table = _bad_ids(num_pages, batch * max_pages, gen)[: batch * max_pages].view(batch, max_pages).int().to(DEV)
    ctx = torch.tensor([0, 3, max_pages * page_size, max_pages * page_size + 9], dtype=torch.int32, device=DEV)
    q = random_fp8((batch, 1, 32, 128), FN, gen).to(DEV)
    weights = torch.randn(batch, 32, generator=gen).to(DEV)
    max_len = max_pages * page_size + 40
    out = Guarded((batch, max_len), torch.float32, gen, device=DEV)
    args = (q, cache.view, torch.randn(4, batch, 32, generator=gen).to(DEV), ctx, table, max_len, page_size,
            preshuffle, weights, 0.0884)  # the weights as split-K partials, a factor and a number
    got = _tk("paged_mqa_logits").paged_mqa_logits(*args, out=out.view)
    assert_logits_close(got, paged_ref.paged_mqa_logits(*args), rtol=1e-3)

    cu = torch.tensor([3, 10, 10, 40, 60], dtype=torch.int32, device=DEV)
    n = 64
    out_k, out_scale = Guarded((n, 128), torch.uint8, gen, device=DEV), Guarded((n,), torch.float32, gen, device=DEV)
    k, scale = _tk("gather_k").gather_k(cache.view, table, cu, page_size, preshuffle, n, FN,
                                        out=(out_k.view.view(FN), out_scale.view))
    want_k, want_scale = gather_ref.gather_k(cache.view, table, cu, page_size, preshuffle, n, FN)
    torch.cuda.synchronize()
    for guarded in (cache, out, out_k, out_scale):
        guarded.assert_guards_intact()
    assert torch.equal(k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(scale.view(torch.int32), want_scale.view(torch.int32))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [FN, FNUZ])
@pytest.mark.parametrize("by_sequence", [False, True])
def test_gather_k_slots_exact_and_inside_the_cache(layout, dtype, by_sequence):
    """An engine prefill's worth of tokens (8192 and an odd tail) by slot or by (sequence, position), ids in range,
    wrapping and far outside: the reference's bytes in every output element (the outputs start as random bytes),
    nothing read or written outside the cache and the outputs."""
    page_size, preshuffle = layout
    gen = torch.Generator().manual_seed(14)
    num_pages, n = 40, 8192 + 37
    cache = Guarded((num_pages, page_size * 132), torch.uint8, gen, device=DEV,
                    fill=random_cache(num_pages, page_size, dtype, gen).to(DEV))
    if by_sequence:
        batch, max_pages = 8, 6
        table = _bad_ids(num_pages, batch * max_pages, gen)[: batch * max_pages].view(batch, max_pages).int()
        extra = (table.to(DEV), _bad_ids(batch, n, gen)[:n].int().to(DEV))
        positions = _bad_ids(max_pages * page_size, n, gen)[:n].to(DEV)
    else:
        extra, positions = (), _bad_ids(num_pages * page_size, n, gen)[:n].to(DEV)
    out_k, out_scale = Guarded((n, 128), torch.uint8, gen, device=DEV), Guarded((n,), torch.float32, gen, device=DEV)
    k, scale = _tk("gather_k_slots").gather_k_slots(cache.view, positions, page_size, preshuffle, dtype, *extra,
                                                    out=(out_k.view.view(dtype), out_scale.view))
    want_k, want_scale = _op_ref("gather_k_slots").gather_k_slots(cache.view, positions, page_size, preshuffle,
                                                                  dtype, *extra)
    torch.cuda.synchronize()
    for guarded in (cache, out_k, out_scale):
        guarded.assert_guards_intact()
    assert torch.equal(k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(scale.view(torch.int32), want_scale.view(torch.int32))


@pytest.mark.parametrize("tagged", [False, True])
@pytest.mark.parametrize("dtype", _native_fp8_types())
def test_quant_cache_store_duplicates_and_nan_as_the_reference(dtype, tagged):
    """Many tokens per slot (the last one's values and scale land, found by the scan or by tags), rows with NaN and
    +-inf (NaN stays NaN, as the type's NaN code), -0.0 values (the sign kept: their bytes compared, not their
    values)."""
    from nsa_inductor.layout import KCacheLayout
    from nsa_inductor.lowering.quant_cache_store import reference

    gen = torch.Generator().manual_seed(13)
    k = torch.randn(4096, 128, generator=gen) * torch.logspace(-3, 3, 4096)[:, None]
    k[::97, 5], k[::89, 9], k[::83, 11] = float("nan"), float("inf"), float("-inf")
    k[::7, 20:30] = -0.0
    k = k.to(DEV)
    slots = torch.randint(0, 300, (4096,), generator=gen).to(DEV)
    cache = torch.zeros(300 // 64 + 1, 64 * 132, dtype=torch.uint8, device=DEV)
    want = cache.clone()
    reference.quant_cache_store(k, want, slots, 64, False, "ue8m0", dtype)
    _tk("quant_cache_store").quant_cache_store(k, cache, slots, 64, False, "ue8m0", dtype, tagged=tagged)
    layout, every = KCacheLayout(64), torch.arange(300, device=DEV)
    (got_v, got_s), (want_v, want_s) = layout.load(cache, every, dtype), layout.load(want, every, dtype)
    torch.testing.assert_close(got_s, want_s, equal_nan=True, rtol=0, atol=0)
    nan = want_v.float().isnan()
    assert torch.equal(got_v.float().isnan(), nan) and nan.any()
    assert (got_v.view(torch.uint8)[nan] == (0x7F if dtype == torch.float8_e4m3fn else 0x80)).all()
    assert torch.equal(got_v.view(torch.uint8)[~nan], want_v.view(torch.uint8)[~nan])
    assert (want_v.view(torch.uint8) == 0x80).any() or dtype != torch.float8_e4m3fn  # -0.0 stored as -0


@pytest.mark.parametrize("tagged", [False, True])
@pytest.mark.parametrize("block_t", [4, 16])
def test_quant_cache_store_prefill_slots_with_late_duplicates(block_t, tagged):
    """A prefill's increasing slots over 8192 tokens (the scan skips the blocks that cannot hold a duplicate) with a
    few tokens repeating a slot of a much earlier one: the earliest programs scan the most of the mapping and tend to
    finish last, so a duplicate the scan missed would likely let the earlier token's bytes land last. Tiles of 4 (no
    rotation) and 16 (the rotation's prefill tiles); the last tokens found by the scan and by tags (the default from
    ``TAGGED_MIN_TOKENS``)."""
    from nsa_inductor.lowering.quant_cache_store import reference

    gen = torch.Generator().manual_seed(17)
    tokens = 8192
    k = (torch.randn(tokens, 128, generator=gen) * 3).bfloat16().to(DEV)
    slots = torch.arange(tokens) + 64
    slots[::251] = -1
    late = torch.tensor([8000, 7000, 5000, 4100, 1030, 70])
    slots[late] = slots[torch.tensor([1, 2, 3, 1500, 4, 65])]
    slots = slots.to(DEV)
    cache = torch.randint(0, 256, (tokens // 64 + 2, 64 * 132), dtype=torch.uint8, generator=gen).to(DEV)
    want = cache.clone()
    reference.quant_cache_store(k, want, slots, 64, False, "ue8m0", FN)
    _tk("quant_cache_store").quant_cache_store(k, cache, slots, 64, False, "ue8m0", FN, block_t=block_t,
                                               tagged=tagged)
    assert torch.equal(cache, want)


def _filled(a):
    """A case's argument on the GPU with random values (index tensors as they are)."""
    if not isinstance(a, torch.Tensor):
        return a
    if a.dtype in (torch.float32, torch.bfloat16):
        return torch.randn(a.shape, device=DEV).to(a.dtype)
    if a.dtype in (FN, FNUZ):
        return torch.randn(a.shape, device=DEV).clamp(-400, 400).to(a.dtype)
    if a.dtype == torch.uint8:  # a K cache: bytes below 0x78, so positive finite fp8 values and scales
        return torch.randint(0, 0x78, a.shape, dtype=torch.uint8, device=DEV)
    return a.to(DEV)


def _past_visible_keys(args: list, width: int) -> torch.Tensor:
    """Where paged logits past each row's last visible key lie (row ``b*next_n+j`` sees ``s <= ctx_b - next_n + j``)."""
    next_n, context_lens = args[0].shape[1], args[3]
    last = context_lens.long()[:, None] - next_n + torch.arange(next_n, device=context_lens.device)[None, :]
    return torch.arange(width, device=context_lens.device)[None, :] > last.reshape(-1, 1)


@pytest.mark.parametrize("case", list(OP_CALLS))
def test_replayed_calls_equal_the_ops_own(case, monkeypatch):
    """Host plans (lowering/_host_plans.py): from its third call a signature replays its plan; each replay's outputs
    and written arguments equal, bit for bit, what the op itself computes from the same arguments (top-k rows as
    sets in set order; paged logits without ``write_masked`` up to each row's last visible key)."""
    host_plans.clear()  # (another test of this worker may have called the signature already)
    replays = []
    replay = host_plans.Plan.replay
    monkeypatch.setattr(host_plans.Plan, "replay", lambda plan, a: replays.append(1) or replay(plan, a))
    for _ in range(4):
        op, args = OP_CALLS[case]()
        args = [_filled(a) for a in args]
        again = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        got = op(*args)
        with monkeypatch.context() as m:
            m.setattr(host_plans, "run", lambda name, body, a: body(*a))  # the op in full
            want = op(*again)
        _assert_same_call(case, op, args, got, again, want)
    assert len(replays) == 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
@pytest.mark.parametrize("case", list(OP_CALLS))
def test_calls_run_on_their_tensors_gpu_not_the_current_one(case):
    """With GPU 0 current, a call on GPU 1's tensors runs on GPU 1 (``nsa_op``'s device guard): its outputs and
    written arguments equal, bit for bit, the same call's on GPU 0, in full and replayed (from its third call).
    Without the guard Triton launches on GPU 0, on GPU 1's memory. (The arguments reach GPU 1 from the host: no
    peer access is enabled that could let such a launch pass.)"""
    host_plans.clear()
    op, args = OP_CALLS[case]()
    args = [_filled(a).cpu() if isinstance(a, torch.Tensor) else a for a in args]
    on_0 = [_to(a, "cuda:0") for a in args]
    want = _to(op(*on_0), "cpu")
    on_0 = [_to(a, "cpu") for a in on_0]
    with torch.cuda.device(0):
        for _ in range(3):
            on_1 = [_to(a, "cuda:1") for a in args]
            got = _to(op(*on_1), "cpu")
            assert torch.cuda.current_device() == 0
            _assert_same_call(case, op, [_to(a, "cpu") for a in on_1], got, on_0, want)


def _to(x, device):
    """``x`` (a tensor, a tuple of them and None, or another argument) on ``device``."""
    if isinstance(x, tuple):
        return tuple(_to(o, device) for o in x)
    return x.to(device) if isinstance(x, torch.Tensor) else x


def _assert_same_call(case, op, args, got, again, want):
    """Outputs ``got`` and written ``args`` of one call equal ``want`` and ``again`` of another, bit for bit (top-k
    rows as sets in set order; paged logits without ``write_masked`` up to each row's last visible key)."""
    outputs = [(g, w) for g, w in zip(*((o if isinstance(o, tuple) else (o,)) for o in (got, want)))]
    outputs += [(g, w) for g, w in zip(args, again) if isinstance(g, torch.Tensor)]  # what it wrote
    for g, w in outputs:
        if g is None:
            continue
        if "top-k" in case and g.dtype == torch.int32 and g.shape == w.shape and not args[5:6] == [True]:
            g, w = g.sort(dim=-1).values, w.sort(dim=-1).values
        if op is torch.ops.nsa.paged_mqa_logits and args[11:] == [False] and g is got:  # past the visible keys: unset
            g, w = (x.masked_fill(_past_visible_keys(args, x.shape[1]), 0.0) for x in (g, w))
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), case
