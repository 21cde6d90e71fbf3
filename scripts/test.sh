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
# pytest in parallel (pytest-xdist), a file per worker at a time (a module's fixtures, such as a
# served model, start once): min(CPUs, 4) workers, or DSV4_TEST_WORKERS (0: in this process).
# Most tests wait on subprocesses and sockets, so 2 workers on a 2-core machine took the suite
# from 28 to 15 minutes. Arguments given here come after, so `-n 0` still wins.
workers=${DSV4_TEST_WORKERS:-$(python -c 'import os
cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
print(min(cpus or 1, 4))')}
case "$workers" in
  ''|*[!0-9]*) echo "DSV4_TEST_WORKERS=$workers: must be a whole number (0: in one process)" >&2; exit 2 ;;
esac
parallel=()
how="in one process"
if [ "$workers" -gt 0 ]; then
  parallel=(-n "$workers" --dist loadfile)
  how="$workers workers"
fi
echo "== pytest ($how)"
set +e
python -m pytest ${parallel[@]+"${parallel[@]}"} "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
