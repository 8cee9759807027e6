"""Two K caches compared token by token through their decoded values and scales, and the bound a compiled step's
cache keeps from eager's (docs/numerics.md): one definition for the tests and for ``nsa.verify``.

Why decoded: where a rewrite changes a summation order (``rotate_act_quant``, ``wk_gate_gemm``) a few fp8 values
land a grid step away from eager's, so the bytes cannot be compared for equality, and counting differing bytes
would let a wrong scale through (a scale one power of two off changes one or two of a token's 132 bytes).
"""

from __future__ import annotations

import math

import torch

from .layout import KCacheLayout

# Of the written tokens, at most MAX_SCALES_DIFFER have another scale (or MIN_SCALES_ALLOWED, where that is more);
# of the fp8 values of the others at most MAX_VALUES_DIFFER differ (or MIN_VALUES_ALLOWED, where that is more: one
# token moves several of its values, and a step may write few tokens); every value, decoded in units of its scale
# (the coarser of the two where they differ), is within MAX_STEPS steps of the fp8 grid at its magnitude or within
# MAX_ERROR scale units, whichever is more: a token's inputs one bf16 bit away move its values by up to ~0.5 units
# (1/896 of the group's amax with fp32 scales), which is many grid steps near zero and less than one far from it.
MAX_SCALES_DIFFER = 0.01
MIN_SCALES_ALLOWED = 1
MAX_VALUES_DIFFER = 0.01
MIN_VALUES_ALLOWED = 64
MAX_STEPS = 2
MAX_ERROR = 1.0
FP8_MANTISSA_BITS = 3  # e4m3: a value in [2^e, 2^(e+1)) lies on a grid of steps 2^(e-3)
# Logits read the keys those values belong to: a key with values a step away moves its logits by up to ~1.5 %
# (measured, docs/numerics.md), so a step's logits may move norm-wise by up to MOVED_KEYS_LOGITS_RTOL times the
# square root of the share of its written tokens whose K moved, on top of the logits' own tolerance; each such key
# is one column of the logits, so outside that many columns the logits keep their own tolerance.
MOVED_KEYS_LOGITS_RTOL = 0.04


def k_cache_difference(layout: KCacheLayout, expected: torch.Tensor, actual: torch.Tensor,
                       fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                       slots: torch.Tensor | None = None) -> dict[str, float | int]:
    """How far two K caches of ``layout`` are apart at ``slots`` (default every slot; each slot once; negative ones
    and those past the cache skipped, as a store skips them: a step's slot mapping may hold both). Read on the
    caches' device, only the compared slots copied to the host.

    ``tokens_compared``; ``tokens_moved``: those with any value or scale that differs; ``tokens_scale_differs``: those
    whose scales differ. Over the others: ``values_compared``,
    ``values_differing`` and their ratio ``values_differ``, ``max_steps`` (the largest distance in steps of the fp8
    grid) and ``tokens_differ`` (the fraction of them with any differing value). Over every slot, the values decoded
    in units of the scale (the coarser of the two where they differ): ``max_error`` (the largest distance in those
    units), ``max_of_bound`` (the largest distance as a fraction of its bound above; inf where only one of a pair is
    NaN or a scale is not a positive number) and ``furthest_slot`` (where that is).
    """
    num_slots = expected.numel() // layout.page_bytes * layout.page_size
    if slots is None:
        slots = torch.arange(num_slots)
    slots = slots[(slots >= 0) & (slots < num_slots)].unique().to(expected.device)
    (ev, es), (av, as_) = (layout.load(c, slots, fp8_dtype) for c in (expected, actual))
    ev, es, av, as_ = (t.cpu() for t in (ev, es, av, as_))
    same_scale = es.view(torch.int32) == as_.view(torch.int32)

    def grid_step(v: torch.Tensor) -> torch.Tensor:
        bits = v.view(torch.uint8).int()
        return torch.where(bits >= 0x80, -(bits & 0x7F), bits & 0x7F)

    steps = (grid_step(ev) - grid_step(av)).abs()[same_scale]
    coarse = torch.where(same_scale, es, torch.maximum(es, as_))[:, None]
    e_units = torch.where(same_scale[:, None], ev.float(), ev.float() * (es[:, None] / coarse))
    a_units = torch.where(same_scale[:, None], av.float(), av.float() * (as_[:, None] / coarse))
    error = torch.where(e_units.isnan() & a_units.isnan(), 0.0, (e_units - a_units).abs().nan_to_num(torch.inf))
    magnitude = torch.maximum(e_units.abs(), a_units.abs()).nan_to_num(0.0).clamp(min=2.0**-6)
    bound = torch.maximum(MAX_STEPS * torch.exp2(torch.floor(torch.log2(magnitude)) - FP8_MANTISSA_BITS),
                          torch.tensor(MAX_ERROR))
    valid = same_scale[:, None] | (coarse.isfinite() & (coarse > 0))
    of_bound = torch.where(valid, error / bound, torch.inf)
    compared = steps.numel()
    differing = int((steps > 0).sum())
    moved = int((~same_scale).sum() + (steps > 0).any(-1).sum())
    return {"tokens_compared": int(slots.numel()), "tokens_moved": moved,
            "tokens_scale_differs": int((~same_scale).sum()), "values_compared": compared,
            "values_differing": differing, "values_differ": differing / max(compared, 1),
            "max_steps": int(steps.max()) if compared else 0,
            "tokens_differ": float((steps > 0).any(-1).sum()) / max(int(same_scale.sum()), 1),
            "max_error": float(error.max()) if error.numel() else 0.0,
            "max_of_bound": float(of_bound.max()) if of_bound.numel() else 0.0,
            "furthest_slot": int(slots[of_bound.amax(-1).argmax()]) if slots.numel() else -1}


def changed_slots(layout: KCacheLayout, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """The slots of a K cache of ``layout`` in which any byte of ``after`` differs from ``before``, ascending."""
    return layout.slots_of_bytes((before != after).view(-1).nonzero().squeeze(1)).unique()


def k_cache_problems(layout: KCacheLayout, expected: torch.Tensor, actual: torch.Tensor, slots: torch.Tensor,
                     fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[list[str], dict[str, float | int]]:
    """Where ``actual``'s slots ``slots`` leave the bound above around ``expected``'s (empty: within it), and their
    :func:`k_cache_difference`."""
    diff = k_cache_difference(layout, expected, actual, fp8_dtype, slots)
    tokens = diff["tokens_compared"]
    problems = []
    scales_allowed = max(int(MAX_SCALES_DIFFER * tokens), MIN_SCALES_ALLOWED)
    if diff["tokens_scale_differs"] > scales_allowed:
        problems.append(f"{diff['tokens_scale_differs']} of {tokens} tokens have another scale (allowed "
                        f"{scales_allowed})")
    values_allowed = max(int(MAX_VALUES_DIFFER * diff["values_compared"]), MIN_VALUES_ALLOWED)
    if diff["values_differing"] > values_allowed:
        problems.append(f"{diff['values_differing']} of {diff['values_compared']} fp8 values differ (allowed "
                        f"{values_allowed})")
    if diff["max_of_bound"] > 1:
        problems.append(f"a value of slot {diff['furthest_slot']} is {diff['max_of_bound']:g} times its bound away "
                        f"(the bound: {MAX_STEPS} steps of the fp8 grid at its magnitude or {MAX_ERROR:g} scale unit, "
                        f"whichever is more)")
    facts = ", ".join(f"{k}={v:g}" for k, v in diff.items())
    return [f"{problem} ({facts})" for problem in problems], diff


def logits_rtol(rtol: float, diff: dict[str, float | int] | None) -> float:
    """The logits' tolerance ``rtol`` against eager's, widened for the keys whose K moved in a step whose cache
    difference is ``diff`` (:func:`k_cache_difference` of the written slots; None: the caches are equal)."""
    if not diff or not diff["tokens_compared"]:
        return rtol
    return rtol + MOVED_KEYS_LOGITS_RTOL * (diff["tokens_moved"] / diff["tokens_compared"]) ** 0.5


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, last dim]`` (also where either is 0: an empty batch)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def error_outside_moved_keys(expected: torch.Tensor, actual: torch.Tensor, keys_moved: int) -> float:
    """The norm-wise relative error of logits ``actual`` (keys along the last dimension) over the entries finite in
    ``expected``, leaving out the ``keys_moved`` key columns where it is largest: a key whose K moved moves only its
    own column, so what is left is the logits' own error."""
    finite = expected.isfinite()
    error = torch.where(finite, actual.double() - expected.double(), 0.0)
    reference = float(torch.where(finite, expected.double(), 0.0).norm())
    columns = as_rows(error.pow(2)).sum(0)
    kept = columns.sort().values[: max(columns.numel() - keys_moved, 0)]
    return float(kept.sum().sqrt()) / max(reference, 1e-30)
