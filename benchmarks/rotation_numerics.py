"""How far a fused Hadamard rotation moves the indexer's bytes and results from eager's (docs/numerics.md).

    python benchmarks/rotation_numerics.py [--device cpu|cuda] [--batches 1 8 64] [--ctx 2048] [--rows 262144]

The rotation ``(x.float() @ H * 128**-0.5).to(bf16)`` sums 128 exact products; ``nsa.rotate_act_quant`` and the
store's rotation prologue sum them in another order than eager's GEMM. Per decode batch (DeepSeek-V3.2 sizes) this
compares eager with a second run that differs only in that order and reports: the fraction of fp8 values of the new
K-cache tokens and of q that differ, the largest difference in fp8 steps, the fraction of scales that differ, the
logits' relative error (norm-wise, finite entries) and the top-k set recall. The second run is
- on the CPU, eager with the rotation summed exactly (fp64, rounded once to fp32): the reference order every
  fp32 order is within a few ulps of, so eager-vs-exact is the size of difference any reordering makes;
- on a GPU, the step compiled with ``nsa_rocm`` (the Triton kernels against cuBLAS).
A second table counts the same for the rotation + act_quant alone on ``--rows`` random rows (fp32, bf16 and fp8
levels), where rare events (one in millions) show up.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))  # (last: a package on PYTHONPATH, an A/B's, wins)

from nsa_inductor.indexer import Indexer, IndexerConfig  # noqa: E402
from nsa_inductor.layout import KCacheLayout  # noqa: E402
from nsa_inductor.quant import fp8_ulps  # noqa: E402
from nsa_inductor.workload import decode_batch  # noqa: E402


class ExactRotationIndexer(Indexer):
    """The reference indexer with the rotation's fp32 sum computed exactly (in fp64) and rounded once."""

    def rotate_activation(self, x: torch.Tensor) -> torch.Tensor:
        product = (x.double() @ self.hadamard.double()).float()
        return (product * self.config.head_dim**-0.5).to(x.dtype)


def compare(eager: dict, other: dict) -> dict:
    """The figures of docs/numerics.md for one batch."""
    row = {}
    for name in ("k", "q"):
        ulps = fp8_ulps(other[f"{name}_fp8"], eager[f"{name}_fp8"])
        row[f"{name} values differ"] = (ulps > 0).double().mean().item()
        row[f"{name} max steps"] = int(ulps.max())
        row[f"{name} scales differ"] = (other[f"{name}_scale"] != eager[f"{name}_scale"]).double().mean().item()
    finite = ~eager["logits"].isneginf()
    diff = (other["logits"][finite].double() - eager["logits"][finite].double()).norm()
    row["logits rel. error"] = (diff / eager["logits"][finite].double().norm()).item()
    row["-inf masks equal"] = bool(torch.equal(other["logits"].isneginf(), eager["logits"].isneginf()))
    recalls = []
    for a, b in zip(other["topk"].tolist(), eager["topk"].tolist()):
        want = {i for i in b if i >= 0}
        recalls.append(len(want & set(a)) / len(want) if want else 1.0)
    row["top-k recall (min)"] = min(recalls)
    row["top-k recall (mean)"] = sum(recalls) / len(recalls)
    return row


def rows_alone(rows: int, device: str, seed: int) -> dict:
    """Eager's rotation + act_quant against the other order on random rows of varied magnitude."""
    from nsa_inductor.indexer import hadamard_matrix
    from nsa_inductor.quant import act_quant

    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 128, generator=gen) * torch.rand(rows, 1, generator=gen) * 4).bfloat16().to(device)
    h = hadamard_matrix(128).to(device)
    eager = x.float() @ h
    if device == "cpu":
        other = (x.double() @ h.double()).float()
        y_other = (other * 128**-0.5).bfloat16()
        q_other, s_other = act_quant(y_other)
    else:
        q_other, s_other = torch.ops.nsa.rotate_act_quant(x, h, 128**-0.5, False, 128, "ue8m0", torch.float8_e4m3fn,
                                                          448.0)
        other, y_other = None, None
    y = (eager * 128**-0.5).bfloat16()
    q, s = act_quant(y)
    ulps = fp8_ulps(q_other, q)
    out = {"rows": rows}
    if other is not None:
        out["fp32 differ"] = (other != eager).double().mean().item()
        out["bf16 differ"] = (y_other != y).double().mean().item()
    out.update({"fp8 differ": (ulps > 0).double().mean().item(), "fp8 differ (count)": int((ulps > 0).sum()),
                "max steps": int(ulps.max()), "scales differ (count)": int((s_other != s).sum())})
    return out


def table(rows: list[dict]) -> None:
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + "---:|" * len(keys))
    for row in rows:
        cells = [f"{v:.4f}" if isinstance(v, float) and "recall" in k else f"{v:.2e}" if isinstance(v, float)
                 else str(v) for k, v in row.items()]
        print("| " + " | ".join(cells) + " |")


def run(step, model: Indexer, batch) -> dict:
    """Outputs of one decode step plus the K values and scales it stored and q (recomputed eagerly for q)."""
    b = batch.clone()
    with torch.no_grad():
        logits, topk = step(*b.args)
    fp8 = model.config.fp8_dtype
    k_fp8, k_scale = model.layout.load(b.kv_cache, b.slot_mapping.clamp(min=0), fp8)
    keep = b.slot_mapping >= 0
    return {"k_fp8": k_fp8[keep].cpu(), "k_scale": k_scale[keep].cpu(), "logits": logits.cpu(), "topk": topk.cpu()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=262144)
    args = parser.parse_args()

    config = IndexerConfig.deepseek_v32(max_model_len=max(8192, 2 * args.ctx))
    layout = KCacheLayout(64)
    model = Indexer(config, layout).to(args.device)
    model.reset_parameters(torch.Generator().manual_seed(args.seed))
    if args.device == "cpu":
        other_model = ExactRotationIndexer(config, layout).to(args.device)
        other_model.load_state_dict(model.state_dict())
        other_step, against = other_model.decode, "eager, rotation summed exactly (fp64)"
    else:
        other_model, against = model, "nsa_rocm compiled (Triton kernels)"
        other_step = torch.compile(model.decode, backend="nsa_rocm", options={"nsa.page_size": 64})

    rows = []
    for batch_size in args.batches:
        lens = [args.ctx - 37 * i % 500 for i in range(batch_size)]
        batch = decode_batch(config, layout, lens, seed=args.seed + batch_size, device=args.device)
        eager, other = run(model.decode, model, batch), run(other_step, other_model, batch)
        with torch.no_grad():
            eager["q_fp8"], eager["q_scale"] = (t.cpu() for t in model.project_q(batch.q_lora, batch.positions))
            q_source = other_model.project_q if args.device == "cpu" else torch.compile(
                model.project_q, backend="nsa_rocm")
            other["q_fp8"], other["q_scale"] = (t.cpu() for t in q_source(batch.q_lora, batch.positions))
        rows.append({"B": batch_size, **compare(eager, other)})

    print(f"DeepSeek-V3.2 decode, ctx ~{args.ctx}, {args.device}: eager vs {against}\n")
    table(rows)
    print(f"\nRotation + act_quant alone, {args.device}: eager vs "
          f"{'the exact sum' if args.device == 'cpu' else 'nsa.rotate_act_quant'}\n")
    table([rows_alone(args.rows, args.device, args.seed)])


if __name__ == "__main__":
    main()
