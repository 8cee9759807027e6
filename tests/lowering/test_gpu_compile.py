"""Every Triton kernel compiles for the GPUs the package serves, from this CPU machine: sm_90 (H200, fp8 e4m3fn) and
gfx942 (MI300, fp8 e4m3fnuz, the ROCm layout). Each launcher is called at the indexer's sizes with its launches
recorded instead of run; every distinct specialisation is then compiled ahead of time (``triton.compile`` down to
a cubin / hsaco). The interpreter tests check the kernels' results but not what only a GPU compiler rejects:
layouts, dot shapes, types a target lacks, more shared memory than a program may hold (a kernel that then fails to
load). Not a run on either GPU: gfx942 has only been compiled for."""

from __future__ import annotations

import importlib
from unittest import mock

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from nsa_inductor import lowering  # noqa: E402
from nsa_inductor.indexer import hadamard_matrix  # noqa: E402
from nsa_inductor.layout import KCacheLayout  # noqa: E402
from nsa_inductor.lowering import _triton_common as common  # noqa: E402

TARGETS = {"sm_90": (GPUTarget("cuda", 90, 32), torch.float8_e4m3fn, False),
           "gfx942": (GPUTarget("hip", "gfx942", 64), torch.float8_e4m3fnuz, True)}
SHARED_BYTES = {"sm_90": 232448, "gfx942": 65536}  # shared memory a program may hold (a kernel past it fails to load)
POINTER_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
                 torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
                 torch.float8_e4m3fn: "fp8e4nv", torch.float8_e4m3fnuz: "fp8e4b8"}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "launch_pdl")


def _module(op: str):
    return importlib.import_module(f"nsa_inductor.lowering.{op}.triton")


def _kernels() -> set[str]:
    """Every kernel the ops' Triton modules define (the JIT functions named ``*_kernel``)."""
    return {name for op in lowering.__all__ for name, value in vars(_module(op)).items()
            if isinstance(value, JITFunction) and name.endswith("_kernel")}


def _calls(fp8: torch.dtype, preshuffle: bool):
    """(op, args, kwargs) at DeepSeek-V3.2 sizes: decode B = 1 and 64 (ctx 8192), the sizes where the launchers pick
    other tiles or paths, prefill T = 4096; the layout and fp8 type of the target's platform."""
    page = 64
    layout = KCacheLayout(page, preshuffle)
    ctx, pages = 8192, 8192 // page
    cache = layout.allocate(64 * ctx)
    rotation = hadamard_matrix(128)
    cos_sin = torch.zeros(4096, 2, 32)  # RoPE tables of the prologues below
    calls = []
    for batch in (1, 64):
        q = torch.zeros(batch, 1, 64, 128, dtype=fp8)
        table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
        lens = torch.full((batch,), ctx, dtype=torch.int32)
        for write_masked in (True, False):  # (False: as the decode step calls it, where the top-k is the only reader)
            calls.append(("paged_mqa_logits", (q, cache, torch.zeros(batch, 64), lens, table, ctx, page, preshuffle),
                          {"write_masked": write_masked}))
        k = torch.zeros(batch, 128, dtype=torch.bfloat16)
        slots = torch.arange(batch)
        calls.append(("quant_cache_store", (k, cache, slots, page, preshuffle, "ue8m0", fp8), {}))
        calls.append(("quant_cache_store", (k, cache, slots, page, preshuffle, "ue8m0", fp8, 128**0.5, torch.bfloat16,
                                            True, rotation), {}))
        x = torch.zeros(batch * 64, 128, dtype=torch.bfloat16)
        calls.append(("rotate_act_quant", (x, rotation, 128**-0.5, False, 128, "ue8m0", fp8,
                                           float(torch.finfo(fp8).max)), {}))
        # the RoPE prologue (neox on q, interleaved on k; the store rounding fp32 k first)
        rope = {"rope_cos": cos_sin[:, 0], "rope_sin": cos_sin[:, 1], "positions": torch.arange(batch)}
        calls.append(("rotate_act_quant", (x.view(batch, 64, 128), rotation, 128**-0.5, False, 128, "ue8m0", fp8,
                                           float(torch.finfo(fp8).max)), rope))
        calls.append(("quant_cache_store", (k.float(), cache, slots, page, preshuffle, "ue8m0", fp8, 128**-0.5,
                                            torch.bfloat16, False, rotation),
                      {**rope, "rope_interleaved": True, "round_k": True}))
        calls.append(("quant_cache_store", (k.float(), cache, slots, page, preshuffle, "ue8m0", fp8, 128**-0.5,
                                            torch.bfloat16, False, rotation),
                      {**rope, "rope_interleaved": True, "round_k": True, "ln_weight": torch.ones(128),
                       "ln_bias": torch.zeros(128), "ln_eps": 1e-6}))
        calls.append(("quant_cache_store", (k.float().expand(16, -1, -1).contiguous(), cache, slots, page, preshuffle,
                                            "ue8m0", fp8, 128**-0.5, torch.bfloat16, False, rotation),
                      {**rope, "rope_interleaved": True, "round_k": True, "ln_weight": torch.ones(128),
                       "ln_bias": torch.zeros(128), "ln_eps": 1e-6, "k_split_sum": True}))
    for rows, width in ((64, 8192), (8, 8192), (1, 32768), (64, 65536), (300, 8192), (200, 32768), (2048, 8192)):
        logits = torch.zeros(rows, width)
        lengths = torch.full((rows,), width, dtype=torch.int32)
        for pad, order in (("neg1", False), ("column", True)):
            calls.append(("topk_indices", (logits, 2048, lengths, None, pad, order), {}))
    calls.append(("topk_indices", (torch.zeros(64, 65536), 2048, None, None, "neg1", False), {}))  # (binned by window)
    tokens = 4096
    for write_masked in (True, False):
        calls.append(("mqa_logits", (torch.zeros(tokens, 64, 128, dtype=fp8), torch.zeros(tokens, 128, dtype=fp8),
                                     torch.zeros(tokens), torch.zeros(tokens, 64),
                                     torch.zeros(tokens, dtype=torch.int32),
                                     torch.arange(1, tokens + 1, dtype=torch.int32)), {"write_masked": write_masked}))
    x = torch.zeros(tokens, 64, 128, dtype=torch.bfloat16)  # prefill's q: 64-row dot tiles, with its RoPE
    rope = {"rope_cos": cos_sin[:, 0], "rope_sin": cos_sin[:, 1], "positions": torch.arange(tokens)}
    calls.append(("rotate_act_quant", (x, rotation, 128**-0.5, False, 128, "ue8m0", fp8, float(torch.finfo(fp8).max)),
                  rope))
    calls.append(("rotate_act_quant", (x, rotation, 128**-0.5, False, 128, "ue8m0", fp8, float(torch.finfo(fp8).max)),
                  {}))  # (without the RoPE's gathers the lo plane's loop pipelines its loads)
    calls.append(("quant_cache_store", (torch.zeros(tokens, 128), cache, torch.arange(tokens), page, preshuffle, "ue8m0",
                                        fp8, 128**-0.5, torch.bfloat16, False, rotation),
                  {**rope, "rope_interleaved": True, "round_k": True, "ln_weight": torch.ones(128),
                   "ln_bias": torch.zeros(128), "ln_eps": 1e-6}))  # prefill's k: tiles of 16, slots by tags
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    calls.append(("gather_k", (cache, torch.arange(pages, dtype=torch.int32)[None], cu, page, preshuffle, tokens, fp8),
                  {}))
    calls.append(("gather_k_slots", (cache, torch.arange(tokens), page, preshuffle, fp8), {}))
    for batch, rows, keys, scale in ((64, 1, 8192, None), (8, 2, 8192, torch.tensor(0.1)), (1, 4096, 4096, None)):
        for mask in (None, torch.ones(batch, 1, keys, dtype=torch.bool).expand(batch, rows, keys)):
            calls.append(("batched_mqa_logits", (torch.zeros(batch, rows, 64, 128, dtype=torch.bfloat16),
                                                 torch.zeros(batch, keys, 128, dtype=torch.bfloat16),
                                                 torch.zeros(batch, rows, 64), 128**-0.5, scale, mask), {}))
    for rows in (1, 64, 4096):
        x = torch.zeros(rows, 7168, dtype=torch.bfloat16)
        gate = torch.zeros(64, 7168)
        calls.append(("head_gate_gemm", (x, gate, 4, False), {}))
        calls.append(("wk_gate_gemm", (x, gate, torch.zeros(128, 7168, dtype=torch.bfloat16), 4, 4, False), {}))
    return calls


def _specialisations(fp8: torch.dtype, preshuffle: bool, hip: bool) -> dict:
    """{(kernel name, signature, constexprs, options): (kernel, signature, constexprs, options)} of every launch, as
    the launchers make them on that platform (``hip``: ``torch.version.hip`` set, as on ROCm; else an sm_90 GPU:
    programmatic dependent launches)."""
    found = {}

    def record(self, *args, grid, warmup, **kwargs):
        bound = dict(zip(self.arg_names, args)) | {k: v for k, v in kwargs.items() if k in self.arg_names}
        signature, constexprs = {}, {}
        for i, param in enumerate(self.params):
            value = bound.get(param.name, param.default)
            if param.is_constexpr or value is None:
                signature[param.name] = "constexpr"
                constexprs[(i,)] = value
            elif isinstance(value, torch.Tensor):
                signature[param.name] = "*" + POINTER_TYPES[value.dtype]
            elif isinstance(value, bool):
                signature[param.name] = "i1"
            elif isinstance(value, int):
                signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            else:
                signature[param.name] = "fp32"
        options = {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS}
        key = (self.__name__, tuple(signature.items()), tuple(sorted((k, str(v)) for k, v in constexprs.items())),
               tuple(sorted(options.items())))
        found.setdefault(key, (self, signature, constexprs, options))

    with (mock.patch.object(JITFunction, "run", record), mock.patch.object(torch.version, "hip", "6.3" if hip else None),
          mock.patch.object(common, "_CUDA_AVAILABLE", False),  # every launch through Triton's (recorded) run
          mock.patch.object(common, "_programmatic_launch", lambda: not hip)):
        for op, args, kwargs in _calls(fp8, preshuffle):
            getattr(_module(op), op)(*args, **kwargs)
    return found


@pytest.mark.parametrize("target_name", list(TARGETS))
def test_every_kernel_compiles_for_the_target(target_name):
    target, fp8, preshuffle = TARGETS[target_name]
    found = _specialisations(fp8, preshuffle, target.backend == "hip")
    assert {key[0] for key in found} == _kernels()  # every kernel launched by some call
    failures = []
    for key, (kernel, signature, constexprs, options) in found.items():
        # Tensor arguments 16-byte aligned, as the JIT specialises torch's allocations: the variant that runs (its
        # loads vectorise and pipeline; unaligned, they compile to byte loads).
        aligned = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind.startswith("*")}
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned),
                                      target=target, options=options)
        except Exception as error:  # noqa: BLE001 (collected: every failing specialisation is reported)
            failures.append(f"{key[0]} {dict(options)} {constexprs}: {type(error).__name__}: {str(error)[:300]}")
            continue
        if compiled.metadata.shared > SHARED_BYTES[target_name]:
            failures.append(f"{key[0]} {dict(options)} {constexprs}: {compiled.metadata.shared} bytes of shared memory")
    assert not failures, "\n".join(failures)
