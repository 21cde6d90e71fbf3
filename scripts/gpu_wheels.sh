#!/usr/bin/env bash
# Fetches, here, the wheels that scripts/gpu_check.sh installs on a lent device machine (whose
# image has torch but not pyzmq, llguidance or nixl, and reaches no index), into `.whl/`:
#
#   bash scripts/gpu_wheels.sh            # then: run(command=..., carry=[".whl"])
#
# The device image's python is CPython 3.12 on x86-64 (/work/.library/device/KINDS.md); the
# wheels are fetched for it whatever this machine runs. nixl is cut down to what the transfer
# backend loads (scripts/slim_nixl_wheel.sh: 59 MB -> 12 MB), so the tree that travels stays
# under the tool's 64 MiB. `.whl/` is kept out of git through .git/info/exclude (added here).
# Idempotent: a wheel already in `.whl/` is kept.
#
# Switches:
#   GPU_WHEELS_PYTHON   python whose pip downloads                  (python3)
#   GPU_WHEELS          the requirements, space-separated            (below: the versions the
#                       worker's extra pins or was last checked with on the H200)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_WHEELS_PYTHON:-python3}
WHEELS=${GPU_WHEELS:-"pyzmq==27.3.0 llguidance==1.9.1 nixl-cu13==1.5.1"}
DEST=.whl
LIMIT_MIB=40 # of the 64 MiB that travel; the tracked tree is ~9 MiB

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF "/$DEST/" "$exclude" 2>/dev/null || echo "/$DEST/" >>"$exclude"
mkdir -p "$DEST"

# pip matches manylinux tags exactly: name every glibc the image's (2.39) covers.
platforms=(--platform manylinux2014_x86_64)
for minor in 17 24 26 27 28 31 34 35 39; do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done

raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
for req in $WHEELS; do
  name=${req%%[=<>]*}
  stem=${name//-/_}
  if compgen -G "$DEST/${stem}-*.whl" >/dev/null; then
    echo "gpu_wheels: $name: kept $(basename "$DEST/${stem}"-*.whl)"
    continue
  fi
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" -d "$raw" "$req"
  wheel=$(compgen -G "$raw/${stem}-*.whl" | head -n 1) || {
    echo "gpu_wheels: pip download left no wheel for $req in $raw" >&2
    exit 1
  }
  if [[ $stem == nixl_cu* ]]; then
    bash scripts/slim_nixl_wheel.sh "$wheel" "$DEST"
  else
    cp "$wheel" "$DEST/"
    echo "gpu_wheels: $name: $(basename "$wheel")"
  fi
done

total_kib=$(du -sk "$DEST" | cut -f1)
echo "gpu_wheels: $DEST holds $((total_kib / 1024)) MiB: $(ls "$DEST" | tr '\n' ' ')"
if ((total_kib > LIMIT_MIB * 1024)); then
  echo "gpu_wheels: $DEST is over $LIMIT_MIB MiB: the tree would not travel" >&2
  exit 1
fi
