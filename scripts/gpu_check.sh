#!/usr/bin/env bash
# One short GPU check for a lent device machine (see /work/.library/device/README.md): the
# `gpu`-marked tests and every bench that takes `--device cuda`, each under its own `timeout`
# so that one hang cannot eat the rest. Run from the repo root with OUT set:
#
#   OUT=/some/dir bash scripts/gpu_check.sh
#
# Wheels the device image lacks (pyzmq, llguidance, nixl_cu13) travel in `.whl/` (made here by
# scripts/gpu_wheels.sh, git-ignored through .git/info/exclude; the run's `carry`) and are
# installed into GPU_CHECK_SITE. The nixl
# wheel is too big to travel whole (59 MB of 64): scripts/slim_nixl_wheel.sh keeps its UCX
# plugin and the libraries that plugin loads (12 MB).
# 8 logs, the most the device tool brings back from $OUT: env.log (wheels, versions, each step's
# status as it ends, the summary), gpu-tests.log, alloc.log (allocator and engine loop),
# flash.log (Flash-shaped layers and MoE), transfer.log, serve.log (profile and serve), pd.log
# and pp.log.
#
# Switches (defaults are the device machine's):
#   GPU_CHECK_PYTHON      python that runs tests and benches         (python3)
#   GPU_CHECK_PIP_PYTHON  python whose pip installs the wheels        (GPU_CHECK_PYTHON)
#   GPU_CHECK_SITE        where the wheels go; empty: skip them       (/tmp/site)
#   GPU_CHECK_SITE_ON_PATH  0: install the wheels but keep them off PYTHONPATH (a local dry
#                         run whose python is not the wheels' 3.12)   (1)
#   GPU_CHECK_DEVICE      the benches' --device                       (cuda)
#   GPU_CHECK_SCALE       1: the device arguments; 0: the smallest runs (a CPU dry run)
#   GPU_CHECK_BUDGET_S    seconds for the whole script: each step's limit is cut to what is
#                         left, a step with under 10 s left is skipped, so the summary prints
#                         inside the device tool's 600 s per command    (540)
#
# The wheels: `bash scripts/gpu_wheels.sh` here first (fetches and slims them into .whl/); then
# one device call, e.g. run(command="OUT=$OUT bash scripts/gpu_check.sh", carry=[".whl"],
# timeout_s=600). The steps #38 item 7 asks for (allocator, Flash-shaped layers, MoE) run first.
set -u -o pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the logs}"
mkdir -p "$OUT"
PY=${GPU_CHECK_PYTHON:-python3}
PIP_PY=${GPU_CHECK_PIP_PYTHON:-$PY}
SITE=${GPU_CHECK_SITE-/tmp/site}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
SCALE=${GPU_CHECK_SCALE:-1}
export PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo GLOO_SOCKET_IFNAME=lo
ENV_LOG=$OUT/env.log
SUMMARY=()
START_S=$SECONDS
DEADLINE_S=$((SECONDS + ${GPU_CHECK_BUDGET_S:-540}))

# step NAME LIMIT_S LOG CMD...: run CMD under `timeout` (LIMIT_S, cut to the budget left), its
# output appended to LOG; records the exit status (124: timed out; "skip": no budget left) and
# seconds in the summary, and at once in env.log (a run killed later keeps it). Never stops the
# script.
step() {
  local name=$1 limit_s=$2 log=$3
  shift 3
  local t0=$SECONDS rc left_s=$((DEADLINE_S - SECONDS))
  if ((left_s < 10)); then
    rc=skip
    echo "=== $name: skipped, ${left_s}s of the budget left" | tee -a "$log"
  else
    ((limit_s > left_s)) && limit_s=$left_s
    echo "=== $name (limit ${limit_s}s): $*" | tee -a "$log"
    timeout -k 5 "$limit_s" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
  fi
  SUMMARY+=("$(printf '%-14s rc=%-4s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
  echo "=== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$log"
  [[ $log == "$ENV_LOG" ]] || echo "step ${SUMMARY[-1]}" >>"$ENV_LOG"
}

# (a) Wheels, then PYTHONPATH: the wheels' site, the package roots and the pytest helper
# folders (both read from pyproject.toml, so moved packages need no edit here).
{
  echo "=== start $(date -u +%FT%TZ) device=$DEVICE scale=$SCALE python=$PY"
  if [[ -n $SITE ]] && compgen -G ".whl/*.whl" >/dev/null; then
    "$PIP_PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" .whl/*.whl && echo "wheels: $(ls .whl | tr '\n' ' ')-> $SITE"
  fi
} 2>&1 | tee -a "$ENV_LOG"
ROOTS=$("$PY" - <<'EOF'
import os, tomllib
with open("pyproject.toml", "rb") as f:
    cfg = tomllib.load(f)
roots = cfg["tool"]["setuptools"]["packages"]["find"]["where"]
helpers = cfg["tool"]["pytest"]["ini_options"].get("pythonpath", [])
print(os.pathsep.join(os.path.abspath(p) for p in [*roots, *helpers]))
EOF
)
PYPATH=$ROOTS
if [[ -n $SITE && ${GPU_CHECK_SITE_ON_PATH:-1} != 0 ]]; then PYPATH=$SITE:$PYPATH; fi
export PYTHONPATH=$PYPATH${PYTHONPATH:+:$PYTHONPATH}
# UCX's CUDA memory hooks (nixl's libucm_cuda) load libcudart by soname: torch's wheels keep it
# in their site-packages, off the loader's path.
CUDART_DIR=$("$PY" - <<'EOF'
import glob, os, site
for root in site.getsitepackages():
    for path in sorted(glob.glob(os.path.join(root, "nvidia", "**", "libcudart.so.*"), recursive=True)):
        print(os.path.dirname(path))
        raise SystemExit
EOF
)
if [[ -n $CUDART_DIR ]]; then export LD_LIBRARY_PATH=$CUDART_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; fi
echo "libcudart from: ${CUDART_DIR:-(none found)}" | tee -a "$ENV_LOG"

# (b) The machine and the stack.
{
  nvidia-smi -L 2>&1 || echo "nvidia-smi: not here"
  "$PY" - <<'EOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.1f} GiB", "SMs", p.multi_processor_count)
for name in ("zmq", "llguidance", "nixl_cu12", "nixl_cu13", "nixl", "aiohttp", "uvloop",
             "dsv4_cli", "dsv4_worker", "dsv4_router"):
    try:
        m = importlib.import_module(name)
        print(f"import {name}: ok {getattr(m, '__version__', '')} {getattr(m, '__file__', '')}")
    except Exception as e:  # the report says what is missing; the steps still run
        print(f"import {name}: FAILED {type(e).__name__}: {e}")
EOF
} 2>&1 | tee -a "$ENV_LOG"

# (c) The benches that take --device, a few rounds each, medians printed: #38 item 7's first
# (allocator, Flash-shaped layers, MoE), then the gpu tests, then the rest.
if [[ $SCALE == 1 ]]; then
  ALLOC=(--rounds 3 --repeats 20) ENGINE=(--rounds 3 --steps 20)
  XFER=(--total-mib 1024 --repeats 5) BIG_PAGE=(--page-kib 16384)
  SERVE=(--rounds 3 --requests 2 --max-tokens 32 --clients 1 32)
  PD=(--rounds 2 --requests 2 --ttft-requests 10 --max-tokens 32 --clients 1)
  PP=(--rounds 2 --requests 2 --max-tokens 32 --clients 1 32)
  PROFILE=(--steps 16)
  # Flash-shaped layers (bench/flash_layers.py): real dimensions, 2 layers (CSA + HCA), random
  # weights as stored (FP8/FP4), the default KV format; decode steps at 1/64/256 running.
  FLASH=(--layers 2 --running 1 64 256 --steps 8 --prompt-tokens 256 --launches)
  # One Flash MoE layer's routed experts (FP4 as stored): every_expert against on_device.
  MOE=(--tokens 1 64 256 --rounds 3)
else
  ALLOC=(--rounds 1 --repeats 2 --pages 16) ENGINE=(--rounds 1 --steps 2 --running 1 64)
  XFER=(--total-mib 8 --repeats 1) BIG_PAGE=(--page-kib 4096)
  SERVE=(--rounds 1 --requests 1 --max-tokens 4 --clients 1 2 --no-replay)
  PD=(--rounds 1 --requests 1 --ttft-requests 2 --max-tokens 4 --clients 1)
  PP=(--rounds 1 --requests 1 --max-tokens 4 --clients 1)
  PROFILE=(--steps 2)
  FLASH=(--layers 2 --experts 8 --vocab 1024 --running 1 2 --steps 2 --prompt-tokens 130 --launches)
  MOE=(--experts 8 --hidden 256 --inter 128 --tokens 1 4 --rounds 1)
fi
D=(--device "$DEVICE")
# The allocator per operation on the device (#38 item 7: target <= 30 us, 95-520 us before the
# host tables) and the calls in each that would sync (--syncs: 0 expected in every row; the gpu
# tests below also run them under torch.cuda.set_sync_debug_mode("error")).
step alloc 60 "$OUT/alloc.log" "$PY" bench/alloc.py "${D[@]}" "${ALLOC[@]}" --syncs
# Weights held as stored on the device, and which path block-FP8 linears take (a scaled FP8
# matmul or dequantize-then-matmul): the script prints both before its step times.
step flash-layers 120 "$OUT/flash.log" "$PY" bench/flash_layers.py "${D[@]}" "${FLASH[@]}"
step moe 30 "$OUT/flash.log" "$PY" bench/moe.py "${D[@]}" "${MOE[@]}"
# (d) The gpu-marked tests: the files that carry the mark (the cluster ones need Kubernetes and
# are left out), so no unrelated test module is imported.
mapfile -t GPU_TESTS < <(grep -rl --include='test_*.py' 'mark\.gpu' common worker router local bench \
  2>/dev/null | sort)
step gpu-tests 120 "$OUT/gpu-tests.log" "$PY" -m pytest -m "gpu and not cluster" -q \
  -p no:cacheprovider --continue-on-collection-errors -rs "${GPU_TESTS[@]}"
step engine 25 "$OUT/alloc.log" "$PY" bench/engine.py "${D[@]}" "${ENGINE[@]}"
# NIXL between two processes' GPU memory (VRAM_SEG) at two page sizes; zmq through host frames.
step transfer 60 "$OUT/transfer.log" "$PY" bench/transfer.py "${D[@]}" --backends nixl,zmq \
  "${XFER[@]}"
step transfer-big 40 "$OUT/transfer.log" "$PY" bench/transfer.py "${D[@]}" --backends nixl \
  "${BIG_PAGE[@]}" "${XFER[@]}"
step profile 40 "$OUT/serve.log" "$PY" bench/profile_step.py "${D[@]}" "${PROFILE[@]}"
step serve 50 "$OUT/serve.log" "$PY" bench/serve.py "${D[@]}" "${SERVE[@]}"
step pd 80 "$OUT/pd.log" "$PY" bench/pd.py "${D[@]}" --transfer nixl "${PD[@]}"
# PP=2 puts both stages on the one GPU (NCCL may refuse that); last, so a failure costs least.
step pp 40 "$OUT/pp.log" "$PY" bench/pp.py "${D[@]}" --pp 1 2 "${PP[@]}"

{
  echo "=== summary ($((SECONDS - START_S))s in all; rc 124: timed out)"
  printf '%s\n' "${SUMMARY[@]}"
} 2>&1 | tee -a "$ENV_LOG"
