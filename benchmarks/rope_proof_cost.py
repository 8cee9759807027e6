"""Compile-time cost of ``rope_prologue``'s proof: the pass on a q-side RoPE of [T, H, 128] rows (the functional
graph of ``tests/patterns/test_pass_rope_prologue.py``'s ``neox_write_back``), wall time and peak resident memory.

    python benchmarks/rope_proof_cost.py --tokens 8192 --heads 64
"""

from __future__ import annotations

import argparse
import pathlib
import resource
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # the tests' helpers package

from helpers.pass_helpers import functional_graph  # noqa: E402
from nsa_inductor.indexer import hadamard_matrix, rope_cos_sin  # noqa: E402
from nsa_inductor.patterns.rope_prologue import RopePrologue  # noqa: E402
from patterns.test_pass_rope_prologue import neox_write_back  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=64)
    args = parser.parse_args()
    x = torch.randn(args.tokens, args.heads, 128).bfloat16()
    table = rope_cos_sin(64, 65536, 10000.0)
    positions = torch.randint(0, 65536, (args.tokens,))
    gm = functional_graph(neox_write_back, x, table, positions, hadamard_matrix(128))
    start = time.perf_counter()
    result = RopePrologue()(gm.graph, None)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"T={args.tokens} H={args.heads}: matched {result.matched}, {seconds:.2f} s, peak resident {peak} MB")


if __name__ == "__main__":
    main()
