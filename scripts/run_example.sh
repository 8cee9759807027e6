#!/usr/bin/env bash
# The main example: eager vs nsa_rocm-compiled DeepSeek-V3.2 indexer (set-up included).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
exec .venv/bin/python examples/deepseek_v32_indexer.py "$@"
