#!/usr/bin/env bash
# The test command: set up if needed, then lint (ruff, mypy, import-linter) and run pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh -k planner).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$PWD/.venv/bin:$PWD/.tools/bin:$PATH"
# One command per line: under `set -e`, a failure inside an `a && b` list does not stop the script.
echo "== ruff"
ruff check .
ruff format --check .
echo "== mypy"; mypy
echo "== import-linter"; lint-imports
echo "== pytest"
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
