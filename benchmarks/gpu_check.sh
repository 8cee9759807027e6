#!/usr/bin/env bash
# Everything the GPU machine should run in one call: GPU tests, kernel benchmarks, the end-to-end example and the
# compiled-decode kernel count. Full logs go to $OUT; a short summary is printed last.
#   bash benchmarks/gpu_check.sh [quick|full|tune|e2e|numerics|topk|rotate|sweep|host|decode|engine|ab|hf]
# topk: GPU tests, the top-k cells with the other kernels' quick cells, CUDA-graph decode steps (B=64 ctx 8192 in
# torch's order and set order, B=1 ctx 32768).
# rotate: GPU tests, the fused Hadamard rotation's kernels against eager/cuBLAS, its numerics against eager
# (docs/numerics.md), a CUDA-graph decode step at B=64 and B=8.
# sweep: `end_to_end.py --sweep` (no GPU tests): cells start until SWEEP_BUDGET_S (default 420) seconds after this
# script started, the rest are listed as not run; SWEEP_CELLS picks cells (e.g. "B1,prefill"), SWEEP_ARGS adds
# options, SWEEP_PREVIOUS=path/sweep.json (a file in the working tree) is appended to. Results: $OUT/sweep/.
# host: host cost of one call of each nsa op against its GPU time (`kernels.py --only host`), and the ops' Python
# alone, with and without host plans, on this machine's host (`host_python.py`).
# decode: GPU tests, the top-k and paged-logits cells, decode steps as engines run them (`--graph-replay`: ten steps
# captured in one CUDA graph by hand) at B=64 ctx 8192 in torch's order and set order, B=8, B=1 ctx 32768; GPU time
# per kernel of the B=64 and B=1 steps (profile_decode.py).
# engine: the engine-fed indexer (metadata as inputs): prefill T=8192 (also without the gather_k_slots pass) and a
# CUDA-graph decode, eager vs nsa_rocm.
# ab: `topk_ab.py` (no GPU tests): the package copies in AB_PKGS ("name=dir,...", default "main=dev/main_pkg,tree=.";
# make a copy with `git archive`, see topk_ab.py, and carry dev/), the cells in AB_CELLS (default: its own), other
# options in AB_ARGS (e.g. "--rounds 3 --kernels").
# hf: Hugging Face's DeepSeek-V3.2 indexer (no GPU tests): `nsa.batched_mqa_logits` against HF's ATen scoring, with
# and without HF's masks (`kernels.py --only batched`), then from scores to top-k (`hf_indexer.py`): eager, default
# Inductor and nsa_rocm under CUDA graphs, decode B=64/8 ctx 8192, B=1 ctx 32768, causal prefill 4096.
# GPU_TESTS=0 skips the GPU tests of the modes that run them (they take ~330 s of the 600 s a device call may run:
# `decode` with them does not fit one call).
set -uo pipefail
start=$(date +%s)
cd "$(dirname "$0")/.."
mode=${1:-quick}
OUT=${OUT:-/tmp/nsa_gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# The backend is found through its entry point, which needs the package installed (the machine has torch already).
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -n 2
summary=()

python3 -c "import torch, triton; print(f'torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}')" \
  | tee "$OUT/versions.txt"

if [ "$mode" = "numerics" ]; then
  python3 benchmarks/stage_diff.py 2>&1 | tee "$OUT/stage_diff.log" | grep '^|'
fi
if [ "$mode" = "numerics" ] || [ "$mode" = "rotate" ]; then
  python3 benchmarks/rotation_numerics.py --device cuda 2>&1 | tee "$OUT/rotation_numerics.log" | grep -v '^$'
fi

if [ "${GPU_TESTS:-1}" = 1 ] && [ "$mode" != "e2e" ] && [ "$mode" != "numerics" ] && [ "$mode" != "sweep" ] \
    && [ "$mode" != "host" ] && [ "$mode" != "engine" ] && [ "$mode" != "ab" ] && [ "$mode" != "hf" ]; then
  python3 -m pytest -q -x -m gpu tests/lowering/test_kernels_gpu.py tests/lowering/test_launch.py tests/test_compiled_indexer.py tests/test_compiled_fuzz.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 15
  summary+=("gpu tests: $(tail -n 1 "$OUT/gpu_tests.log")")
fi

case "$mode" in
  topk) python3 benchmarks/kernels.py --only topk --only head_gate --only paged --only quant --only gather --quick \
          --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -n 5
        python3 benchmarks/end_to_end.py --prefill 0 --cuda-graphs --out "$OUT/e2e_cg" 2>&1 | tee "$OUT/e2e_cg.log" \
          | tail -n 6
        python3 benchmarks/end_to_end.py --prefill 0 --cuda-graphs --topk-order set --variants nsa_rocm \
          --out "$OUT/e2e_cg_set" 2>&1 | tee "$OUT/e2e_cg_set.log" | tail -n 4
        python3 benchmarks/end_to_end.py --prefill 0 --cuda-graphs --batch 1 --ctx 32768 --out "$OUT/e2e_cg_b1" 2>&1 \
          | tee "$OUT/e2e_cg_b1.log" | tail -n 6 ;;
  rotate) python3 benchmarks/kernels.py --only rotate --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -n 12
          python3 benchmarks/end_to_end.py --prefill 0 --cuda-graphs --out "$OUT/e2e_cg" 2>&1 | tee "$OUT/e2e_cg.log" \
            | tail -n 6
          python3 benchmarks/end_to_end.py --prefill 0 --cuda-graphs --batch 8 --out "$OUT/e2e_cg_b8" 2>&1 \
            | tee "$OUT/e2e_cg_b8.log" | tail -n 6 ;;
  sweep) mkdir -p "$OUT/sweep"
         [ -n "${SWEEP_PREVIOUS:-}" ] && cp "$SWEEP_PREVIOUS" "$OUT/sweep/sweep.json"
         python3 benchmarks/end_to_end.py --sweep ${SWEEP_CELLS:+--cells "$SWEEP_CELLS"} ${SWEEP_ARGS:-} \
           --deadline $(( start + ${SWEEP_BUDGET_S:-420} )) --out "$OUT/sweep" 2>&1 | tee "$OUT/sweep.log" \
           | grep -E '^(decode|prefill) ' | tail -n 12
         summary+=("sweep: full table $OUT/sweep/sweep.md, plot $OUT/sweep/sweep.png, log $OUT/sweep.log")
         [ -f "$OUT/sweep/sweep.md" ] && sed -n '/^| variant | entry/,/^$/p' "$OUT/sweep/sweep.md" ;;
  engine) python3 benchmarks/end_to_end.py --engine --batch 0 --prefill 8192 --variants eager,nsa_no_slot_gather,nsa_rocm \
            --out "$OUT/engine_prefill" 2>&1 | tee "$OUT/engine_prefill.log" | tail -n 5
          python3 benchmarks/end_to_end.py --engine --prefill 0 --cuda-graphs --variants eager,nsa_rocm \
            --out "$OUT/engine_decode" 2>&1 | tee "$OUT/engine_decode.log" | tail -n 5 ;;
  hf) python3 benchmarks/kernels.py --only batched --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | grep '^| batched'
      python3 benchmarks/hf_indexer.py 2>&1 | tee "$OUT/hf_indexer.log" | grep '^|' ;;
  host) python3 benchmarks/kernels.py --only host --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -n 3
        python3 benchmarks/host_python.py --calls 1000 2>&1 | tee "$OUT/host_python.log" | grep -E "^\||nothing" ;;
  decode) python3 benchmarks/kernels.py --only topk --only paged --quick --out "$OUT/bench" 2>&1 \
            | tee "$OUT/bench.log" | tail -n 5
          for cell in "64 8192 sorted" "64 8192 set" "8 8192 sorted" "1 32768 sorted"; do
            set -- $cell
            python3 benchmarks/end_to_end.py --prefill 0 --graph-replay --batch "$1" --ctx "$2" --topk-order "$3" \
              --variants inductor,nsa_rocm --out "$OUT/e2e_b$1_$3" 2>&1 | tee "$OUT/e2e_b$1_$3.log" \
              | grep -E '^decode '
          done
          python3 benchmarks/profile_decode.py 2>&1 | tee "$OUT/profile_b64.log" | tail -n 14
          python3 benchmarks/profile_decode.py --batch 1 --ctx 32768 2>&1 | tee "$OUT/profile_b1.log" | tail -n 16 ;;
  ab) copies=()
      IFS=, read -ra pkgs <<< "${AB_PKGS:-main=dev/main_pkg,tree=.}"
      for pkg in "${pkgs[@]}"; do copies+=(--pkg "$pkg"); done
      python3 benchmarks/topk_ab.py "${copies[@]}" ${AB_CELLS:+--cells "$AB_CELLS"} ${AB_ARGS:-} 2>&1 \
        | tee "$OUT/topk_ab.log" ;;
  quick) python3 benchmarks/kernels.py --quick --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -n 40 ;;
  full) python3 benchmarks/kernels.py --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -n 60 ;;
  tune) python3 benchmarks/kernels.py --no-torch --only paged --only ragged ${TUNE_ARGS:-} --out "$OUT/bench" \
          2>&1 | tee "$OUT/bench.log" | tail -n 60 ;;
esac

if [ "$mode" = "e2e" ] || [ "$mode" = "full" ]; then
  python3 examples/deepseek_v32_indexer.py --runs 50 2>&1 | tee "$OUT/example.log" | tail -n 20
  # Default Inductor's prefill hits torch 2.11's searchsorted bug on GPUs (a device-side assert ends the process),
  # so prefill runs without it.
  python3 benchmarks/end_to_end.py --prefill 0 --out "$OUT/e2e" 2>&1 | tee "$OUT/e2e.log" | tail -n 8
  python3 benchmarks/end_to_end.py --prefill 0 --cuda-graphs --out "$OUT/e2e_cuda_graphs" 2>&1 \
    | tee "$OUT/e2e_cuda_graphs.log" | tail -n 8
  python3 benchmarks/end_to_end.py --batch 0 --prefill 4096 --variants eager,nsa_rocm --out "$OUT/e2e_prefill" 2>&1 \
    | tee "$OUT/e2e_prefill.log" | tail -n 8
fi

printf '%s\n' "${summary[@]}"
[ -f "$OUT/bench/results.md" ] && cat "$OUT/bench/results.md"
if [ "$mode" = "sweep" ] && [ -f "$OUT/sweep/sweep_short.md" ]; then
  cat "$OUT/sweep/sweep_short.md"
  grep '^not run' "$OUT/sweep/sweep.md"
fi
exit 0
