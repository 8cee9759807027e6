"""Which stage makes compiled K/q differ from eager? Compile every run of consecutive stages from eager's own input.

    python benchmarks/stage_diff.py [--device cuda|cpu] [--backend inductor nsa_rocm] [--tokens 64]

The K path (wk, LayerNorm, RoPE, Hadamard, act_quant) and the q path (wq_b, RoPE with write-back, Hadamard,
act_quant) of the reference indexer are split into stages. For each run of consecutive stages, the run is compiled
alone and fed eager's input to its first stage; the table counts the elements (bytes for fp8) of its output that
differ from eager's. A difference that appears only when two stages are compiled together points at a fusion or a
graph rewrite between them (this is how the torch 2.11 ``pointless_convert`` fold was found). Full DeepSeek-V3.2
sizes on a GPU, the small config on the CPU.
"""

from __future__ import annotations

import argparse

import torch

from nsa_inductor.indexer import Indexer, IndexerConfig
from nsa_inductor.layout import KCacheLayout
from nsa_inductor.quant import act_quant


def stages(model: Indexer, positions: torch.Tensor) -> dict[str, list[tuple[str, callable]]]:
    c = model.config

    def rope_in_place(t, write_back):
        t = t.clone()
        t_pe = t[..., : c.rope_dim]
        t_pe.copy_(model._rope(t_pe, positions))
        if write_back:
            t[..., : c.rope_dim] = t_pe
        return t

    def quant(t):
        return act_quant(t, c.quant_block, c.scale_fmt, c.fp8_dtype)

    return {
        "k": [("wk", model.wk), ("layer_norm", lambda k: model.k_norm(k.float()).to(torch.bfloat16)),
              ("rope", lambda k: rope_in_place(k, False)), ("hadamard", model.rotate_activation), ("act_quant", quant)],
        "q": [("wq_b", lambda q: model.wq_b(q).view(-1, c.n_heads, c.head_dim)),
              ("rope", lambda q: rope_in_place(q, True)), ("hadamard", model.rotate_activation), ("act_quant", quant)],
    }


def differing(a, b) -> int:
    if isinstance(a, tuple):
        return sum(differing(x, y) for x, y in zip(a, b))
    if a.dtype.itemsize == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return int((a != b).sum())


def compose(chain):
    def run(t):
        for _, fn in chain:
            t = fn(t)
        return t

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", nargs="+", default=["inductor", "nsa_rocm"])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    config = IndexerConfig.deepseek_v32()
    if args.device == "cpu":
        config = config.small()
    model = Indexer(config, KCacheLayout(64)).to(args.device)
    model.reset_parameters(torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    positions = torch.randint(0, config.max_model_len, (args.tokens,), generator=gen).to(args.device)
    inputs = {"k": torch.randn(args.tokens, config.hidden_size, generator=gen),
              "q": torch.randn(args.tokens, config.q_lora_rank, generator=gen)}

    print(f"| path | stages | {' | '.join(args.backend)} |\n|---|---|{'---:|' * len(args.backend)}")
    with torch.no_grad():
        for path, chain in stages(model, positions).items():
            eager = [inputs[path].bfloat16().to(args.device)]
            for _, fn in chain:
                eager.append(fn(eager[-1]))
            for length in range(1, len(chain) + 1):
                for first in range(len(chain) - length + 1):
                    run = chain[first : first + length]
                    counts = []
                    for backend in args.backend:
                        torch._dynamo.reset()
                        options = {"emulate_precision_casts": True} if backend == "inductor" else None
                        out = torch.compile(compose(run), backend=backend, options=options)(eager[first])
                        counts.append(str(differing(out, eager[first + length])))
                    print(f"| {path} | {' + '.join(name for name, _ in run)} | {' | '.join(counts)} |", flush=True)


if __name__ == "__main__":
    main()
