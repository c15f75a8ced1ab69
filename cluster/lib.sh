# Shared settings for cluster/*.sh (sourced, not run). Versions are the cache keys.
# shellcheck shell=bash
K8S_VERSION="${K8S_VERSION:-v1.35.4}"          # k8s.io/kubernetes (proxy serves v1.34.x-v1.37.x)
K8S_STAGING="v0.${K8S_VERSION#v1.}"            # its staging modules, published as v0.35.4
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"        # go.etcd.io/etcd/server/v3 (k8s 1.35 pins 3.6.x, build/dependencies.yaml)
ARGO_VERSION="${ARGO_VERSION:-v4.0.5}"         # github.com/argoproj/argo-workflows/v4 (the newest v4 the proxy serves; v4.1.x: 403)
CNI_PLUGINS_VERSION="${CNI_PLUGINS_VERSION:-v1.10.0}"   # github.com/containernetworking/plugins
COREDNS_VERSION="${COREDNS_VERSION:-v1.15.0}"          # github.com/coredns/coredns (the cluster's DNS)
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
POD_LOGS="$STATE/pod-logs"                              # the kubelet's podLogsDir
CGROUP_ROOT="${UNET_CLUSTER_CGROUP:-unet-cluster}"      # the kubelet's cgroupRoot, in each v1 hierarchy
# The pod network: a bridge (CNI bridge + host-local) whose address is the pods' gateway, the
# Service range that kube-proxy serves, and cluster DNS (CoreDNS) at its conventional address.
BRIDGE=unetcni0
POD_CIDR=10.244.0.0/24
SERVICE_CIDR=10.96.0.0/12
DNS_IP=10.96.0.10
KUBECONFIG_ADMIN="$STATE/pki/admin.conf"
CONTAINERD_SOCK="$RUN_DIR/containerd/containerd.sock"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}" CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false"

log() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
# Every cgroup hierarchy: the v1 ones, the named systemd one (the kubelet wants its cgroupRoot
# in each: cgroupManager.Validate) and, on a hybrid host, the unified one (runc makes the pods'
# cgroups there too).
cgroup_hierarchies() {
  local h
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then echo /sys/fs/cgroup; return; fi   # v2 only
  for h in /sys/fs/cgroup/*/; do
    [[ -f "${h}cgroup.procs" ]] && echo "${h%/}"
  done
}
# What iptables/ip6tables hold of a Kubernetes node or of ours, in `-S` form, per table: the
# KUBE-* chains and jumps of the kubelet (pkg/kubelet/kubelet_network_linux.go) and kube-proxy
# (pkg/proxy/iptables/proxier.go), the CNI-* ones of CNI plugins (portmap) and the rules with
# the comment unet-cluster (up.sh).
our_rules() {  # IPT TABLE
  "$1" -t "$2" -S 2> /dev/null | grep -E '^-[AN] (KUBE|CNI)-|-j (KUBE|CNI)-|--comment "?unet-cluster' || true
}
IPT_TABLES="filter nat mangle"
# guard PORT [IFACE]: drop what reaches PORT from anywhere but loopback (and IFACE, the pods'
# bridge), in both families (up.sh). down.sh removes the rules by their comment.
guard() {
  local ipt rule
  for ipt in iptables ip6tables; do
    rule=(INPUT ! -i lo -p tcp --dport "$1" -m comment --comment unet-cluster -j DROP)
    "$ipt" -C "${rule[@]}" 2> /dev/null || "$ipt" -I "${rule[@]}"
    [[ -n "${2:-}" ]] || continue
    rule=(INPUT -i "$2" -p tcp --dport "$1" -m comment --comment unet-cluster -j ACCEPT)
    "$ipt" -C "${rule[@]}" 2> /dev/null || "$ipt" -I "${rule[@]}"
  done
}
die() { log "ERROR: $*"; exit 1; }

# The cluster's host processes (no systemd here): each started detached with its pid in
# $RUN_DIR/NAME.pid and its output in $LOGS/NAME.log.
pid_of() { [[ -f "$RUN_DIR/$1.pid" ]] && cat "$RUN_DIR/$1.pid" || true; }
alive() { [[ -n "$1" ]] && kill -0 "$1" 2> /dev/null; }
start() {  # NAME CMD...
  local name="$1"; shift
  if alive "$(pid_of "$name")"; then
    log "$name already running (pid $(pid_of "$name"))"; return
  fi
  setsid "$@" >> "$LOGS/$name.log" 2>&1 < /dev/null &
  echo $! > "$RUN_DIR/$name.pid"
}
stop() {  # NAME [GRACE]: SIGTERM, then SIGKILL after GRACE s (15); only the pid up.sh recorded
  local pid; pid="$(pid_of "$1")"
  if alive "$pid"; then
    log "stopping $1 (pid $pid)"
    kill "$pid" 2> /dev/null || true
    for _ in $(seq $(( ${2:-15} * 2 ))); do alive "$pid" || break; sleep 0.5; done
    alive "$pid" && kill -9 "$pid" 2> /dev/null || true
  fi
  rm -f "$RUN_DIR/$1.pid"
}
# restore_sysctls SAVED [ROOT]: write back each "key value" line of SAVED (what up.sh found before
# the kubelet changed it) under ROOT (/proc/sys), then read each back; prints one line per key
# that does not hold its value again and returns 1 if there is one.
restore_sysctls() {
  local saved="$1" root="${2:-/proc/sys}" k v now failed=0
  while read -r k v; do
    { echo "$v" > "$root/$k"; } 2> /dev/null || true
    now="$(cat "$root/$k" 2> /dev/null || echo '(unreadable)')"
    [[ "$now" == "$v" ]] || { echo "sysctl $k is $now, not $v as before the cluster"; failed=1; }
  done < "$saved"
  return "$failed"
}
# keep_logs DEST: copy the cluster's own logs ($LOGS: etcd, the API server, the kubelet, ...,
# and argo server's port-forward) and its pods' ($POD_LOGS, the kubelet's podLogsDir: argo
# server, the controller, every step) into DEST, a new folder outside $STATE, so that what a
# failed run saw outlives down.sh's removal of $STATE. Links are copied as the files they name.
keep_logs() {
  local dest="$1"
  case "$(realpath -m "$dest")/" in "$(realpath -m "$STATE")"/*)
    log "keep_logs: $dest is inside $STATE, which down.sh removes"; return 1;; esac
  [[ ! -e "$dest" ]] || { log "keep_logs: $dest exists; it must be a new folder"; return 1; }
  mkdir -p "$dest"
  local d; for d in "$LOGS" "$POD_LOGS"; do
    [[ ! -d "$d" ]] || cp -rL "$d" "$dest/" 2> /dev/null || log "keep_logs: part of $d not copied"
  done
}
# module_dir MODULE@VERSION: its folder in the Go module cache, downloaded if needed.
module_dir() {
  go mod download -json "$1" | sed -n 's/^\s*"Dir": "\(.*\)",$/\1/p'
}
# module_manifests MODULE@VERSION DIR: DIR afresh, holding a writable copy of the module's
# manifests/ (kustomize takes no absolute path: a kustomization beside it names manifests/...).
module_manifests() {
  local src; src="$(module_dir "$1")"
  [[ -d "$src/manifests" ]] || die "no manifests/ in $1 (${src:-not downloaded})"
  rm -rf "$2"; mkdir -p "$2"
  cp -r "$src/manifests" "$2/manifests"; chmod -R u+w "$2/manifests"
}

argo_version() { echo "$ARGO_VERSION"; }   # one pin, no guessing: what ran is what is cached

# The UI's dist/app, and the Argo binaries built with it embedded (argo server serves it).
ui_dir() { echo "$CACHE/argo-ui-$(argo_version)"; }
argo_dir() { echo "$CACHE/argo-$(argo_version)-ui"; }
# Its images: argoexec.tar, workflow-controller.tar, argocli.tar (cluster/build.sh argo-images).
argo_images_dir() { echo "$CACHE/argo-images-$(argo_version)"; }
ETCD_DIR="$CACHE/etcd-$ETCD_VERSION"
K8S_DIR="$CACHE/kubernetes-$K8S_VERSION"
KUBE_PROXY_DIR="$CACHE/kube-proxy-$K8S_VERSION"
CNI_DIR="$CACHE/cni-plugins-$CNI_PLUGINS_VERSION"     # bin/{bridge,host-local,loopback,portmap}
COREDNS_DIR="$CACHE/coredns-$COREDNS_VERSION"          # bin/coredns, coredns.tar (its image)
OPERATOR_DIR="$CACHE/training-operator-$TRAINING_OPERATOR_VERSION"   # bin/training-operator
OPERATOR_IMAGE_DIR="$CACHE/training-operator-image-$TRAINING_OPERATOR_VERSION"   # training-operator.tar
OPERATOR_IMAGE="localhost/unet-cluster/training-operator:$TRAINING_OPERATOR_VERSION"
IMAGES_DIR="$CACHE/images-pause$PAUSE_TAG-$DEBIAN_SUITE"   # pause.tar, debian.tar
