#!/usr/bin/env bash
# The main job on the embedded default: set up if needed, then run the tiny PD deployment
# (crds/samples/tiny-pd.yaml: router, one prefill and one decode worker, KV over NIXL) as local
# processes on 127.0.0.1 with `dsv4 up`, send one completion through the router, print it and
# stop. Set-up installs only what this job needs (`scripts/setup.sh main`: no helm, kubectl,
# operator or dev tools). Every line it prints says what it is ("setup:", "dsv4 up:", "api:",
# "status:", "logs:", "completion:").
#   scripts/run.sh                     the job: one completion, then stop
#   scripts/run.sh --serve             leave it serving (Ctrl-C stops every process)
#   scripts/run.sh [--serve] FLAGS     FLAGS go to `dsv4 up` (--port 9000, --keep-workdir,
#                                      --max-tokens N, --timeout-s S: dsv4 up --help)
#   scripts/run.sh plan|render|serve|up ARGS
#                                      any dsv4 command (scripts/run.sh plan --model ...)
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  -h | --help)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
    ;;
  plan | render | serve | up)
    scripts/setup.sh main
    exec .venv/bin/dsv4 "$@"
    ;;
esac
serve=0
flags=()
for arg in "$@"; do
  if [ "$arg" = "--serve" ]; then serve=1; else flags+=("$arg"); fi
done
scripts/setup.sh main
SAMPLE=crds/samples/tiny-pd.yaml
if [ "$serve" = 1 ]; then
  exec .venv/bin/dsv4 up "$SAMPLE" ${flags[@]+"${flags[@]}"}
fi
# tiny ships weights trained on Debian's license texts (scripts/train_tiny.py): ask in kind.
# The user's flags come last, so theirs win (argparse keeps a flag's last value).
exec .venv/bin/dsv4 up "$SAMPLE" --port 0 --max-tokens 48 --request "This License applies to" \
  ${flags[@]+"${flags[@]}"}
