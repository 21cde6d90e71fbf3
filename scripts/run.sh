#!/usr/bin/env bash
# The main job on the embedded default: set up if needed, then run the tiny PD deployment
# (crds/samples/tiny-pd.yaml: router, one prefill and one decode worker, KV over NIXL) as local
# processes on 127.0.0.1 with `dsv4 up`, send one completion through the router, print it and
# stop. `scripts/run.sh --serve` leaves it serving (Ctrl-C stops every process); any other
# arguments are passed to `dsv4` (scripts/run.sh plan --model deepseek-v4-pro ...).
# Set-up installs only what this job needs (`scripts/setup.sh main`: no helm, kubectl, operator
# or dev tools). Every line it prints says what it is ("setup:", "dsv4 up:", "api:", "status:",
# "logs:", "completion:").
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh main
SAMPLE=crds/samples/tiny-pd.yaml
if [ "${1:-}" = "--serve" ]; then
  shift
  exec .venv/bin/dsv4 up "$SAMPLE" "$@"
fi
if [ "$#" -gt 0 ]; then
  exec .venv/bin/dsv4 "$@"
fi
# tiny ships weights trained on Debian's license texts (scripts/train_tiny.py): ask in kind.
exec .venv/bin/dsv4 up "$SAMPLE" --port 0 --max-tokens 48 --request "This License applies to"
