"""What the ``nsa`` ops share on the host: argument checks, the choice of implementation, reference helpers.

Checks read metadata only, so the fakes run them too. Dispatch per call: CPU tensors (or no Triton) run the op's
``reference``; on ROCm with aiter enabled its ``aiter`` module where aiter can serve the call (``capability.
aiter_refusal`` decides from static facts: versions, gfx arch, layout, head count), else its ``triton`` module; on
other GPUs its ``triton`` module. Those two are imported on first use, never by ``import nsa_inductor``. The fnuz fp8
type has no Triton type on NVIDIA, so fnuz arithmetic there runs the reference (logged once); the gather is a byte
copy and stays on Triton for both fp8 types. The host cost of a call is paid on every step of a serving loop: the ops
are plain dispatcher kernels (``nsa_op``), on real tensors the checks run once per call signature
(``once_per_signature``), Triton kernels launch without Triton's per-call binding (``_triton_common.launch``), and
a signature's later calls replay its launches (``_host_plans``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging

import torch

from ..capability import aiter_refusal, capability
from ..index_contract import python_index
from ..indexer import apply_rope
from ..layout import HEAD_DIM, KCacheLayout
from ..quant import FP8_DTYPES
from . import _host_plans as host_plans

log = logging.getLogger("nsa_inductor")

INT_TYPES = (torch.int32, torch.int64)
# Ops that only copy fp8 bytes: Triton serves them for either fp8 type on every GPU.
BYTE_COPIES = ("gather_k", "gather_k_slots")

# Largest [rows, heads, keys] fp32 block the logits references materialise at once (1 GiB).
MAX_SCORE_ELEMENTS = 1 << 28


# ---------------------------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------------------------


def describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def check(name: str, t: torch.Tensor, shape: tuple, dtypes: tuple[torch.dtype, ...], what: str) -> None:
    """``shape`` entries of ``None`` match any size."""
    ok = t.dim() == len(shape) and all(want is None or got == want for got, want in zip(t.shape, shape))
    if not ok or t.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be {names} {what}, got {describe(t)}")


def check_rotation(rotation: torch.Tensor) -> None:
    """A rotation the kernels multiply rows of 128 by: ``[128, 128]`` fp32 or bf16, any strides."""
    check("rotation", rotation, (HEAD_DIM, HEAD_DIM), (torch.float32, torch.bfloat16), "[128, 128]")


def check_rope(x: torch.Tensor, rope_cos, rope_sin, positions, rows_dtype: torch.dtype | None = None) -> None:
    """A RoPE prologue on the first ``2 * rope_cos.shape[1]`` of each row of 128 of bf16 ``x`` (``rows_dtype``: the
    rows' dtype as the prologue sees them, when the op rounds ``x`` first), token ``t`` (x's first dim) at
    ``positions[t]``: all three tensors or none."""
    given = [t is not None for t in (rope_cos, rope_sin, positions)]
    if not any(given):
        return
    if not all(given):
        raise ValueError("rope_cos, rope_sin and positions come together (a RoPE prologue) or not at all")
    if (rows_dtype or x.dtype) != torch.bfloat16 or x.dim() < 2:
        raise ValueError(f"a RoPE prologue rotates bf16 rows [T, ..., 128], got {describe(x)}")
    check("rope_cos", rope_cos, (None, None), (torch.float32,), "[positions, rope_dim // 2]")
    if not 0 < rope_cos.shape[1] <= HEAD_DIM // 2:
        raise ValueError(f"rope_cos must have 1 to {HEAD_DIM // 2} columns (half the rotated lanes), got "
                         f"{describe(rope_cos)}")
    check("rope_sin", rope_sin, tuple(rope_cos.shape), (torch.float32,), f"{list(rope_cos.shape)} (as rope_cos)")
    check("positions", positions, (x.shape[0],), INT_TYPES, f"[T={x.shape[0]}] (one position per token of x)")


def check_layout(cache: torch.Tensor, page_size: int, preshuffle: bool) -> KCacheLayout:
    layout = KCacheLayout(page_size, preshuffle)
    check("cache", cache, (None, layout.page_bytes), (torch.uint8,), f"[num_pages, {layout.page_bytes}] for {layout}")
    if not cache.is_contiguous():
        raise ValueError(f"cache must be contiguous, got {describe(cache)} with strides {list(cache.stride())}")
    return layout


def check_fp8(name: str, dtype: torch.dtype) -> None:
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{name} must be one of {FP8_DTYPES}, got {dtype}")


def check_devices(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def contiguous(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.contiguous() for t in tensors]


def once_per_signature(validate):
    """``validate`` (an op's argument checks) that runs once per call signature on real tensors: shapes, dtypes,
    devices, contiguity and the other arguments. The checks read nothing else, so a call that repeats a signature
    (every step of a serving loop) is known to pass and skips them. Fake and other subclass tensors (the fake
    impl, under tracing: symbolic shapes) are always checked in full."""
    seen: dict[tuple, None] = {}

    @functools.wraps(validate)
    def checked(*args) -> None:
        key = tuple([(a.shape, a.dtype, a.device, a.is_contiguous()) if type(a) in host_plans.PLAIN_TENSORS else a
                     for a in args])
        try:
            if key in seen:
                return
        except TypeError:  # a symbolic size (tracing) is not hashable: checked in full, never kept
            validate(*args)
            return
        validate(*args)
        if any(isinstance(a, torch.Tensor) for a in key):  # a subclass (fake) tensor stays in the key: not kept
            return
        host_plans.remember(seen, key, None)

    return checked


_LIBRARY = torch.library.Library("nsa", "DEF")  # kept alive: a registration lasts as long as its Library


class NsaOp:
    """``torch.ops.nsa.<name>`` as :func:`nsa_op` registered it: call it like the op, give it a fake with
    ``register_fake``."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        return getattr(torch.ops.nsa, self.name)(*args, **kwargs)

    def register_fake(self, fake):
        torch.library.register_fake(f"nsa::{self.name}", fake, lib=_LIBRARY)
        return fake


def nsa_op(name: str, mutates_args: tuple[str, ...] = ()):
    """Register the decorated function as ``torch.ops.nsa.<name>`` (schema from its annotations, as
    ``torch.library.custom_op`` infers it), the kernel of its CPU and CUDA (ROCm too) dispatch keys.

    Why not ``torch.library.custom_op``: its Python layers (an autograd wrapper, a Dynamo-disabled frame, output
    alias checks, an ADInplaceOrView kernel that rebuilds the argument list per mutated argument) cost the host more
    than the Triton launch itself on every call of a serving loop (BENCHMARKS.md, host cost). A plain dispatcher
    kernel is what remains; it replays a repeated call signature's host plan (``_host_plans``) and bumps the version
    counter of each argument in ``mutates_args`` once per call, as custom_op does. On CUDA it runs with the first
    argument's GPU as the current device, as ATen's kernels do: Triton launches on the current device and its stream,
    so a call on another GPU than the current one would launch there, on another device's memory, unordered with
    that device's stream."""
    def register(fn) -> NsaOp:
        _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        body = fn
        mutated = [(i, p) for i, p in enumerate(inspect.signature(fn).parameters) if p in mutates_args]
        if mutated:
            def body(*args, **kwargs):
                with torch._C._AutoDispatchBelowADInplaceOrView():  # the body's own writes bump nothing
                    return fn(*args, **kwargs)

        @functools.wraps(fn)
        def kernel(*args, **kwargs):
            out = body(*args, **kwargs) if kwargs else host_plans.run(name, body, args)
            for i, p in mutated:
                torch.autograd.graph.increment_version(args[i] if i < len(args) else kwargs[p])
            return out

        def on_its_device(*args, **kwargs):
            device = args[0].get_device()  # (every op's first argument is a tensor, passed by position)
            if device < 0 or device == torch._C._cuda_getDevice():
                return kernel(*args, **kwargs)
            with torch.cuda.device(device):
                return kernel(*args, **kwargs)

        _LIBRARY.impl(name, kernel, "CPU")
        _LIBRARY.impl(name, on_its_device, "CUDA")
        return NsaOp(name)

    return register


# ---------------------------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------------------------


@functools.cache
def _log_once(message: str) -> None:
    log.warning(message)


def choose_backend(op: str, device: torch.device, fp8_dtype: torch.dtype | None, **static) -> str:
    """``"aiter"``, ``"triton"`` or ``"torch"`` for one call of ``op`` (an op with an aiter kernel) on ``device``.

    ``fp8_dtype``: the call's fp8 type (``None`` for an op without fp8 operands). ``static``: the call's static facts
    aiter's preconditions depend on (``page_size``, ``preshuffle``, ``heads``, ``sorted``); a call aiter cannot serve
    goes to Triton, never to aiter."""
    if device.type == "cpu":
        return "torch"
    cap = capability()
    if cap.use_aiter:
        why = (f"fp8 type {fp8_dtype} is not this GPU's ({cap.fp8_dtype})"
               if fp8_dtype is not None and fp8_dtype != cap.fp8_dtype else aiter_refusal(cap, op, **static))
        if why is None:
            return "aiter"
        _log_once(f"nsa_inductor: nsa.{op} runs the Triton kernel, not aiter's: {why}")
    return _triton_unless_fnuz_on_nvidia(op, cap, fp8_dtype)


def _triton_unless_fnuz_on_nvidia(op: str, cap, fp8_dtype: torch.dtype | None) -> str:
    if not cap.use_triton:
        return "torch"
    if cap.platform == "cuda" and fp8_dtype == torch.float8_e4m3fnuz and op not in BYTE_COPIES:
        _log_once(f"nsa_inductor: nsa.{op} with float8_e4m3fnuz runs the torch reference on NVIDIA "
                  "(Triton has no fnuz fp8 type there)")
        return "torch"
    return "triton"


_MODULES = {"aiter": "aiter", "triton": "triton", "torch": "reference"}


@functools.cache
def _function(op: str, backend: str):
    """``op``'s function in its package's ``reference``, ``triton`` or ``aiter`` module (looked up once: the
    import machinery costs microseconds per call)."""
    return getattr(importlib.import_module(f"{__package__}.{op}.{_MODULES[backend]}"), op)


def implementation(op: str, device: torch.device, fp8_dtype: torch.dtype | None, **static):
    """The function that runs this call of ``op``, an op aiter has a kernel for (``static``: see choose_backend)."""
    backend = choose_backend(op, device, fp8_dtype, **static)
    host_plans.note_backend(backend)
    return _function(op, backend)


def triton_or_reference(op: str, device: torch.device, fp8_dtype: torch.dtype | None = None):
    """For the ops aiter has no kernel for: the Triton kernel on GPUs, the torch reference elsewhere (and for fnuz
    fp8 outputs on NVIDIA)."""
    backend = "torch" if device.type == "cpu" else _triton_unless_fnuz_on_nvidia(op, capability(), fp8_dtype)
    host_plans.note_backend(backend)
    return _function(op, backend)


# ---------------------------------------------------------------------------------------------------------------
# reference helpers
# ---------------------------------------------------------------------------------------------------------------


def roped(x: torch.Tensor, rope_cos, rope_sin, positions, interleaved: bool) -> torch.Tensor:
    """``x`` with eager's RoPE (``indexer.apply_rope``: fp32 products, bf16 result) on the first ``2 *
    rope_cos.shape[1]`` of each row, token ``t`` at ``positions[t]`` (wrapped like a Python index; a position
    outside the tables gives NaN there, where eager's indexing fails); ``x`` itself without tables."""
    if rope_cos is None:
        return x
    rows = rope_cos.shape[0]
    pos = positions.long()
    pos = torch.where(pos < 0, pos + rows, pos)
    ok = ((pos >= 0) & (pos < rows))[:, None]
    pos = torch.where(ok[:, 0], pos, 0)
    broadcast = (x.shape[0],) + (1,) * (x.dim() - 2) + (rope_cos.shape[1],)
    cos, sin = (torch.where(ok, table[pos], float("nan")).view(broadcast) for table in (rope_cos, rope_sin))
    rope_dim = 2 * rope_cos.shape[1]
    return torch.cat([apply_rope(x[..., :rope_dim], cos, sin, interleaved), x[..., rope_dim:]], dim=-1)


def head_weights(weights: torch.Tensor, factor: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``weights * factor * scale`` in fp32 and that order, as the logits kernels multiply them; 3-D ``weights``
    are split-K partials ``[S, rows, H]``, summed first, left to right."""
    if weights.dim() == 3:
        total = weights[0]
        for s in range(1, weights.shape[0]):
            total = total + weights[s]
        weights = total
    if factor is not None:
        weights = weights * factor
    return weights * scale if scale != 1.0 else weights


def slots_of(block_table: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, page_size: int, num_pages: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slot of token ``pos`` of sequence ``seq`` (broadcasting) and whether it is readable (docs/indices.md).

    Readable: ``0 <= pos // page_size < max_pages`` and the page id ``p`` in ``[-num_pages, num_pages)``; a negative
    id wraps like a Python index (page ``p + num_pages``). Unreadable entries get slot 0 (a safe address to load).
    """
    page_col = pos // page_size
    in_table = (page_col >= 0) & (page_col < block_table.shape[1])
    page, readable = python_index(block_table[seq, page_col.clamp(0, block_table.shape[1] - 1)], num_pages)
    readable &= in_table
    return torch.where(readable, page * page_size + pos % page_size, 0), readable
