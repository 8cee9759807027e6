"""The host's Python of one call of each nsa op, measured on any machine (a CPU one included): the machine made an
H200 as the ops see it and Triton's compile and launch replaced by a log (``tests/helpers/simulated_gpu.py``), so
the figures are the dispatcher, the op's checks and choices, its allocations and the launch cache's Python, without
Triton's C launcher and the driver (those: ``kernels.py --only host`` on a GPU). Each case of
``tests/helpers/op_calls.py`` with host plans (replayed from a signature's third call) and without
(``NSA_INDUCTOR_DISABLE_HOST_PLANS``), median of 5 rounds of ``--calls`` back-to-back calls, and the one call
that records a signature's plan (its second); last, the floor: a dispatcher kernel doing nothing, with the store's
schema.

    python benchmarks/host_python.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # the tests' helpers package

import nsa_inductor.capability as cap_mod  # noqa: E402
from nsa_inductor.lowering import _host_plans as host_plans  # noqa: E402
from helpers.op_calls import CASES  # noqa: E402
from helpers.simulated_gpu import simulated_h200  # noqa: E402


def _us_per_call(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(rounds)[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    rows = []
    for plans in (True, False):
        if plans:
            os.environ.pop(cap_mod.ENV_DISABLE_HOST_PLANS, None)
        else:
            os.environ[cap_mod.ENV_DISABLE_HOST_PLANS] = "1"
        with simulated_h200():
            for case, make in CASES.items():
                op, call = make()
                rows.append((case, plans, _us_per_call(lambda: op(*call), args.calls)))
    os.environ.pop(cap_mod.ENV_DISABLE_HOST_PLANS, None)
    print("| call | µs with host plans | µs without | the recording call's µs | launches |")
    print("|---|---:|---:|---:|---:|")
    with simulated_h200() as log:
        for case, make in CASES.items():
            op, call = make()
            for _ in range(3):
                op(*call)
            start = len(log)
            op(*call)
            launches = len(log) - start
            with_plans = next(us for c, p, us in rows if c == case and p)
            without = next(us for c, p, us in rows if c == case and not p)
            print(f"| {case} | {with_plans:.1f} | {without:.1f} | {_recording_us(op, call):.1f} | {launches} |")
    floor = _dispatcher_floor(args.calls)
    print(f"\nA dispatcher kernel doing nothing, the store's schema and arguments: {floor:.1f} µs")


def _recording_us(op, call) -> float:
    """µs of the call that records a signature's plan (its second), median of 25."""
    times = []
    for _ in range(25):
        host_plans.clear()
        op(*call)
        start = time.perf_counter()
        op(*call)
        times.append((time.perf_counter() - start) * 1e6)
    return sorted(times)[12]


def _dispatcher_floor(calls: int) -> float:
    """µs per call of a dispatcher kernel doing nothing, with ``nsa.quant_cache_store``'s schema and arguments."""
    import torch

    library = torch.library.Library("nsa_host_bench", "DEF")
    library.define("store_noop" + str(torch.ops.nsa.quant_cache_store.default._schema).split("quant_cache_store", 1)[1])
    library.impl("store_noop", lambda *args: None, "CPU")
    _, call = CASES["store"]()
    return _us_per_call(lambda: torch.ops.nsa_host_bench.store_noop(*call), calls)


if __name__ == "__main__":
    main()
