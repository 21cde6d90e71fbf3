#!/usr/bin/env bash
# Create .venv and install dsv4-serve. Idempotent; safe to re-run.
#   scripts/setup.sh        every extra, then helm and kubectl (scripts/tools.sh): the tests
#   scripts/setup.sh main   only what the main job (scripts/run.sh: dsv4 up) needs: the worker
#                           extra (torch, NIXL, aiohttp...), no operator, dev tools or helm
# torch is pinned in the same pip command as everything else so the resolver keeps the CPU
# wheel (an unpinned torch pulls several GB of CUDA wheels). Every line printed starts with
# "setup:" (or "tools:").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
what=${1:-all}
case "$what" in
  all) extras="worker,operator,dev"; stamp=.venv/.dsv4-installed ;;
  main) extras="worker"; stamp=.venv/.dsv4-installed-main ;;
  *) echo "setup: unknown argument '$what' (expected: main, or nothing for everything)" >&2; exit 2 ;;
esac
full=.venv/.dsv4-installed  # everything installed covers the main job too
fresh() { [ -f "$1" ] && ! [ pyproject.toml -nt "$1" ]; }
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
if ! fresh "$stamp" && ! fresh "$full"; then
  echo "setup: installing dsv4-serve[$extras] (torch==2.13.0 CPU wheel) into .venv"
  # pip's own warnings and errors, labeled too (pipefail keeps pip's exit status).
  .venv/bin/pip install --quiet --disable-pip-version-check \
    "torch==2.13.0" -e ".[$extras]" 2>&1 | sed -u 's/^/setup: pip: /' >&2
  touch "$stamp"
fi
if [ "$what" = all ] && [ -x scripts/tools.sh ]; then
  scripts/tools.sh
fi
