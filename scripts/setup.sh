#!/usr/bin/env bash
# Create .venv and install dsv4-serve with every extra. Idempotent; safe to re-run.
# torch is pinned in the same pip command as everything else so the resolver keeps the CPU
# wheel (an unpinned torch pulls several GB of CUDA wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.dsv4-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing dsv4-serve[worker,operator,dev] (torch==2.13.0 CPU wheel)"
  .venv/bin/pip install --quiet --disable-pip-version-check \
    "torch==2.13.0" -e ".[worker,operator,dev]"
  touch "$stamp"
fi
if [ -x scripts/tools.sh ]; then
  scripts/tools.sh
fi
