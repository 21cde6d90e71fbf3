#!/usr/bin/env bash
# The main job on the embedded default: set up if needed, then plan the tiny PD deployment
# (prefill PP=2, decode PP=1) on CPU. Extra arguments replace the defaults: scripts/run.sh plan ...
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ "$#" -gt 0 ]; then
  exec .venv/bin/dsv4 "$@"
fi
.venv/bin/dsv4 plan --model tiny --role prefill --pp 2 --gpu-memory-gib 0.25 --chunked-prefill-size 256
.venv/bin/dsv4 plan --model tiny --role decode --pp 1 --gpu-memory-gib 0.25 --max-running-requests 64
