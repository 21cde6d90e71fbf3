#!/usr/bin/env bash
# A nixl wheel cut down to what dsv4-serve's transfer backend loads, so that it fits the device
# tool's 64 MiB tree limit (nixl_cu13 1.5.1: 59 MB -> 12 MB):
#
#   scripts/slim_nixl_wheel.sh IN.whl OUT_DIR
#
# Kept: the Python package, libnixl and its libraries, the UCX plugin, UCX and its shared-memory
# and CUDA transports. Dropped: nixl_ep (expert-parallel kernels, 3 x 31 MB), every other plugin
# (GDS, object stores, libfabric, ...), UCX's InfiniBand transports and perftest, the scripts, and
# each bundled library that nothing kept loads (read from the ELF NEEDED entries). pip does not
# check RECORD's hashes, so the result installs with `pip install --no-deps`.
set -euo pipefail
in=${1:?usage: slim_nixl_wheel.sh IN.whl OUT_DIR}
out_dir=${2:?usage: slim_nixl_wheel.sh IN.whl OUT_DIR}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
unzip -q "$in" -d "$work"
(
  cd "$work"
  rm -rf nixl_ep_* ./*.scripts ./*.data
  for d in nixl_cu*.libs/nixl .nixl_cu*.mesonpy.libs/plugins; do
    [[ -d $d ]] && find "$d" -type f ! -name libplugin_UCX.so -delete
  done
  rm -f nixl_cu*.libs/ucx/libucx_perftest* nixl_cu*.libs/ucx/libuct_ib*
  python3 - <<'EOF'
import glob, os, subprocess

libs = {
    os.path.basename(p): p
    for p in glob.glob("nixl_cu*.libs/*") + glob.glob(".nixl_cu*.mesonpy.libs/*")
    if os.path.isfile(p)
}
roots = [
    *glob.glob("nixl_cu*/*.so"),
    *glob.glob("nixl_cu*.libs/nixl/*.so"),
    *glob.glob(".nixl_cu*.mesonpy.libs/plugins/*.so"),
    *glob.glob("nixl_cu*.libs/ucx/*.so*"),
]
needed, todo, seen = set(), list(roots), set()
while todo:
    path = todo.pop()
    if path in seen:
        continue
    seen.add(path)
    dynamic = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True)
    for line in dynamic.stdout.splitlines():
        if "(NEEDED)" in line:
            name = line.rsplit("[", 1)[1].rstrip("]")
            if name in libs and name not in needed:
                needed.add(name)
                todo.append(libs[name])
for name, path in libs.items():
    if name not in needed:
        os.remove(path)
EOF
)
mkdir -p "$out_dir"
out="$(cd "$out_dir" && pwd)/$(basename "$in")"
rm -f "$out"
(cd "$work" && zip -q -9 -r -y "$out" .)
echo "$out: $(du -h "$in" | cut -f1) -> $(du -h "$out" | cut -f1)"
