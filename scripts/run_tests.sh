#!/usr/bin/env bash
# The test suite (set-up included). GPU tests skip without a GPU. Two worker processes (most of the time is
# compiling, one core each), each test file run whole by one of them, so its module fixtures are built once. Extra
# arguments go to pytest (e.g. `-n 0` for one process, `-k ...`).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
