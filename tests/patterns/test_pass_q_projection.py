"""q_projection (experimental, ``nsa.q_projection=True``): the q side's ``F.linear`` folded into the
``nsa.rotate_act_quant`` that reads it; near misses where the product is read elsewhere, the weight is computed, the
product is not bf16 or the rows are not [T, H, 128]. On the CPU the op computes ``F.linear`` as eager does: bytes
equal."""

import pytest
import torch
import torch.nn.functional as F

import nsa_inductor  # noqa: F401  (registers torch.ops.nsa)
from nsa_inductor.indexer import hadamard_matrix
from nsa_inductor.quant import act_quant
from helpers.pass_helpers import compile_with_dumps, graph_dirs, pass_entry

C = 128**-0.5
HEADS, K = 3, 64


def rotated(q, h):
    return act_quant((q.float() @ h * C).to(torch.bfloat16))


def q_side(x, w, h):
    return rotated(F.linear(x, w).view(x.shape[0], HEADS, 128), h)


def q_side_returning_q(x, w, h):
    q = F.linear(x, w).view(x.shape[0], HEADS, 128)
    return (*rotated(q, h), q)


def q_side_of_a_computed_weight(x, w, h):
    return rotated(F.linear(x, w * 2).view(x.shape[0], HEADS, 128), h)


def q_side_in_fp32(x, w, h):
    return rotated(F.linear(x.float(), w.float()).to(torch.bfloat16).view(x.shape[0], HEADS, 128), h)


def q_side_as_flat_rows(x, w, h):
    return rotated(F.linear(x, w).view(-1, 128), h)


def run(fn, tokens: int, option: bool = True):
    gen = torch.Generator().manual_seed(tokens)
    args = (torch.randn(tokens, K, generator=gen).bfloat16(), torch.randn(HEADS * 128, K, generator=gen).bfloat16(),
            hadamard_matrix(128))
    compiled, dump_dir = compile_with_dumps(fn, {"nsa.q_projection": option}, dynamic=False)
    want, got = fn(*args), compiled(*args)
    for w, g in zip(want, got):
        assert torch.equal(g.view(torch.uint8) if g.dtype.itemsize == 1 else g,
                           w.view(torch.uint8) if w.dtype.itemsize == 1 else w)
    (graph,) = graph_dirs(dump_dir)
    return graph


@pytest.mark.parametrize("tokens", [1, 5])
def test_the_projection_goes_into_the_rotation(tokens):
    entry = pass_entry(run(q_side, tokens), "q_projection")
    assert entry["matched"] == 1 and not entry["near_misses"], entry


@pytest.mark.parametrize("fn, reason", [
    (q_side_returning_q, "is read elsewhere too"),
    (q_side_of_a_computed_weight, "is computed in the graph"),
    (q_side_in_fp32, "not a product of two matrices"),
    (q_side_as_flat_rows, "the rotated rows are"),
])
def test_near_misses_keep_the_gemm(fn, reason):
    entry = pass_entry(run(fn, 5), "q_projection")
    assert entry["matched"] == 0 and len(entry["near_misses"]) == 1, entry
    assert reason in entry["near_misses"][0]["reason"]


def test_off_by_default():
    from nsa_inductor.options import parse_options
    from nsa_inductor.patterns import passes_for

    assert "q_projection" not in [p.name for p in passes_for(parse_options({})[0])]
    assert "q_projection" in [p.name for p in passes_for(parse_options({"nsa.q_projection": True})[0])]
