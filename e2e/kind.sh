#!/usr/bin/env bash
# End-to-end on kind (CPU only): create a cluster, build and load both images (worker with
# CPU=1), install the chart, deploy the tiny model in CPU mode, wait for Ready, send a completion
# through the router, delete the CR and check that everything it owned is gone; then run the
# pytest `cluster` suite against the same cluster.
# Needs docker and kind on PATH (helm/kubectl come from scripts/tools.sh). Not runnable on the
# dev/CI machines (no Docker engine there).
#   e2e/kind.sh                 # KEEP=1 keeps the cluster; CLUSTER=name picks it
set -euo pipefail
cd "$(dirname "$0")/.."
CLUSTER=${CLUSTER:-dsv4-e2e}
NS=${NS:-dsv4-e2e}
TAG=${TAG:-e2e}
TIMEOUT=${TIMEOUT:-900s}
scripts/tools.sh
export PATH="$PWD/.tools/bin:$PATH"
for tool in docker kind helm kubectl curl; do
  command -v "$tool" >/dev/null || { echo "kind.sh: $tool not found" >&2; exit 2; }
done
export KUBECONFIG=${KUBECONFIG:-$PWD/.tools/kubeconfig-$CLUSTER}

step() { printf '\n== %s\n' "$*"; }
pf_pid=""
cleanup() {
  if [ -n "$pf_pid" ]; then kill "$pf_pid" 2>/dev/null || true; fi
  if [ "${KEEP:-0}" != 1 ]; then kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

step "cluster $CLUSTER"
if ! kind get clusters | grep -x "$CLUSTER" >/dev/null; then
  kind create cluster --name "$CLUSTER" ${KIND_NODE_IMAGE:+--image "$KIND_NODE_IMAGE"} --wait 120s
fi
kind export kubeconfig --name "$CLUSTER"

step "images"
docker build -f Dockerfile.operator -t "dsv4/operator:$TAG" .
docker build -f Dockerfile.worker --build-arg CPU=1 -t "dsv4/worker:$TAG-cpu" .
kind load docker-image --name "$CLUSTER" "dsv4/operator:$TAG" "dsv4/worker:$TAG-cpu"

step "chart"
helm upgrade --install dsv4 charts/dsv4-operator -n dsv4-system --create-namespace \
  --set image.repository=dsv4/operator --set image.tag="$TAG" --set image.pullPolicy=Never \
  --set workerImage.repository=dsv4/worker --set workerImage.tag="$TAG-cpu" \
  --wait --timeout 5m
kubectl rollout status -n dsv4-system statefulset/dsv4-dsv4-operator --timeout=5m

step "tiny model, CPU mode"
kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f -
kubectl apply -n "$NS" -f crds/samples/tiny-cpu.yaml
kubectl wait -n "$NS" dsv4/tiny --for=condition=Ready --timeout="$TIMEOUT"
kubectl get dsv4 -n "$NS" -o wide
uid=$(kubectl get dsv4 tiny -n "$NS" -o jsonpath='{.metadata.uid}')
endpoint=$(kubectl get dsv4 tiny -n "$NS" -o jsonpath='{.status.endpoint}')
svc=${endpoint#*://}; svc=${svc%%.*}
port=${endpoint##*:}; port=${port%%/*}

step "completion through svc/$svc:$port"
kubectl port-forward -n "$NS" "svc/$svc" 18000:"$port" >/dev/null 2>&1 &
pf_pid=$!
for _ in $(seq 50); do curl -fsS -o /dev/null http://127.0.0.1:18000/health 2>/dev/null && break; sleep 0.2; done
curl -fsS http://127.0.0.1:18000/v1/completions -H 'Content-Type: application/json' \
  -d '{"prompt": "Hello", "max_tokens": 8, "temperature": 0}' | tee /dev/stderr | grep '"choices"' >/dev/null
kill "$pf_pid"; pf_pid=""

step "delete and check owned objects are gone"
owned() {
  kubectl get statefulsets,deployments,services,configmaps,poddisruptionbudgets,networkpolicies,serviceaccounts,pods \
    -n "$NS" -o jsonpath="{range .items[?(@.metadata.ownerReferences[0].uid==\"$uid\")]}{.kind}/{.metadata.name}{\"\\n\"}{end}"
}
[ -n "$(owned)" ] || { echo "no owned objects found before delete" >&2; exit 1; }
kubectl delete dsv4 tiny -n "$NS" --wait=true --timeout="$TIMEOUT"
for _ in $(seq 100); do [ -z "$(owned)" ] && break; sleep 3; done
left=$(owned)
[ -z "$left" ] || { echo "still present after delete:"; echo "$left"; exit 1; } >&2

step "pytest -m cluster"
.venv/bin/python -m pytest -m cluster e2e -q
echo "kind.sh: all good"
