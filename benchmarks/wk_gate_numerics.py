"""What ``wk_gate_gemm`` changes in the K cache, the logits and the top-k sets: compiled vs eager, same run.

    python benchmarks/wk_gate_numerics.py [--device cpu|cuda] [--prefill 1024] [--batch 64] [--ctx 2048]

The reference indexer at DeepSeek-V3.2 sizes (paged layout, P = 64), compiled with nsa_rocm twice: as is, and with
``nsa.disable_passes=["wk_gate_gemm"]`` (the control: eager's bytes). A prefill stores every token's K and scores
its logits from the cache; a decode step stores one token per sequence into a cache filled beforehand. Printed per
case: the difference of the K-cache slots the step wrote (``nsa_inductor.cache_difference.k_cache_difference``), logits
relative error (norm-wise over the finite entries) and -inf masks against eager, and top-k recall (the fraction of
eager's top-k indices found).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))  # (last: a package on PYTHONPATH, an A/B's, wins)

from nsa_inductor.cache_difference import k_cache_difference  # noqa: E402
from nsa_inductor.indexer import Indexer, IndexerConfig  # noqa: E402
from nsa_inductor.layout import KCacheLayout  # noqa: E402
from nsa_inductor.pass_manager import last_reports  # noqa: E402
from nsa_inductor.workload import decode_batch, prefill_batch  # noqa: E402


def compare(eager_out, out, eager_cache, cache, layout, slots) -> dict:
    (logits, topk), (c_logits, c_topk) = eager_out, out
    finite = ~logits.isneginf()
    e, a = logits.double()[finite], c_logits.double()[finite]
    found = total = 0
    for r_e, r_c in zip(topk.tolist(), c_topk.tolist()):
        s_e = {i for i in r_e if i >= 0}
        found += len(s_e & set(r_c))
        total += len(s_e)
    return {**k_cache_difference(layout, eager_cache, cache, slots=slots),
            "logits_rel_err": float((a - e).norm() / e.norm()),
            "masks_equal": bool(torch.equal(logits.isneginf(), c_logits.isneginf())),
            "topk_recall": found / max(total, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prefill", type=int, default=1024, help="prefill tokens (one sequence)")
    parser.add_argument("--batch", type=int, default=64, help="decode sequences")
    parser.add_argument("--ctx", type=int, default=2048, help="decode context length")
    args = parser.parse_args()
    config = IndexerConfig.deepseek_v32(max_model_len=max(4096, args.prefill, args.ctx + 64))
    layout = KCacheLayout(64)
    model = Indexer(config, layout).to(args.device)
    model.reset_parameters(torch.Generator().manual_seed(0))
    cases = {
        "prefill": prefill_batch(config, layout, [args.prefill], seed=3, device=args.device),
        "decode": decode_batch(config, layout, [args.ctx - 7 * i for i in range(args.batch)], next_n=1,
                               max_len=args.ctx, seed=1, device=args.device),
    }
    options = {"nsa.layout": "paged", "nsa.page_size": 64}
    with torch.no_grad():
        for entry, batch in cases.items():
            eager = batch.clone()
            eager_out = getattr(model, entry)(*eager.args)
            for name, extra in (("wk_gate_gemm", {}), ("control", {"nsa.disable_passes": ["wk_gate_gemm"]})):
                torch._dynamo.reset()
                fn = torch.compile(getattr(model, entry), backend="nsa_rocm", options={**options, **extra})
                comp = batch.clone()
                out = fn(*comp.args)
                fired = sum(p["matched"] for p in last_reports()[-1]["passes"] if p["name"] == "wk_gate_gemm")
                diff = compare(eager_out, out, eager.kv_cache, comp.kv_cache, layout, batch.slot_mapping)
                print(entry, name, f"fired={fired}", diff, flush=True)


if __name__ == "__main__":
    main()
