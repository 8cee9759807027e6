"""rope_prologue: RoPE written into the rows of a fused rotation moves into the op (its tables, positions); near
misses keep Inductor's RoPE. On the CPU the op runs the torch reference, so the outputs must stay bit-identical."""

import pytest
import torch

from nsa_inductor.indexer import apply_rope, hadamard_matrix, rope_cos_sin
from nsa_inductor.patterns.rope_prologue import RopePrologue
from nsa_inductor.layout import KCacheLayout
from nsa_inductor.quant import act_quant
from helpers.pass_helpers import compile_with_dumps, graph_dirs, pass_entry, run_pass

FN = torch.float8_e4m3fn
TABLE = rope_cos_sin(64, 40, 10000.0)  # [P, 2, 32]: cos then sin
BF16 = torch.bfloat16


def quantized(x, h):
    return torch.ops.nsa.rotate_act_quant(x, h, 128**-0.5, False, 128, "ue8m0", FN, 448.0)


def prologues(gm) -> int:
    return sum(n.target is torch.ops.nsa.rotate_act_quant.default and "rope_cos" in n.kwargs for n in gm.graph.nodes)


def _rows_table(table, positions, x):
    cos, sin = table[positions].unbind(1)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    return cos.view(shape), sin.view(shape)


def neox_write_back(x, table, positions, h):
    cos, sin = _rows_table(table, positions, x)
    x = x.clone()
    x1, x2 = x[..., :64].float().chunk(2, -1)
    x[..., :64] = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(BF16)
    return quantized(x, h)


def interleaved_apply_rope(x, table, positions, h):
    cos, sin = _rows_table(table, positions, x)
    x = x.clone()
    x[..., :64] = apply_rope(x[..., :64], cos, sin, interleaved=True)
    return quantized(x, h)


def cat_with_rest_two_gathers(x, table, positions, h):
    cos, sin = table[positions, 0], table[positions, 1]
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rope, rest = torch.split(x, [64, 64], dim=-1)
    real, imag = rope.float().chunk(2, -1)
    roped = torch.cat([real * cos - imag * sin, real * sin + imag * cos], -1).to(BF16)  # (sum order swapped)
    return quantized(torch.cat([roped, rest], -1), h)


def vllm_cache_index_select(x, table, positions, h):
    cos_sin = table.flatten(1).index_select(0, positions)  # [T, 64]: cos then sin, vLLM's cos_sin_cache
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x = x.clone()
    x1, x2 = x[..., :64].float().chunk(2, -1)
    x[..., :64] = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(BF16)
    return quantized(x, h)


def partial_rope_32_lanes(x, table, positions, h):
    cos, sin = _rows_table(table[:, :, :16], positions, x)
    x = x.clone()
    x[..., :32] = apply_rope(x[..., :32], cos, sin, interleaved=False)
    return quantized(x, h)


SPELLINGS = {f.__name__: f for f in (neox_write_back, interleaved_apply_rope, cat_with_rest_two_gathers,
                                      vllm_cache_index_select, partial_rope_32_lanes)}


def inputs(tokens: int, heads: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, 128, generator=gen).to(BF16)
    positions = torch.randint(0, 40, (tokens,), generator=gen)
    return x, TABLE, positions, hadamard_matrix(128)


def assert_same(after, before):
    for got, want in zip(after, before):
        assert torch.equal(got.view(torch.uint8) if got.dtype.itemsize == 1 else got,
                           want.view(torch.uint8) if want.dtype.itemsize == 1 else want)


@pytest.mark.parametrize("tokens, heads", [(5, 4), (1, 1), (3, 1)])
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_every_spelling_moves_into_the_op_and_keeps_eager_bytes(spelling, tokens, heads):
    fn = SPELLINGS[spelling]
    result, before, after, removed = run_pass(RopePrologue(), prologues, fn, *inputs(tokens, heads))
    assert result.matched == 1 and not result.near_misses, result
    assert removed == -1, "the op has no RoPE prologue"  # (run_pass counts what the pass took away)
    assert_same(after, before)


def _first_lane_plus(x, table, positions, h):
    cos, sin = _rows_table(table, positions, x)
    x = x.clone()
    x1, x2 = x[..., :64].float().chunk(2, -1)
    x[..., :64] = torch.cat([x1 * cos + x2 * sin, x2 * cos + x1 * sin], -1).to(BF16)
    return quantized(x, h)


def _extra_rounding(x, table, positions, h):
    cos, sin = _rows_table(table, positions, x)
    x = x.clone()
    x1, x2 = x[..., :64].float().chunk(2, -1)
    x[..., :64] = torch.cat([(x1 * cos).to(BF16).float() - x2 * sin, x2 * cos + x1 * sin], -1).to(BF16)
    return quantized(x, h)


def _roped(x, cos, sin, lanes=slice(0, 64)):
    """A copy of ``x`` with ``apply_rope`` (neox) written into ``lanes``."""
    x = x.clone()
    x[..., lanes] = apply_rope(x[..., lanes], cos, sin, interleaved=False)
    return x


def _last_lanes(x, table, positions, h):
    return quantized(_roped(x, *_rows_table(table, positions, x), lanes=slice(64, 128)), h)


def _table_computed_in_graph(x, table, positions, h):
    return quantized(_roped(x, *_rows_table(table * 1.0001, positions, x)), h)


def _rope_read_elsewhere(x, table, positions, h):
    x = _roped(x, *_rows_table(table, positions, x))
    return (*quantized(x, h), x.float().sum())


def _two_position_tensors(x, table, positions, h):
    cos, sin = table[positions, 0].unsqueeze(-2), table[positions.flip(0), 1].unsqueeze(-2)
    return quantized(_roped(x, cos, sin), h)


def _rows_flattened(x, table, positions, h):
    return quantized(_roped(x, *_rows_table(table, positions, x)).flatten(0, 1), h)


def _rows_sliced_across_tokens(x, table, positions, h):
    """The gathered rows sliced along the tokens (here all of them): a slice the table itself must not get (its
    first T rows are not the rows at the positions)."""
    cos, sin = table[positions][: x.shape[0]].unbind(1)
    return quantized(_roped(x, cos.unsqueeze(-2), sin.unsqueeze(-2)), h)


def _rows_split_across_tokens(x, table, positions, h):
    """The gathered rows split along the tokens (into one piece): not a split the table itself may get."""
    cos, sin = table[positions].split(x.shape[0], dim=0)[0].unbind(1)
    return quantized(_roped(x, cos.unsqueeze(-2), sin.unsqueeze(-2)), h)


def _gathered_along_another_dim(x, table, positions, h):
    """The table kept as [2, w, P] and gathered along its last dim: not rows of the table at the positions."""
    cos, sin = table.permute(1, 2, 0).index_select(2, positions).permute(2, 0, 1).unbind(1)
    return quantized(_roped(x, cos.unsqueeze(-2), sin.unsqueeze(-2)), h)


def _a_clamp_inside(x, table, positions, h):
    cos, sin = _rows_table(table, positions, x)
    return quantized(_roped(x, cos.clamp(-0.5, 0.5), sin), h)


NEAR_MISSES = {
    "wrong sign": (_first_lane_plus, "not eager's RoPE"),
    "a product rounded to bf16": (_extra_rounding, "not eager's RoPE"),
    "the last lanes turned": (_last_lanes, "not eager's RoPE"),
    "table computed in the graph": (_table_computed_in_graph, "not an fp32 parameter, buffer or constant"),
    "RoPE read elsewhere": (_rope_read_elsewhere, "also read elsewhere"),
    "two position tensors": (_two_position_tensors, "2 position tensors"),
    "a clamp": (_a_clamp_inside, "not RoPE arithmetic"),
    "rows flattened across tokens": (_rows_flattened, "not one token per index of the first dim"),
    "rows sliced across tokens": (_rows_sliced_across_tokens, "across tokens"),
    "rows split across tokens": (_rows_split_across_tokens, "across tokens"),
    "gathered along another dim": (_gathered_along_another_dim, ""),
}


@pytest.mark.parametrize("case", sorted(NEAR_MISSES))
def test_near_misses_keep_the_rope_and_say_why(case):
    fn, reason = NEAR_MISSES[case]
    result, before, after, removed = run_pass(RopePrologue(), prologues, fn, *inputs(5, 2))
    assert result.matched == 0 and removed == 0
    assert len(result.near_misses) == 1 and reason in result.near_misses[0]["reason"], result.near_misses
    assert_same(after, before)


def test_a_bf16_table_is_a_near_miss():
    """vLLM keeps its cos/sin cache in the model's dtype: the op reads fp32 tables, so a bf16 one is reported."""
    x, table, positions, h = inputs(5, 2)
    result, before, after, removed = run_pass(RopePrologue(), prologues, neox_write_back, x, table.bfloat16(),
                                              positions, h)
    assert result.matched == 0 and removed == 0
    assert "is not an fp32 parameter, buffer or constant" in result.near_misses[0]["reason"], result.near_misses
    assert_same(after, before)


def test_no_rope_at_all_is_a_near_miss_not_a_rewrite():
    """A rotation of rows nobody wrote into: reported (so a user sees the prologue did not apply), nothing changed."""
    result, before, after, removed = run_pass(RopePrologue(), prologues,
                                              lambda x, table, positions, h: quantized(x, h), *inputs(3, 2))
    assert result.matched == 0 and removed == 0 and len(result.near_misses) == 1
    assert_same(after, before)


def fp32_rows_stored(k, positions, cache, slots):
    """RoPE on fp32 rows, quantised into the cache from fp32: the prologue turns bf16 rows (it would round them)."""
    k = k.float()
    k[:, :64] = apply_rope(k[:, :64], *_rows_table(TABLE, positions, k), interleaved=False)
    values, scale = act_quant(k)
    KCacheLayout(16).store(cache, slots, values, scale[:, 0])


def test_a_rope_on_fp32_rows_stays_in_the_graph():
    x, _, positions, _ = inputs(5, 1)
    cache = torch.randint(0, 256, (2, 16 * 132), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([3, 17, -1, 0, 30])
    compiled_fn, dump_dir = compile_with_dumps(fp32_rows_stored, {"nsa.layout": "paged", "nsa.page_size": 16},
                                               dynamic=False)
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    fp32_rows_stored(x[:, 0], positions, eager_cache, slots)
    compiled_fn(x[:, 0], positions, compiled_cache, slots)
    assert torch.equal(compiled_cache, eager_cache)
    (graph_dir,) = graph_dirs(dump_dir)
    assert pass_entry(graph_dir, "quant_cache_store")["matched"] == 1
    entry = pass_entry(graph_dir, "rope_prologue")
    assert entry["matched"] == 0 and "not bf16 rows of 128" in entry["near_misses"][0]["reason"], entry
