"""Independent float64 references for the tests: written from DESIGN.md, not from the package's code."""

from __future__ import annotations

import math

import torch

TOKEN_BYTES = 132


def value_byte(slot: int, d: int, page_size: int, preshuffle: bool) -> int:
    page, i = divmod(slot, page_size)
    if preshuffle:
        inner = (i // 16) * 2048 + (d // 16) * 256 + (i % 16) * 16 + d % 16
    else:
        inner = i * 128 + d
    return page * page_size * TOKEN_BYTES + inner


def scale_byte(slot: int, page_size: int) -> int:
    page, i = divmod(slot, page_size)
    return page * page_size * TOKEN_BYTES + page_size * 128 + 4 * i


def decode_slot(cache: torch.Tensor, slot: int, page_size: int, preshuffle: bool, fp8_dtype) -> tuple[torch.Tensor, float]:
    """(values float64 [128], scale) of one slot, read byte by byte."""
    flat = cache.reshape(-1).cpu()
    idx = torch.tensor([value_byte(slot, d, page_size, preshuffle) for d in range(128)])
    values = flat[idx].view(fp8_dtype).double()
    s = flat[scale_byte(slot, page_size): scale_byte(slot, page_size) + 4].view(torch.float32).item()
    return values, s


def act_quant64(x: torch.Tensor, fmax: float, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales in float64 from the DESIGN formula; values are x / s before the fp8 cast (float64)."""
    blocks = x.double().reshape(*x.shape[:-1], -1, 128)
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    s = (amax.float() / fmax).double()  # the scale is an fp32 number in every implementation
    if ue8m0:
        s = torch.tensor([2.0 ** math.ceil(math.log2(v)) for v in s.flatten().tolist()], dtype=torch.float64).view_as(s)
    return (blocks / s).clamp(-fmax, fmax).reshape(x.shape), s.squeeze(-1)


def indexer_logits64(q_fp8, weights, keys, key_scales, visible) -> torch.Tensor:
    """score[r, s] = sum_h w[r,h] relu(dot(q[r,h], k[s]) * k_scale[s]) where visible, -inf elsewhere (float64).

    q_fp8 [R, H, 128], weights [R, H], keys [S, 128] float64, key_scales [S], visible [R, S] bool.
    """
    dots = torch.einsum("rhd,sd->rhs", q_fp8.double(), keys.double()) * key_scales.double()
    scores = (dots.relu() * weights.double()[..., None]).sum(1)
    return scores.masked_fill(~visible, float("-inf"))


def batched_logits64(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """``nsa.batched_mqa_logits`` in float64: ``sum_h w * relu(scale * q.k)``, q ``[B, S, H, D]``, k ``[B, T, D]``,
    -inf where the bool ``mask`` is False."""
    scores = torch.einsum("bshd,btd->bsht", q.double(), k.double()) * scale  # (on their device: a GPU is faster)
    logits = (scores.relu() * weights.double()[..., None]).sum(2)
    return (logits if mask is None else logits.masked_fill(~mask, float("-inf"))).cpu()


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-3) -> None:
    """Same shape, no NaN, identical -inf masks, finite values within ``rtol`` relative (norm-wise)."""
    actual, expected = actual.double().cpu(), expected.double().cpu()
    assert actual.shape == expected.shape, f"shape {list(actual.shape)} != {list(expected.shape)}"
    assert not actual.isnan().any(), "NaN in logits (an element was not written?)"
    assert torch.equal(actual.isneginf(), expected.isneginf()), "-inf masks differ"
    finite = ~expected.isneginf()
    if finite.any():
        err = (actual[finite] - expected[finite]).norm() / expected[finite].norm().clamp(min=1e-30)
        assert err <= rtol, f"relative error {err:.3e} > {rtol}"


def topk_sets_valid(logits: torch.Tensor, indices: torch.Tensor, k: int, offset=None) -> None:
    """Each row's indices are a top-k set of its finite logits (ties allowed), -1 padded."""
    for r in range(logits.shape[0]):
        row = logits[r].double().cpu()
        finite = (~row.isneginf()).nonzero().flatten()
        idx = indices[r].cpu().long()
        chosen = idx[idx >= 0] + (0 if offset is None else int(offset[r]))
        n = min(k, len(finite), idx.numel())
        assert len(chosen) == n, f"row {r}: {len(chosen)} indices, expected {n}"
        assert len(set(chosen.tolist())) == n
        assert bool((~row[chosen].isneginf()).all())
        if n and n < len(finite):
            threshold = row[finite].sort(descending=True).values[n - 1]
            assert bool((row[chosen] >= threshold).all()), f"row {r}: not a top-{k} set"
