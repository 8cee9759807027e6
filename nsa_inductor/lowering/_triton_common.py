"""``@triton.jit`` helpers the ops' Triton kernels share (imported only on the GPU path and by tests).

The cache is passed to the kernels twice: viewed as fp8 for the values and as fp32 for the scales, so byte offsets
of DESIGN §3 become element offsets (a scale's byte offset is always a multiple of 4). A token is 128 fp8 values
and a 4-byte scale: 132 bytes, 33 fp32 words; these sizes are literals in the kernels. Every launcher writes every
element of its outputs and never reads a device value on the host, so all of them are CUDA-graph safe.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..capability import capability
from ..layout import HEAD_DIM
from ..quant import AMAX_FLOOR, fp8_max
from . import _host_plans as host_plans

try:
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # a Triton without its NVIDIA backend: programmatic launches are never on there
    gdc_wait = None

_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of host ints, for launch grids: ``triton.cdiv`` is a constexpr function, whose host calls
    cost microseconds each (argument unwrapping), on every op call."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (>= 1), without ``triton.next_power_of_2``'s per-call cost."""
    return 1 << max(n - 1, 0).bit_length()


def interpreted(kernel) -> bool:
    """True under TRITON_INTERPRET=1, where kernels run in numpy on the host."""
    return not isinstance(kernel, triton.runtime.JITFunction)


_INT32 = range(-(2**31), 2**31)
_CUDA_AVAILABLE = torch.cuda.is_available()  # else (a CPU-only machine compiling kernels ahead of time) Triton's launch
# (id of the kernel, device, argument key, keywords) -> the kernel (kept alive: its id stays its own), Triton's
# compiled kernel, the launcher to call and the arguments it takes before the kernel's, the constexpr tail
_LAUNCHES: dict[tuple, tuple] = {}
# Triton versions whose launcher object was read (backends/nvidia/driver.py, CudaLauncher.__call__): it allocates the
# kernel's scratch, then calls its C function with (grid, stream, function, cooperative, pdl, global scratch,
# profile scratch, ...); for a kernel without scratch the fast path calls that C function itself
_DIRECT_LAUNCHER_TRITON = ("3.6.",)


def _launch_arguments(args: tuple) -> tuple[tuple, list]:
    """``(key, values)``. ``key``: what Triton specialises a launch on, per runtime argument: a tensor's dtype and
    16-byte alignment (and its device: a CPU tensor never reaches the fast path, Triton's launch rejects it); an
    int's type (i32 or wider), whether it is 1 and whether 16 divides it; a float's type; anything else by value.
    ``values``: the arguments as Triton's launcher takes them, a tensor as its address (given a tensor, the launcher
    calls its ``data_ptr`` and asks the driver about the pointer, ``cuPointerGetAttribute``, on every launch).
    Exact types first: ``isinstance`` chains cost microseconds a launch."""
    key, values = [], []
    for a in args:
        if type(a) is torch.Tensor:
            address = a.data_ptr()
            key.append((a.dtype, a.get_device(), not address & 15))
            values.append(address)
        elif type(a) is int:
            key.append((a in _INT32, a < 2**63, a == 1, not a & 15))
            values.append(a)
        else:
            item, value = _other_launch_argument(a)
            key.append(item)
            values.append(value)
    return tuple(key), values


def _other_launch_argument(a) -> tuple[object, object]:
    if isinstance(a, torch.Tensor):
        address = a.data_ptr()
        return (a.dtype, a.get_device(), not address & 15), address
    if isinstance(a, bool):
        return (bool, a), a
    if isinstance(a, int):
        return (a in _INT32, a < 2**63, a == 1, not a & 15), a
    return float if isinstance(a, float) else a, a


def _launcher(compiled) -> tuple:
    """``(function, arguments)``: what a fast-path launch calls, and the arguments that go between the stream and
    function and the kernel metadata. Triton's launcher object; on the versions in ``_DIRECT_LAUNCHER_TRITON`` and
    for a kernel without scratch, the C function it calls (its Python call costs about a µs: a closure, two
    allocation checks, the arguments packed again)."""
    run = compiled.run
    if (triton.__version__.startswith(_DIRECT_LAUNCHER_TRITON) and type(run).__name__ == "CudaLauncher"
            and not run.global_scratch_size and not run.profile_scratch_size):
        return run.launch, (run.launch_cooperative_grid, run.launch_pdl, None, None)
    return run, ()


def _hook(chain):
    """A launch hook as Triton's C launcher should get it: ``None`` for none, also for an empty chain (Triton's hooks
    are ``HookChain`` objects, which the launcher would call, twice a launch, to do nothing)."""
    return None if chain is None or not getattr(chain, "calls", True) else chain


@functools.cache
def _programmatic_launch() -> bool:
    return capability().programmatic_launch


@functools.cache
def warp_threads() -> int:
    return capability().warp_threads


def launch(kernel, grid: tuple, *args, **keywords) -> None:
    """``kernel[grid](*args, **keywords)``, at a fraction of the host cost from the second call of a signature.

    Why: Triton binds and specialises every argument and builds its cache key on every launch (tens of µs of host
    time a launch on the H200 machine, on every step of a serving loop; BENCHMARKS.md, host cost). The key here holds
    what Triton specialises on (``_launch_arguments``, the keywords: constexprs and launch options), so a repeated key
    runs the kernel Triton compiled for its first call, through Triton's own launcher (``_launcher``) with this
    call's arguments (tensors as addresses) and Triton's launch hooks. CUDA only: ROCm's Triton also specialises on
    buffer sizes; the interpreter takes Triton's path too. The module constants a kernel reads are taken as fixed for
    the process (Triton's path rejects a changed one; this one does not look). Where
    ``capability().programmatic_launch`` holds, every kernel is a programmatic dependent launch (Triton's
    ``launch_pdl``, and the kernel's ``PDL`` for ``wait_for_previous_grid``). While an op call's host plan is
    recorded (``_host_plans``), each launch is told to it; one through Triton's own path spoils it."""
    if _programmatic_launch() and not interpreted(kernel):
        keywords["PDL"] = keywords["launch_pdl"] = True
    recording = host_plans.recording()
    if interpreted(kernel) or torch.version.hip is not None or not _CUDA_AVAILABLE:
        if recording is not None:
            recording.fail("a launch through Triton's own path")
        kernel[grid](*args, **keywords)
        return
    device = torch.cuda.current_device()
    arguments, values = _launch_arguments(args)
    key = (id(kernel), device, arguments, tuple(keywords.items()))  # (hashing a JITFunction takes a lock)
    known = _LAUNCHES.get(key)
    if known is None:
        if recording is not None:
            recording.fail("a launch through Triton's own path")
        compiled = kernel[grid](*args, **keywords)
        params = kernel.params[len(args):]
        if all(p.is_constexpr for p in params):  # else a runtime argument came by keyword: not a fixed tail
            if len(_LAUNCHES) >= 4096:
                _LAUNCHES.clear()
            tail = tuple(keywords[p.name] if p.name in keywords else p.default for p in params)
            _LAUNCHES[key] = (kernel, compiled, *_launcher(compiled), compiled.function, compiled.packed_metadata,
                              tail)
        return
    _, compiled, run, before, function, metadata, tail = known
    grid = (*grid, 1, 1)[:3]
    stream = torch._C._cuda_getCurrentRawStream(device)
    runtime = triton.knobs.runtime
    enter, leave = _hook(runtime.launch_enter_hook), _hook(runtime.launch_exit_hook)
    described = None if enter is None and leave is None else compiled.launch_metadata(
        grid, stream, *args, *tail)  # what a hook (a profiler) is told
    if recording is not None:
        recording.launch(run, before, function, metadata, grid, device, launch_hooks_set, args, values, tail)
    run(grid[0], grid[1], grid[2], stream, function, *before, metadata, described, enter, leave, *values, *tail)


def launch_hooks_set() -> bool:
    """Whether a Triton launch hook is set (a chain that calls something)."""
    runtime = triton.knobs.runtime
    return _hook(runtime.launch_enter_hook) is not None or _hook(runtime.launch_exit_hook) is not None


@triton.jit
def wait_for_previous_grid(PDL: tl.constexpr):
    """First in every kernel. With PDL (launched as a programmatic dependent launch, Hopper and later): waits until
    the stream's previous kernel has finished and its writes are visible. Why: such a launch may start as the previous
    kernel's last programs exit, before its completion is signalled, so a step's chain of short kernels loses the gap
    between them (BENCHMARKS.md, programmatic launches). Nothing may be read or written before the wait. No kernel
    lets its successor start earlier than its own end (``gdc_launch_dependents``): that made sorted steps slower."""
    if PDL:
        gdc_wait()


def empty_k_rows(num_tokens: int, fp8_dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs of the K gathers: ``(k_fp8 [num_tokens, 128], k_scale [num_tokens])``."""
    return (torch.empty(num_tokens, HEAD_DIM, dtype=fp8_dtype, device=device),
            torch.empty(num_tokens, dtype=torch.float32, device=device))


@triton.jit
def wrapped_index(index, ok, size):
    """An id as eager's indexing reads it, and where it may be read (docs/indices.md): ids in ``[-size, 0)`` wrap
    like Python indices, ids outside ``[-size, size)`` are not read. Only for loads masked with ``ok``."""
    index = tl.where(index < 0, index + size, index)
    return index, ok & (index >= 0) & (index < size)


@triton.jit
def readable_index(index, ok, size):
    """``wrapped_index`` with the ids that may not be read replaced by 0, for addresses also used unmasked (the
    paged logits kernel keeps the unclamped id: the clamp slowed it, BENCHMARKS.md "Paged logits: the page check")."""
    index, ok = wrapped_index(index, ok, size)
    return tl.where(ok, index, 0), ok


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
    """fp32 -> nearest bf16 (ties to even), kept in fp32. Compiled for a GPU: the hardware conversion (one
    instruction; BENCHMARKS.md "Hardware roundings"); interpreted: integer arithmetic on the bits, the same rounding,
    as the interpreter's own bf16 cast rounds differently. NaN stays NaN (its payload may differ)."""
    if ON_GPU:
        rounded = x.to(tl.bfloat16).to(tl.float32)
    else:
        bits = x.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        rounded = tl.where(x != x, x, rounded)
    return rounded


# Kernels are compiled for a GPU (also ahead of time on a CPU-only machine), not run by the interpreter: the one switch
# between the device's instructions and their emulations that the interpreter tests check against torch
ON_GPU = tl.constexpr(not interpreted(round_to_bf16))


@triton.jit
def load_split_sum(ptrs, mask, other, split_stride, SPLITS: tl.constexpr):
    """The values at ``ptrs``; with ``SPLITS``, ``ptrs`` address the first of that many fp32 split-K partials,
    ``split_stride`` elements apart: their sum left to right (the pointwise adds ``p[0] + p[1] + ...``) rounded to
    bf16 and kept in fp32, as a bf16 GEMM's output read back with ``.float()``."""
    x = tl.load(ptrs, mask=mask, other=other)
    if SPLITS:
        for s in tl.static_range(1, SPLITS):
            x += tl.load(ptrs + s * split_stride.to(tl.int64), mask=mask, other=other)
        x = round_to_bf16(x)
    return x


@triton.jit
def round_to_fp8_grid(y, sign_of, MIN_EXP: tl.constexpr, SIGNED_ZERO: tl.constexpr):
    """Round fp32 ``y`` (already within +-fmax) to the nearest e4m3 value, ties to even, still in fp32.

    The fp8 cast after it is then exact on every backend, so the bytes do not depend on how a backend rounds
    (the Triton interpreter's own cast truncates and drops carries). e4m3 keeps 3 mantissa bits: the grid step is
    ``2^(e-3)`` with ``e`` the exponent of ``y``, floored at the smallest normal exponent ``MIN_EXP``
    (subnormals). Adding and subtracting 1.5 * 2^23 rounds a float below 2^22 to an integer, ties to even.
    fnuz has no negative zero (its 0x80 is NaN), hence ``SIGNED_ZERO``. The sign comes from ``sign_of`` (the
    unscaled input: the scale is positive) and is set as a bit: a GPU clamp or negation may turn -0.0 into +0.0.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign_negative = sign_of.to(tl.int32, bitcast=True) < 0
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXP)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((3 - e + 127) << 23).to(tl.float32, bitcast=True)
    r = ((tl.abs(y) * inv_step + 12582912.0) - 12582912.0) * step
    if SIGNED_ZERO:
        negative = sign_negative
    else:
        negative = sign_negative & (r > 0.0)
    return (r.to(tl.int32, bitcast=True) | (negative.to(tl.int32) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def quantize_rows(x, FP8: tl.constexpr, FMAX: tl.constexpr, INV_FMAX: tl.constexpr, UE8M0: tl.constexpr,
                  MIN_EXP: tl.constexpr, SIGNED_ZERO: tl.constexpr, NAN_CODE: tl.constexpr, CUDA_ISA: tl.constexpr):
    """act_quant of each row of fp32 ``x [R, block]``: ``(values FP8, scale [R])``; a row holding NaN gets a NaN
    scale and NaN values (``NAN_CODE``), as the torch reference.

    Bit-identical to the torch reference (``quant.act_quant``) on the same device: torch on a GPU computes
    ``amax / fmax`` as ``amax * (1/fmax)`` (scalar divisor) and log2/exp2 with the device math library
    (libdevice/ocml); on the host (interpreter) it divides exactly. ``x / scale`` is an IEEE division in both; a
    ue8m0 scale is a power of two whose reciprocal is exact, so ``x * (1 / scale)`` rounds the same real number and
    gives the same bits without a division per value (BENCHMARKS.md "Quantization without a division per value").
    Where the row maximum and the clamp keep NaN (``max.NaN``, ``min.NaN``), no value is tested for it on the GPU.
    """
    amax = _max_keeping_nan(tl.reduce(tl.abs(x), 1, _max_keeping_nan), _AMAX_FLOOR)
    if ON_GPU:
        scale = amax * INV_FMAX
    else:
        scale = tl.math.div_rn(amax, FMAX)
    if UE8M0:
        if ON_GPU:
            scale = libdevice.exp2(tl.math.ceil(libdevice.log2(scale)))
        else:
            scale = tl.exp2(tl.math.ceil(tl.log2(scale)))
    if UE8M0:
        quotient = x * tl.math.div_rn(1.0, scale)[:, None]
    else:
        quotient = tl.math.div_rn(x, scale[:, None])
    clamped = tl.clamp(quotient, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
    if CUDA_ISA and SIGNED_ZERO and MIN_EXP == -6:
        # e4m3fn: the hardware's rounding; the clamp keeps a NaN (GPUs make it +NaN, converted to NAN_CODE) and the
        # sign of a zero
        values = clamped.to(FP8)
    else:
        # the interpreter's fp8 cast turns NaN into other bits
        bits = round_to_fp8_grid(clamped, x, MIN_EXP, SIGNED_ZERO).to(FP8).to(tl.uint8, bitcast=True)
        values = tl.where(quotient != quotient, NAN_CODE, bits).to(tl.uint8).to(FP8, bitcast=True)
    return values, scale


@triton.jit
def scale_rows(y, SCALE: tl.constexpr, INV_SCALE: tl.constexpr, DIVIDE: tl.constexpr):
    """``y * SCALE``, or ``y / SCALE`` with ``DIVIDE`` as torch divides by a Python float on the same device: on a
    GPU ``y * INV_SCALE`` (fp32 ``1/SCALE``), on the host (interpreter) an IEEE division."""
    if DIVIDE:
        if ON_GPU:
            y = y * INV_SCALE
        else:
            y = tl.math.div_rn(y, SCALE)
    elif SCALE != 1.0:
        y = y * SCALE
    return y


@functools.cache
def scale_constants(scale: float, divide: bool) -> dict:
    """The constexpr arguments of :func:`scale_rows` (once per scale: numpy's fp32 division costs microseconds per
    launch; callers unpack the dict, never change it)."""
    return {"SCALE": float(scale), "INV_SCALE": float(np.float32(1.0) / np.float32(scale)), "DIVIDE": bool(divide)}


@functools.cache
def quantize_constants(fp8_dtype: torch.dtype, fmax: float | None, scale_fmt: str) -> dict:
    """The constexpr arguments of :func:`quantize_rows` for one fp8 type, clamp bound (``None``: the type's own
    largest value) and scale format (once each: finfo and numpy cost microseconds per call; callers unpack the dict,
    never change it). (``fp8_max`` itself stays uncached: Dynamo traces it in act_quant, and warns on caches.)"""
    fmax = fp8_max(fp8_dtype) if fmax is None else fmax
    return {"FMAX": fmax, "INV_FMAX": float(np.float32(1.0) / np.float32(fmax)), "UE8M0": scale_fmt == "ue8m0",
            "MIN_EXP": 1 - (8 if fp8_dtype == torch.float8_e4m3fnuz else 7),
            "SIGNED_ZERO": fp8_dtype == torch.float8_e4m3fn,
            "NAN_CODE": 0x7F if fp8_dtype == torch.float8_e4m3fn else 0x80}  # e4m3fn: 0x7F; fnuz: its only NaN


@triton.jit
def split_bf16(w):
    """fp32 ``w`` as two bf16 values (kept in fp32) whose sum is exact in fp32, ~16 significant bits of ``w``:
    ``hi`` = w with its low 16 bits cleared, ``lo`` = bf16(w - hi) (nearest even). A bf16 ``w`` has ``lo = 0``."""
    hi = (w.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
    return hi, round_to_bf16(w - hi)


@triton.jit
def dot_bf16(acc, a, b):
    """``acc + a @ b`` for operands whose values are bf16: a bf16 dot on GPUs; under the interpreter (its dot
    multiplies bf16 tiles as the integers they are stored in) an exact fp32 dot of the same values."""
    if ON_GPU:
        acc = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return acc


@triton.jit
def dot_upcast(a, b):
    """``a @ b`` in fp32 of bf16 or fp16 tiles (their products are exact in fp32): their own dot on GPUs; under the
    interpreter (see ``dot_bf16``) an exact fp32 dot of their values."""
    if ON_GPU:
        return tl.dot(a, b)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def mul_rn(a, b, CUDA_ISA: tl.constexpr):
    """``a * b`` rounded on its own, as eager's separate multiply kernel: with ``CUDA_ISA`` PTX's ``mul.rn``, which
    is never contracted into an FMA with the add after it; else a plain product (interpreter: exact; ROCm: the
    compiler may contract it, as it may Inductor's own RoPE)."""
    if CUDA_ISA:
        return libdevice.mul_rn(a, b)
    return a * b


def cuda_isa(kernel) -> bool:
    """The ``CUDA_ISA`` argument of a launch of ``kernel``: compiled for an NVIDIA GPU, whose own instructions
    (``mul.rn``, the e4m3fn conversion) replace their emulations. Read per launch, not at import, so that the
    ahead-of-time compile test decides it per target."""
    return not interpreted(kernel) and torch.version.hip is None


def rope_arguments(x: torch.Tensor, rows: int, rope_cos, rope_sin, positions) -> tuple:
    """The runtime arguments of :func:`rope_rows` (after the kernel's own): ``positions``, the table rows, rows of
    ``x`` per token, the tables and their strides; any pointer and zeros without tables."""
    if rope_cos is None:
        return (x, 0, 1, x, x, 0, 0, 0, 0)
    return (positions, rope_cos.shape[0], max(rows // max(positions.shape[0], 1), 1), rope_cos, rope_sin,
            *rope_cos.stride(), *rope_sin.stride())


@triton.jit
def _halves(x):
    """``[R, 2m]`` as its lanes ``[0, m)`` and ``[m, 2m)``, each ``[R, m]`` (no arithmetic: a permutation)."""
    rows: tl.constexpr = x.shape[0]
    m: tl.constexpr = x.shape[1] // 2
    return tl.split(tl.permute(tl.reshape(x, [rows, 2, m]), [0, 2, 1]))


@triton.jit
def _welford_update(mean, m2, v, inv_n):
    """ATen's ``cuWelfordOnlineSum`` step with value ``v`` as the n-th (``inv_n = 1/n``): ``delta * (1/n)`` and the
    m2 product fused into FMAs, as nvcc compiles it."""
    delta = v - mean
    mean = tl.fma(delta, inv_n, mean)
    return mean, tl.fma(delta, v - mean, m2)


@triton.jit
def _welford_combine(own_mean, own_m2, own_n, other_mean, other_m2, other_n):
    """ATen's ``cuWelfordCombine(own, other)`` (``1/n`` then products, nvcc's FMA contractions; counts > 0)."""
    delta = own_mean - other_mean
    n = other_n + own_n
    coef = 1.0 / n
    share_other = other_n * coef
    share_own = own_n * coef
    mean = tl.fma(share_other, other_mean, share_own * own_mean)
    m2 = tl.fma(delta * delta * other_n, share_own, other_m2 + own_m2)
    return mean, m2, n


@triton.jit
def layer_norm_rows(x, w_ptr, b_ptr, eps):
    """``F.layer_norm`` of fp32 rows ``x [BLOCK, 128]`` with fp32 weight and bias, in the order of ATen's CUDA kernel
    (``vectorized_layer_norm_kernel``: lane t of one warp runs Welford over ``x[4t:4t+4]``, the 32 lanes combine by
    halves, the other warps add nothing, ``rsqrtf(m2 / 128 + eps)``, ``w * (rstd * (x - mean)) + b`` as an FMA);
    returns ``(y, mean, rstd)``, the last two per row."""
    rows: tl.constexpr = x.shape[0]
    even, odd = tl.split(tl.reshape(x, [rows, 32, 2, 2]))  # lane t's values 4t, 4t+2 and 4t+1, 4t+3
    v0, v2 = tl.split(even)
    v1, v3 = tl.split(odd)
    zero = tl.zeros([rows, 32], tl.float32)
    mean, m2 = _welford_update(zero, zero, v0, 1.0)
    mean, m2 = _welford_update(mean, m2, v1, 0.5)
    mean, m2 = _welford_update(mean, m2, v2, 1.0 / 3.0)
    mean, m2 = _welford_update(mean, m2, v3, 0.25)
    n = zero + 4.0
    for _ in tl.static_range(5):  # shfl_down by 16, 8, 4, 2, 1: lane i takes lane i + offset's
        own_mean, other_mean = _halves(mean)
        own_m2, other_m2 = _halves(m2)
        own_n, other_n = _halves(n)
        mean, m2, n = _welford_combine(own_mean, own_m2, own_n, other_mean, other_m2, other_n)
    mean = tl.reshape(mean, [rows]) + 0.0  # the combines with the empty warps: -0 -> +0
    var = (tl.reshape(m2, [rows]) + 0.0) / 128.0
    if ON_GPU:
        rstd = libdevice.rsqrt(var + eps)
    else:
        rstd = 1.0 / tl.sqrt(var + eps)
    d = tl.arange(0, 128)
    return normalized(x, mean, rstd, tl.load(w_ptr + d), tl.load(b_ptr + d)), mean, rstd


@triton.jit
def normalized(x, mean, rstd, w, b):
    """LayerNorm's last step for rows ``x [BLOCK, 128]`` with per-row ``mean``, ``rstd`` and per-lane ``w``, ``b``:
    ``w * (rstd * (x - mean)) + b`` as one FMA, ATen's order."""
    return tl.fma(w[None, :], rstd[:, None] * (x - mean[:, None]), b[None, :])


@triton.jit
def rope_rows(x, row_ptr, ok, token, token_ok, pos_ptr, n_positions, cos_ptr, sin_ptr, stride_cp, stride_cj,
              stride_sp, stride_sj, ln_mean, ln_rstd, ln_w_ptr, ln_b_ptr, split_stride, ROPE_DIM: tl.constexpr,
              INTERLEAVED: tl.constexpr, LAYER_NORM: tl.constexpr, ROUND_PARTNER: tl.constexpr, CUDA_ISA: tl.constexpr,
              SPLITS: tl.constexpr):
    """Rows ``x [BLOCK, 128]`` (loaded from ``row_ptr [BLOCK]`` where ``ok``) with eager's RoPE on their first
    ``ROPE_DIM`` lanes, rounded to bf16 (kept in fp32): lane pairs (i, i + ROPE_DIM/2), or (2i, 2i+1) when
    ``INTERLEAVED``, turn by the angle of pair i at ``positions[token]``: ``x*cos - partner*sin`` for a pair's first
    lane, ``x*cos + partner*sin`` for its second, each product rounded (``mul_rn``). ``token``, ``token_ok``: [BLOCK],
    or [1] where every row is of one token (its tables are then loaded once, not per row). A position outside the
    tables (after Python wrapping: ``wrapped_index``) is not read and gives NaN. Interleaved partners are taken from
    ``x`` itself; the others are loaded again (a lane 32 away lies in another thread): ``LAYER_NORM``: the rows in
    memory are before :func:`layer_norm_rows` (``x`` is after it): the partners are normalised as loaded, by the rows'
    ``ln_mean`` and ``ln_rstd``. ``ROUND_PARTNER``: the rows are fp32 in memory, rounded to bf16 as loaded (``x``
    already is). ``SPLITS``: the rows in memory are split-K partials (:func:`load_split_sum`), summed as loaded."""
    rows: tl.constexpr = x.shape[0]
    d = tl.arange(0, 128)
    half: tl.constexpr = ROPE_DIM // 2
    lane = d < ROPE_DIM
    if INTERLEAVED:
        pair, first = d // 2, d % 2 == 0
    else:
        pair, first = d % half, d < half
    pos = tl.load(pos_ptr + token, mask=token_ok, other=0).to(tl.int64)
    pos, readable = wrapped_index(pos, token_ok, n_positions)
    mask = readable[:, None] & lane[None, :]
    cos = tl.load(cos_ptr + pos[:, None] * stride_cp + pair[None, :] * stride_cj, mask=mask, other=float("nan"))
    sin = tl.load(sin_ptr + pos[:, None] * stride_sp + pair[None, :] * stride_sj, mask=mask, other=float("nan"))
    sin = tl.where(first[None, :], -sin, sin)  # x*cos + partner*(-sin): the first lane's difference, exactly
    x = x.to(tl.float32)
    if INTERLEAVED:
        even, odd = tl.split(tl.reshape(x, [rows, 64, 2]))
        other = tl.reshape(tl.join(odd, even), [rows, 128])
    else:
        partner = tl.where(first, d + half, d - half)
        other = load_split_sum(row_ptr[:, None] + partner[None, :], ok[:, None] & lane[None, :], 0.0, split_stride,
                               SPLITS).to(tl.float32)
        if LAYER_NORM:
            other = normalized(other, ln_mean, ln_rstd, tl.load(ln_w_ptr + partner), tl.load(ln_b_ptr + partner))
        if ROUND_PARTNER:
            other = round_to_bf16(other)
    turned = mul_rn(x, cos, CUDA_ISA) + mul_rn(other, sin, CUDA_ISA)
    return tl.where(lane[None, :], round_to_bf16(turned), x)


ROTATION_PLANE = tl.constexpr(128 * 128)  # elements of a bf16 plane of a split rotation (`rotate_rows`' SPLIT 2, 3)


@triton.jit
def rotate_rows(x, rot_ptr, stride_rk, stride_rn, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """``x [BLOCK, 128] (bf16 values) @ R [128, 128]`` accumulated in fp32. ``R`` is read through its strides: a
    transposed view (``F.linear``'s weight) is not copied.

    Tiles under 16 rows (decode: one or two rows a program) multiply in fp32, row by row: the whole fp32 ``R``, the
    products as eager's fp32 GEMM forms them, summed in a tree (+0.0 after it: an all-zero row sums to +0 as in a
    GEMM, not to -0). Larger tiles use ``tl.dot``, which needs 16 rows: an fp32 ``R`` (``SPLIT`` 1) enters as bf16
    ``hi + lo`` (:func:`split_bf16`: R to ~16 bits; two dots, one where every ``lo`` is 0, as in a +-1 Hadamard), a
    bf16 one (``SPLIT`` 0) as is. ``SPLIT`` 2 and 3: the fp32 ``R`` split once ahead of the launch (``rot_ptr``: the
    bf16 planes hi, lo and a flag, nonzero where any ``lo`` is, as ``rotate_act_quant``'s ``split_rotation`` writes
    them; tiles of 16+), the same values and dots without each program loading and splitting the fp32 matrix, for a
    caller that has read the flag: 2 where it is clear (the hi dot alone), 3 where it is set (both, the hi one summed
    onto the lo one's result). The small tiles are the faster path in decode (BENCHMARKS.md "The rotation's small
    tiles")."""
    d = tl.arange(0, 128)
    acc = tl.zeros([BLOCK, 128], dtype=tl.float32)
    plane = d[:, None] * 128 + d[None, :]
    if SPLIT >= 2:
        tl.static_assert(BLOCK >= 16)
        if SPLIT == 3:  # the lo dot first, the hi one summed onto it (Triton fuses their sum so on GPUs anyway)
            acc = dot_bf16(acc, x, tl.load(rot_ptr + ROTATION_PLANE + plane))
            acc = tl.where(acc != acc, 0.0, acc)  # an inf in x times lo's zeros is NaN where eager's product is inf
        return dot_bf16(acc, x, tl.load(rot_ptr + plane)) + 0.0  # (+0.0: -0 -> +0 as in a GEMM's sum)
    r = tl.load(rot_ptr + d[:, None] * stride_rk + d[None, :] * stride_rn).to(tl.float32)
    if BLOCK < 16:
        row = tl.arange(0, BLOCK)[:, None]
        x = x.to(tl.float32)
        for i in tl.static_range(BLOCK):
            xi = tl.sum(tl.where(row == i, x, 0.0), axis=0)  # row i as a column vector
            acc = tl.where(row == i, (tl.sum(xi[:, None] * r, axis=0) + 0.0)[None, :], acc)
        return acc
    if SPLIT == 0:
        return dot_bf16(acc, x, r)
    hi, lo = split_bf16(r)
    acc = dot_bf16(acc, x, hi)
    if tl.sum((lo != 0.0).to(tl.int32), axis=None) > 0:
        low = dot_bf16(tl.zeros([BLOCK, 128], dtype=tl.float32), x, lo)
        acc += tl.where(low != low, 0.0, low)  # an inf in x times lo's zeros is NaN where eager's product is inf
    else:
        acc += 0.0  # as the zeros' dot would add (-0 -> +0)
    return acc
