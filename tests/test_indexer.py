import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nsa_inductor.indexer import Indexer, IndexerConfig, apply_rope, hadamard_matrix
from nsa_inductor.layout import KCacheLayout
from nsa_inductor.workload import decode_batch, prefill_batch
from helpers.reference64 import assert_logits_close, decode_slot, indexer_logits64, topk_sets_valid

LAYOUTS = [KCacheLayout(1), KCacheLayout(16), KCacheLayout(16, preshuffle=True)]
CONFIGS = {"deepseek_v32": IndexerConfig.deepseek_v32().small(), "glm5": IndexerConfig.glm5().small()}


def make_model(config, layout, seed=0):
    model = Indexer(config, layout)
    model.reset_parameters(torch.Generator().manual_seed(seed))
    return model


def keys_of(cache, slots, layout, fp8_dtype):
    pairs = [decode_slot(cache, int(s), layout.page_size, layout.preshuffle, fp8_dtype) for s in slots]
    return torch.stack([v for v, _ in pairs]), torch.tensor([s for _, s in pairs], dtype=torch.float64)


def test_presets_follow_the_models():
    ds, glm = IndexerConfig.deepseek_v32(), IndexerConfig.glm5()
    assert (ds.n_heads, ds.hidden_size, ds.q_lora_rank, ds.rope_interleaved) == (64, 7168, 1536, False)
    assert (glm.n_heads, glm.hidden_size, glm.q_lora_rank, glm.rope_interleaved) == (32, 6144, 2048, True)
    with pytest.raises(ValueError, match="head_dim"):
        IndexerConfig(head_dim=64)


def test_hadamard_is_orthonormal_sylvester():
    h = hadamard_matrix(128)
    assert torch.equal(h[:2, :2], torch.tensor([[1.0, 1.0], [1.0, -1.0]]))
    torch.testing.assert_close(h @ h.T / 128, torch.eye(128))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_rotates_the_right_pairs(interleaved):
    gen = torch.Generator().manual_seed(int(interleaved))
    x = torch.randn(3, 64, dtype=torch.float64, generator=gen)
    angle = torch.rand(3, 32, dtype=torch.float64, generator=gen) * 6
    out = apply_rope(x, angle.cos(), angle.sin(), interleaved)
    first = torch.arange(32) * 2 if interleaved else torch.arange(32)
    second = first + 1 if interleaved else first + 32
    z = torch.complex(x[:, first], x[:, second]) * torch.exp(1j * angle)
    # apply_rope computes in fp32 (x is rounded to it): fp32 tolerances, not float64's
    torch.testing.assert_close(out[:, first], z.real, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[:, second], z.imag, rtol=1e-6, atol=1e-6)


@given(
    config=st.sampled_from(sorted(CONFIGS)),
    layout=st.sampled_from(LAYOUTS),
    next_n=st.sampled_from([1, 2]),
    ctx=st.lists(st.integers(0, 70), min_size=1, max_size=4),
    extra_len=st.integers(0, 40),
    seed=st.integers(0, 1000),
)
def test_decode_logits_and_cache_match_float64(config, layout, next_n, ctx, extra_len, seed):
    config = CONFIGS[config]
    model = make_model(config, layout, seed)
    batch = decode_batch(config, layout, ctx, next_n=next_n, max_len=max(ctx + [1]) + extra_len, seed=seed)
    before = batch.kv_cache.clone()
    logits, topk = model.decode(*batch.args)

    q_fp8, q_scale = model.project_q(batch.q_lora, batch.positions)
    weights = model.head_gates(batch.x, q_scale)
    page, max_len = layout.page_size, batch.block_table.shape[1] * layout.page_size
    assert logits.shape == (len(ctx) * next_n, config.max_model_len)
    assert bool(logits[:, max_len:].isneginf().all())
    for b, n in enumerate(ctx):
        slots = [int(batch.block_table[b, s // page]) * page + s % page for s in range(max_len)]
        keys, scales = keys_of(batch.kv_cache, slots, layout, config.fp8_dtype)
        rows = slice(b * next_n, (b + 1) * next_n)
        visible = torch.arange(max_len)[None] <= (n - next_n + torch.arange(next_n))[:, None]
        expected = indexer_logits64(q_fp8[rows], weights[rows], keys, scales, visible)
        assert_logits_close(logits[rows, :max_len], expected)
    topk_sets_valid(logits, topk, config.topk)

    written = batch.slot_mapping[batch.slot_mapping >= 0]
    untouched = torch.ones(batch.kv_cache.numel(), dtype=torch.bool)
    untouched[layout.value_offsets(written).flatten()] = False
    untouched[layout.scale_offsets(written).flatten()] = False
    assert torch.equal(batch.kv_cache.flatten()[untouched], before.flatten()[untouched]), "padding slots wrote bytes"


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_prefill_is_causal_and_matches_float64(config, layout):
    config = CONFIGS[config]
    model = make_model(config, layout)
    batch = prefill_batch(config, layout, [7, 19, 1], padding_tokens=2)
    logits, topk = model.prefill(*batch.args)
    q_fp8, q_scale = model.project_q(batch.q_lora, batch.positions)
    weights = model.head_gates(batch.x, q_scale)
    cu = batch.lens.tolist()
    num_real = cu[-2]
    keys, scales = keys_of(batch.kv_cache, batch.slot_mapping[:num_real].tolist(), layout, config.fp8_dtype)
    seq_start = torch.tensor([cu[b] for b in range(len(cu) - 1) for _ in range(cu[b + 1] - cu[b])])
    t = torch.arange(num_real)
    visible = (t[None] >= seq_start[:num_real, None]) & (t[None] <= t[:, None])
    expected = indexer_logits64(q_fp8[:num_real], weights[:num_real], keys, scales, visible)
    assert_logits_close(logits[:num_real, :num_real], expected)
    assert bool(logits[:num_real, num_real:].isneginf().all())
    topk_sets_valid(logits[:num_real], topk[:num_real], config.topk, offset=seq_start)
