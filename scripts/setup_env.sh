#!/usr/bin/env bash
# Creates .venv when missing and installs torch 2.13.0 from pip's configured index (the CPU build on this project's
# machines) plus this package (editable, with test extras).
# Sourced by run_example.sh and run_tests.sh; re-installs only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=".venv/.nsa-installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
