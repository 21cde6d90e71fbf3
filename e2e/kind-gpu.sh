#!/usr/bin/env bash
# The GPU variant of kind.sh: a kind cluster whose node sees the host's NVIDIA GPUs, the NVIDIA
# device plugin, the CUDA worker image, and the tiny model on one GPU (gpu.perPod=1).
# Host prerequisites (not checked by this script beyond nvidia-smi):
#   - NVIDIA driver + nvidia-container-toolkit, with docker's default runtime set to nvidia and
#     `accept-nvidia-visible-devices-as-volume-mounts = true` in
#     /etc/nvidia-container-runtime/config.toml (the way kind nodes receive GPUs), or use nvkind.
#   - docker, kind; helm/kubectl come from scripts/tools.sh.
#   e2e/kind-gpu.sh             # KEEP=1 keeps the cluster
set -euo pipefail
cd "$(dirname "$0")/.."
CLUSTER=${CLUSTER:-dsv4-e2e-gpu}
NS=${NS:-dsv4-e2e}
TAG=${TAG:-e2e}
GPU_TYPE=${GPU_TYPE:-h100-80gb}   # spec.gpu.type: h100-80gb, h200, a100-80gb, a100-40gb
scripts/tools.sh
export PATH="$PWD/.tools/bin:$PATH"
for tool in docker kind helm kubectl nvidia-smi; do
  command -v "$tool" >/dev/null || { echo "kind-gpu.sh: $tool not found" >&2; exit 2; }
done
export KUBECONFIG=${KUBECONFIG:-$PWD/.tools/kubeconfig-$CLUSTER}
trap '[ "${KEEP:-0}" = 1 ] || kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true' EXIT

if ! kind get clusters | grep -x "$CLUSTER" >/dev/null; then
  kind create cluster --name "$CLUSTER" --wait 120s --config - <<'KIND'
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
    extraMounts:
      # With accept-nvidia-visible-devices-as-volume-mounts, this mount asks the NVIDIA runtime
      # to inject every GPU into the node container.
      - hostPath: /dev/null
        containerPath: /var/run/nvidia-container-devices/all
KIND
fi
kind export kubeconfig --name "$CLUSTER"
# The node needs the NVIDIA container runtime inside too (as nvkind sets up).
docker exec "$CLUSTER-control-plane" bash -c \
  'command -v nvidia-ctk >/dev/null && nvidia-ctk runtime configure --runtime=containerd --set-as-default && systemctl restart containerd' || \
  echo "kind-gpu.sh: nvidia-ctk not found in the node image; use nvkind to create the cluster" >&2

helm repo add nvdp https://nvidia.github.io/k8s-device-plugin >/dev/null
helm upgrade --install nvdp nvdp/nvidia-device-plugin -n nvidia-device-plugin --create-namespace --wait
kubectl wait node --all --for=jsonpath='{.status.allocatable.nvidia\.com/gpu}' --timeout=5m

docker build -f Dockerfile.operator -t "dsv4/operator:$TAG" .
docker build -f Dockerfile.worker -t "dsv4/worker:$TAG" .
kind load docker-image --name "$CLUSTER" "dsv4/operator:$TAG" "dsv4/worker:$TAG"
helm upgrade --install dsv4 charts/dsv4-operator -n dsv4-system --create-namespace \
  --set image.repository=dsv4/operator --set image.tag="$TAG" --set image.pullPolicy=Never \
  --set workerImage.repository=dsv4/worker --set workerImage.tag="$TAG" --wait --timeout 5m

kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f -
# The tiny model on one GPU per pod (TP=1): prefill PP=2, decode PP=1.
sed -e 's/^  name: tiny$/  name: tiny-gpu/' \
    -e "s/^    memoryGiB: 0$/    type: $GPU_TYPE/" \
    -e 's/^    perPod: 0$/    perPod: 1/' crds/samples/tiny-cpu.yaml | kubectl apply -n "$NS" -f -
kubectl wait -n "$NS" dsv4/tiny-gpu --for=condition=Ready --timeout=900s
kubectl get dsv4 -n "$NS" -o wide
kubectl get pods -n "$NS" -o custom-columns='POD:.metadata.name,GPU:.spec.containers[0].resources.limits.nvidia\.com/gpu'
kubectl delete dsv4 tiny-gpu -n "$NS" --wait=true
echo "kind-gpu.sh: all good"
