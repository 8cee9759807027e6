#!/usr/bin/env bash
# The test suite (set-up included). GPU tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
exec .venv/bin/python -m pytest -q "$@"
