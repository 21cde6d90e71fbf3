#!/usr/bin/env bash
# checkov's Kubernetes policies on everything we render: every valid sample's objects (as
# `dsv4 render` prints them) and the chart (`helm template`). Fails on any finding that
# scripts/checkov-allowlist.yaml does not explain, per check id, with the reason.
#
# Opt-in: CI does not run it (checkov is a heavy install). checkov is not a project dependency:
# it goes into a throwaway venv under the cache dir, created on first use (a minute or two;
# PyPI through pip). Needs .venv (scripts/setup.sh) and helm (scripts/tools.sh).
#
#   scripts/checkov.sh              scan; exit 1 on an unexplained finding
#   KEEP=1 scripts/checkov.sh       keep the rendered inputs and checkov's report (printed path)
#   CHECKOV_VERSION=x.y.z ...       another checkov release (its own venv)
set -euo pipefail
cd "$(dirname "$0")/.."

CHECKOV_VERSION=${CHECKOV_VERSION:-3.3.30}
VENV=${XDG_CACHE_HOME:-$HOME/.cache}/dsv4-serve/checkov-$CHECKOV_VERSION
PY=.venv/bin/python

[ -x "$PY" ] || { echo "checkov: $PY missing: run scripts/setup.sh" >&2; exit 2; }
scripts/tools.sh
if ! "$VENV/bin/checkov" --version >/dev/null 2>&1; then
  echo "checkov: installing checkov==$CHECKOV_VERSION into $VENV"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "checkov==$CHECKOV_VERSION"
fi

work=$(mktemp -d)
if [ -n "${KEEP:-}" ]; then
  echo "checkov: inputs and report kept in $work"
else
  trap 'rm -rf "$work"' EXIT
fi

"$PY" scripts/checkov_scan.py render "$work/inputs" >/dev/null
# Exit 1 means "some check failed": the verdict is the allowlist's, below. --skip-download:
# nothing is fetched from checkov's vendor (the policies ship in the package).
rc=0
"$VENV/bin/checkov" -d "$work/inputs" --framework kubernetes --compact --skip-download \
  --output json >"$work/report.json" || rc=$?
if [ "$rc" -gt 1 ]; then
  echo "checkov: failed (exit $rc)" >&2
  exit "$rc"
fi
"$PY" scripts/checkov_scan.py check "$work/report.json" "$work/inputs"
