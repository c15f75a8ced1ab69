# Shared settings for cluster/*.sh (sourced, not run). Versions are the cache keys.
# shellcheck shell=bash
K8S_VERSION="${K8S_VERSION:-v1.35.4}"          # k8s.io/kubernetes (proxy serves v1.34.x-v1.37.x)
K8S_STAGING="v0.${K8S_VERSION#v1.}"            # its staging modules, published as v0.35.4
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"        # go.etcd.io/etcd/server/v3 (k8s 1.35 pins 3.6.x, build/dependencies.yaml)
ARGO_VERSION="${ARGO_VERSION:-}"               # empty: v4.1.2 if the proxy serves it, else newest v4
TRAINING_OPERATOR_VERSION="${TRAINING_OPERATOR_VERSION:-v1.9.3}"  # github.com/kubeflow/training-operator (proxy lists only v1.8.1, serves v1.9.0-v1.9.3 exactly)
# Argo's UI (cluster/build.sh ui): built with this yarn from the Argo module's own ui/ source.
# Its one input no registry serves, argo-ui at the commit ui/package.json pins, is vendored
# (../shared/vendor/README.md) and used only where GitHub cannot be reached.
YARN_VERSION="1.22.22"
ARGO_UI_COMMIT="54f36c723d9a0e5d3386689298cbb9c27767fa00"
ARGO_UI_SHA256="ce5ab884f20dc5f2d2695988af25b9552729edab0e7320a0a5967886e16197b6"
VENDOR="${UNET_VENDOR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/shared/vendor}"
PAUSE_TAG="3.10.1"                             # build/pause/Makefile TAG in k8s v1.35.4
DEBIAN_SUITE="bookworm"

CACHE="${UNET_CLUSTER_CACHE:-$HOME/.cache/unet-cluster}"
STATE="${UNET_CLUSTER_STATE:-/var/lib/unet-cluster}"   # certs, etcd data, kubelet and containerd roots
RUN_DIR="${UNET_CLUSTER_RUN:-/run/unet-cluster}"        # sockets, pid files, containerd state
LOGS="$STATE/logs"
KUBECONFIG_ADMIN="$STATE/pki/admin.conf"
CONTAINERD_SOCK="$RUN_DIR/containerd/containerd.sock"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}" CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false"

log() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# Resolve the Argo version once: the exact v4.1.2 first, else the newest v4 the proxy lists.
argo_version() {
  if [[ -n "$ARGO_VERSION" ]]; then echo "$ARGO_VERSION"; return; fi
  if [[ -f "$CACHE/argo-version" ]]; then cat "$CACHE/argo-version"; return; fi
  local v
  if go list -m github.com/argoproj/argo-workflows/v4@v4.1.2 > /dev/null 2>&1; then v=v4.1.2
  else v="$(go list -m -versions github.com/argoproj/argo-workflows/v4 | tr ' ' '\n' | grep -E '^v4\.[0-9]+\.[0-9]+$' | sort -V | tail -n 1)"; fi
  [[ -n "$v" ]] || die "the Go module proxy serves no v4 of github.com/argoproj/argo-workflows/v4"
  mkdir -p "$CACHE"; echo "$v" > "$CACHE/argo-version"; echo "$v"
}

# The UI's dist/app, and the Argo binaries built with it embedded (argo server serves it).
ui_dir() { echo "$CACHE/argo-ui-$(argo_version)"; }
argo_dir() { echo "$CACHE/argo-$(argo_version)-ui"; }
ETCD_DIR="$CACHE/etcd-$ETCD_VERSION"
K8S_DIR="$CACHE/kubernetes-$K8S_VERSION"
OPERATOR_DIR="$CACHE/training-operator-$TRAINING_OPERATOR_VERSION"   # bin/training-operator, crds/, webhook/
IMAGES_DIR="$CACHE/images-pause$PAUSE_TAG-$DEBIAN_SUITE"   # pause.tar, debian.tar
