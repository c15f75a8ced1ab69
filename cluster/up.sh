#!/usr/bin/env bash
# Start the single-node cluster from the binaries and images that cluster/build.sh cached:
# etcd -> kube-apiserver -> controller-manager + scheduler -> containerd + kubelet -> Argo.
#   bash cluster/up.sh [etcd|control-plane|node|argo]   (start up to that stage; default argo)
# Every listener is on 127.0.0.1; the admin kubeconfig is $STATE/pki/admin.conf (printed at the
# end). Logs: $STATE/logs/. Stop everything with cluster/down.sh.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/lib.sh"
target="${1:-argo}"
case "$target" in etcd) last=1 ;; control-plane) last=2 ;; node) last=3 ;; argo) last=4 ;;
  *) die "unknown stage $target (etcd, control-plane, node, argo)" ;; esac
ARGO_V="$(argo_version)"
ARGO_DIR="$(argo_dir)"
ARGO_IMAGES="$(argo_images_dir)"
K="$K8S_DIR/bin"
PKI="$STATE/pki"
t_start=$(date +%s)

need_built() { for f in "$@"; do [[ -e "$f" ]] || die "$f missing: run bash cluster/build.sh first"; done; }
# wait_for DESC SECONDS CMD...: poll until CMD succeeds; on timeout show the log tail and fail.
wait_for() {
  local desc="$1" secs="$2"; shift 2
  local t0=$SECONDS
  until "$@" > /dev/null 2>&1; do
    if (( SECONDS - t0 > secs )); then
      for f in "$LOGS"/*.log; do echo "--- tail of $f" >&2; tail -n 5 "$f" >&2; done
      die "timed out after ${secs}s waiting for $desc"   # last, where a caller's tail shows it
    fi
    sleep 1
  done
  log "  $desc ready after $(( SECONDS - t0 ))s"
}
kc() { kubectl --kubeconfig "$KUBECONFIG_ADMIN" "$@"; }
# The address of the default route's interface: the node's InternalIP (the kubelet picks the
# same: pkg/kubelet/nodestatus/setters.go) and the API server's advertised address.
node_ip() {
  local dev; dev="$(ip -4 route show default | awk '{print $5; exit}')"
  ip -4 -o addr show dev "${dev:?no default route}" scope global | awk '{sub("/.*", "", $4); print $4; exit}'
}
# sa_kubeconfig NAMESPACE ACCOUNT FILE: a kubeconfig (mode 600) that acts as that ServiceAccount.
sa_kubeconfig() {
  (umask 077; cp "$KUBECONFIG_ADMIN" "$3")
  kubectl --kubeconfig "$3" config set-credentials "$2" \
    --token="$(kc -n "$1" create token "$2" --duration=48h)" > /dev/null
  kubectl --kubeconfig "$3" config set-context --current --user="$2" --namespace="$1" > /dev/null
}

mkdir -p "$STATE" "$RUN_DIR" "$LOGS"
chmod 700 "$STATE" "$RUN_DIR"
bash "$here/../manifests/install-kubectl.sh" > /dev/null   # within one minor of the API server
# What down.sh may take away is what was not here before the first start: the iptables and
# ip6tables rules of a Kubernetes node (another cluster's included), and /var/log/containers.
if [[ ! -f "$RUN_DIR/before.rules" ]]; then
  for ipt in iptables ip6tables; do
    for t in $IPT_TABLES; do our_rules "$ipt" "$t" | sed "s/^/$ipt $t /"; done
  done > "$RUN_DIR/before.rules"
  [[ -d /var/log/containers ]] || touch "$RUN_DIR/made-var-log-containers"
fi

# ---- 1. certificates and etcd ----------------------------------------------------------------
need_built "$ETCD_DIR/bin/etcd" "$K/kube-apiserver" "$K/kubeadm"
if [[ ! -f "$PKI/ca.crt" ]]; then
  log "[1/4] certificates (kubeadm init phase certs/kubeconfig, SANs localhost and 127.0.0.1)"
  # The API server advertises the node's address (pods reach it there through the `kubernetes`
  # Service); the processes on the node use 127.0.0.1, which the certificate also names, and
  # every kubeconfig is pointed at it below. (kubeadm cannot take a loopback advertiseAddress:
  # it reads it as "the global address on lo", cmd/kubeadm/app/util/config/
  # initconfiguration.go, SetAPIEndpointDynamicDefaults.)
  host_ip="$(node_ip)"
  cat > "$STATE/kubeadm.yaml" <<EOF
apiVersion: kubeadm.k8s.io/v1beta4
kind: InitConfiguration
localAPIEndpoint: {advertiseAddress: ${host_ip:?no global IPv4 address}, bindPort: 6443}
nodeRegistration: {name: localhost}
---
apiVersion: kubeadm.k8s.io/v1beta4
kind: ClusterConfiguration
kubernetesVersion: $K8S_VERSION
certificatesDir: $PKI
controlPlaneEndpoint: 127.0.0.1:6443
apiServer: {certSANs: [localhost, 127.0.0.1]}
networking: {serviceSubnet: 10.96.0.0/12, dnsDomain: cluster.local}
EOF
  "$K/kubeadm" init phase certs all --config "$STATE/kubeadm.yaml" > "$LOGS/kubeadm.log" 2>&1 \
    || { cat "$LOGS/kubeadm.log" >&2; exit 1; }
  # admin.conf (group kubeadm:cluster-admins, bound below), super-admin.conf (system:masters),
  # controller-manager.conf, scheduler.conf and kubelet.conf (system:node:localhost).
  "$K/kubeadm" init phase kubeconfig all --config "$STATE/kubeadm.yaml" --kubeconfig-dir "$PKI" \
    >> "$LOGS/kubeadm.log" 2>&1 || { cat "$LOGS/kubeadm.log" >&2; exit 1; }
  # controller-manager.conf and scheduler.conf name the advertise address (kubeadm's
  # phases/kubeconfig/kubeconfig.go uses LocalAPIEndpoint for them): point all at loopback.
  for f in "$PKI"/*.conf; do
    kubectl config set-cluster kubernetes --server=https://127.0.0.1:6443 --kubeconfig "$f" > /dev/null
  done
fi
log "[1/4] etcd $ETCD_VERSION on 127.0.0.1:2379"
start etcd "$ETCD_DIR/bin/etcd" --name=localhost --data-dir="$STATE/etcd" \
  --listen-client-urls=https://127.0.0.1:2379 --advertise-client-urls=https://127.0.0.1:2379 \
  --listen-peer-urls=https://127.0.0.1:2380 --initial-advertise-peer-urls=https://127.0.0.1:2380 \
  --initial-cluster=localhost=https://127.0.0.1:2380 --listen-metrics-urls=http://127.0.0.1:2381 \
  --client-cert-auth --trusted-ca-file="$PKI/etcd/ca.crt" \
  --cert-file="$PKI/etcd/server.crt" --key-file="$PKI/etcd/server.key" \
  --peer-client-cert-auth --peer-trusted-ca-file="$PKI/etcd/ca.crt" \
  --peer-cert-file="$PKI/etcd/peer.crt" --peer-key-file="$PKI/etcd/peer.key" \
  --snapshot-count=10000
wait_for "etcd /health" 60 curl -sf http://127.0.0.1:2381/health
(( last >= 2 )) || exit 0

# ---- 2. control plane ------------------------------------------------------------------------
log "[2/4] kube-apiserver $K8S_VERSION on :6443 (loopback and the pods' bridge only)"
# Flags as kubeadm writes them (cmd/kubeadm/app/phases/controlplane/manifests.go,
# getAPIServerCommand), plus --kubelet-preferred-address-types=Hostname so that logs/exec go to
# `localhost:10250`. It advertises the node's address, which the `kubernetes` Endpoints then
# hold (a loopback one is refused there: pkg/apis/core/validation, ValidateNonSpecialIP), and
# binds every interface; the rules keep it to loopback and the pods' bridge.
guard 6443 "$BRIDGE"
start kube-apiserver "$K/kube-apiserver" \
  --advertise-address="$(node_ip)" --secure-port=6443 --allow-privileged=true \
  --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
  --client-ca-file="$PKI/ca.crt" --tls-cert-file="$PKI/apiserver.crt" \
  --tls-private-key-file="$PKI/apiserver.key" \
  --etcd-servers=https://127.0.0.1:2379 --etcd-cafile="$PKI/etcd/ca.crt" \
  --etcd-certfile="$PKI/apiserver-etcd-client.crt" --etcd-keyfile="$PKI/apiserver-etcd-client.key" \
  --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" \
  --kubelet-client-key="$PKI/apiserver-kubelet-client.key" --kubelet-preferred-address-types=Hostname \
  --proxy-client-cert-file="$PKI/front-proxy-client.crt" --proxy-client-key-file="$PKI/front-proxy-client.key" \
  --requestheader-client-ca-file="$PKI/front-proxy-ca.crt" --requestheader-allowed-names=front-proxy-client \
  --requestheader-extra-headers-prefix=X-Remote-Extra- --requestheader-group-headers=X-Remote-Group \
  --requestheader-username-headers=X-Remote-User \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
  --service-cluster-ip-range="$SERVICE_CIDR"
wait_for "kube-apiserver /readyz" 120 kubectl --kubeconfig "$PKI/super-admin.conf" get --raw /readyz
# kubeadm init would create this binding; admin.conf's group has no rights without it.
kubectl --kubeconfig "$PKI/super-admin.conf" create clusterrolebinding kubeadm:cluster-admins \
  --clusterrole=cluster-admin --group=kubeadm:cluster-admins --dry-run=client -o yaml \
  | kubectl --kubeconfig "$PKI/super-admin.conf" apply -f - > /dev/null

log "[2/4] kube-controller-manager and kube-scheduler (127.0.0.1:10257, :10259)"
# Their serving certificates, from the cluster's CA (without them each makes a self-signed one
# at start, which only `curl -k` would take); 127.0.0.1 is where they listen.
for c in controller-manager scheduler; do
  [[ -f "$PKI/$c-serving.crt" ]] && continue
  openssl req -new -newkey rsa:2048 -nodes -subj "/CN=kube-$c" -keyout "$PKI/$c-serving.key" \
    -out "$PKI/$c-serving.csr" 2> /dev/null
  openssl x509 -req -in "$PKI/$c-serving.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" \
    -CAcreateserial -days 365 -out "$PKI/$c-serving.crt" 2> /dev/null \
    -extfile <(printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n')
  rm -f "$PKI/$c-serving.csr"
done
# kubeadm's getControllerManagerCommand; it is what creates each namespace's `default`
# ServiceAccount and the kube-root-ca.crt ConfigMap that projected tokens mount.
start kube-controller-manager "$K/kube-controller-manager" --bind-address=127.0.0.1 \
  --kubeconfig="$PKI/controller-manager.conf" --authentication-kubeconfig="$PKI/controller-manager.conf" \
  --authorization-kubeconfig="$PKI/controller-manager.conf" --client-ca-file="$PKI/ca.crt" \
  --requestheader-client-ca-file="$PKI/front-proxy-ca.crt" --root-ca-file="$PKI/ca.crt" \
  --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key" \
  --service-account-private-key-file="$PKI/sa.key" --use-service-account-credentials=true \
  --controllers='*' --leader-elect=false \
  --tls-cert-file="$PKI/controller-manager-serving.crt" --tls-private-key-file="$PKI/controller-manager-serving.key"
start kube-scheduler "$K/kube-scheduler" --bind-address=127.0.0.1 --leader-elect=false \
  --kubeconfig="$PKI/scheduler.conf" --authentication-kubeconfig="$PKI/scheduler.conf" \
  --authorization-kubeconfig="$PKI/scheduler.conf" \
  --tls-cert-file="$PKI/scheduler-serving.crt" --tls-private-key-file="$PKI/scheduler-serving.key"
wait_for "kube-controller-manager /healthz" 90 curl -sf --cacert "$PKI/ca.crt" https://127.0.0.1:10257/healthz
wait_for "kube-scheduler /healthz" 90 curl -sf --cacert "$PKI/ca.crt" https://127.0.0.1:10259/healthz
wait_for "default ServiceAccount" 60 kc -n default get serviceaccount default
(( last >= 3 )) || { log "control plane up in $(( $(date +%s) - t_start ))s; KUBECONFIG=$KUBECONFIG_ADMIN"; exit 0; }

# ---- 3. containerd, images, kubelet ------------------------------------------------------------
need_built "$K/kubelet" "$IMAGES_DIR/pause.tar" "$KUBE_PROXY_DIR/bin/kube-proxy" \
  "$CNI_DIR/bin/bridge" "$COREDNS_DIR/coredns.tar"
command -v containerd > /dev/null || apt-get install -y -q containerd runc > /dev/null
mkdir -p "$STATE/cni/net.d" "$STATE/containerd" "$RUN_DIR/containerd"
# The pod network, in its own CNI folder (not podman's /etc/cni/net.d), with the plugins built
# from containernetworking/plugins: each pod gets an address on the bridge, which is its
# default gateway to the node (and so to the Services that kube-proxy routes); hairpin lets a
# pod reach itself through its Service; portmap serves hostPort. No masquerade: no route out
# of the machine, and no rule of the bridge plugin's.
cat > "$STATE/cni/net.d/10-unet.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "unet-cluster", "plugins": [
  {"type": "bridge", "bridge": "$BRIDGE", "isDefaultGateway": true, "hairpinMode": true,
   "ipMasq": false, "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]],
   "dataDir": "$STATE/cni/ipam"}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
EOF
# containerd 1.6 CRI options (pkg/cri/config/config.go): restrict_oom_score_adj because root lacks
# CAP_SYS_RESOURCE here; the sandbox image is ours; streaming stays on loopback; pod network
# namespaces under our state folder rather than /run/netns; discard_unpacked_layers because
# load-image.sh deletes an image's layer blobs once unpacked (a containerd that checks for them
# before it reports an image present does so only without this option).
cat > "$STATE/containerd.toml" <<EOF
version = 2
root = "$STATE/containerd"
state = "$RUN_DIR/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "$CONTAINERD_SOCK"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/unet-cluster/pause:$PAUSE_TAG"
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    discard_unpacked_layers = true
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$RUN_DIR/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_DIR/bin"
    conf_dir = "$STATE/cni/net.d"
EOF
log "[3/4] containerd $(containerd --version | awk '{print $3}') (socket $CONTAINERD_SOCK)"
start containerd containerd --config "$STATE/containerd.toml"
ctr_() { ctr --address "$CONTAINERD_SOCK" -n k8s.io "$@"; }
wait_for "containerd" 60 ctr_ version
for tar in "$IMAGES_DIR/pause.tar" "$IMAGES_DIR/debian.tar" "$COREDNS_DIR/coredns.tar" \
  "$ARGO_IMAGES"/{argoexec,workflow-controller,argocli}.tar; do
  if [[ -f "$tar" ]]; then ctr_ images import "$tar" > /dev/null; fi
done
log "  images: $(ctr_ images ls -q | grep -c unet-cluster) loaded ($(ctr_ images ls -q | grep unet-cluster | tr '\n' ' '))"

log "[3/4] kubelet $K8S_VERSION (node localhost, 127.0.0.1:10250)"
mkdir -p "$STATE/kubelet" "$STATE/kubelet-plugins"
cat > "$STATE/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication: {anonymous: {enabled: false}, webhook: {enabled: true}, x509: {clientCAFile: $PKI/ca.crt}}
authorization: {mode: Webhook}
containerRuntimeEndpoint: unix://$CONTAINERD_SOCK
# cgroup v1 (hybrid, no systemd): the default failCgroupV1 became true in 1.35
# (pkg/kubelet/apis/config/v1beta1/defaults.go) and containerd 1.6 has no RuntimeConfig RPC,
# so the driver comes from here (cmd/kubelet/app/server.go, getCgroupDriverFromCRI).
failCgroupV1: false
cgroupDriver: cgroupfs
failSwapOn: false
clusterDNS: [$DNS_IP]
clusterDomain: cluster.local
volumePluginDir: $STATE/kubelet-plugins
# Its own cgroup root and pod log folder: down.sh stops and removes only what is under them.
cgroupRoot: /$CGROUP_ROOT
podLogsDir: $POD_LOGS
# Our images cannot be pulled again: image GC only on a full disk.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 200Mi, nodefs.available: 2%, imagefs.available: 2%}
serializeImagePulls: false
EOF
# The kubelet sets six host sysctls (pkg/kubelet/cm/container_manager_linux.go,
# setupKernelTunables: vm.overcommit_memory=1, kernel.panic_on_oops=1, ...), or refuses to start
# with protectKernelDefaults: keep the values it finds so that down.sh puts them back.
if [[ ! -f "$RUN_DIR/sysctl.saved" ]]; then
  for k in vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops \
    kernel/keys/root_maxkeys kernel/keys/root_maxbytes; do echo "$k $(cat "/proc/sys/$k")"; done \
    > "$RUN_DIR/sysctl.saved"
fi
# The kubelet checks that cgroupRoot exists in every hierarchy (pkg/kubelet/cm/
# container_manager_linux.go, cgroupManager.Validate); a new v1 cpuset needs its CPUs and
# memory nodes before a task can join it.
for h in $(cgroup_hierarchies); do
  mkdir -p "$h/$CGROUP_ROOT"
  if [[ -f "$h/cpuset.cpus" && -z "$(cat "$h/$CGROUP_ROOT/cpuset.cpus")" ]]; then
    cat "$h/cpuset.cpus" > "$h/$CGROUP_ROOT/cpuset.cpus"
    cat "$h/cpuset.mems" > "$h/$CGROUP_ROOT/cpuset.mems"
  fi
done
mkdir -p "$POD_LOGS"
# --hostname-override=localhost: the node is `localhost`; its InternalIP is found by the kubelet
# (pkg/kubelet/nodestatus/setters.go: loopback addresses are refused, so the default-route one).
start kubelet "$K/kubelet" --config="$STATE/kubelet.yaml" --kubeconfig="$PKI/kubelet.conf" \
  --root-dir="$STATE/kubelet" --hostname-override=localhost --v=1
wait_for "kubelet /healthz" 90 curl -sf http://127.0.0.1:10248/healthz
wait_for "node localhost Ready" 120 kc wait --for=condition=Ready node/localhost --timeout=5s

log "[3/4] kube-proxy $K8S_VERSION (iptables) for Services, CoreDNS $COREDNS_VERSION at $DNS_IP"
# As the ServiceAccount kube-system/kube-proxy with the API server's own system:node-proxier
# role (what kubeadm's kube-proxy addon binds). It leaves the host's sysctls alone: conntrack
# sizes and timeouts at 0 mean "do not set" (cmd/kube-proxy/app/server_linux.go,
# setupConntrack), and no NodePort on loopback means no route_localnet=1
# (pkg/proxy/iptables/proxier.go, NewProxier); NodePorts only on the pods' bridge. Health and
# metrics on loopback.
kc -n kube-system create serviceaccount kube-proxy --dry-run=client -o yaml | kc apply -f - > /dev/null
kc create clusterrolebinding unet-cluster:kube-proxy --clusterrole=system:node-proxier \
  --serviceaccount=kube-system:kube-proxy --dry-run=client -o yaml | kc apply -f - > /dev/null
sa_kubeconfig kube-system kube-proxy "$STATE/kube-proxy.conf"
# Written only when it changes: a running kube-proxy watches the file and exits on any write
# (cmd/kube-proxy/app/options.go: "content of the proxy server's configuration file was updated").
cat > "$STATE/kube-proxy.yaml.new" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $STATE/kube-proxy.conf}
hostnameOverride: localhost
mode: iptables
clusterCIDR: $POD_CIDR
bindAddress: 127.0.0.1
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
nodePortAddresses: [$POD_CIDR]
iptables: {localhostNodePorts: false}
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
oomScoreAdj: 0
EOF
cmp -s "$STATE/kube-proxy.yaml.new" "$STATE/kube-proxy.yaml" && rm "$STATE/kube-proxy.yaml.new" \
  || mv "$STATE/kube-proxy.yaml.new" "$STATE/kube-proxy.yaml"
start kube-proxy "$KUBE_PROXY_DIR/bin/kube-proxy" --config="$STATE/kube-proxy.yaml"
wait_for "kube-proxy /healthz" 60 curl -sf http://127.0.0.1:10256/healthz
sed -e "s|COREDNS_IMAGE|localhost/unet-cluster/coredns:$COREDNS_VERSION|" -e "s|DNS_IP|$DNS_IP|" \
  "$here/coredns.yaml" | kc apply -f - > /dev/null
wait_for "CoreDNS ready" 120 kc -n kube-system rollout status deployment/coredns --timeout=5s
# kube-proxy rejects a Service's cluster IP until it has written the Service's endpoints
# (pkg/proxy/iptables/proxier.go, syncProxyRules: a filter REJECT "has no endpoints" until the
# nat KUBE-SERVICES jump to its KUBE-SVC-* chain), a sync after CoreDNS became Ready: a pod
# that asks the DNS before it gets "Temporary failure in name resolution" (seen: the hello pod
# below failed so, and up.sh with it).
service_rules() {  # CLUSTER_IP PROTO PORT
  iptables -t nat -S KUBE-SERVICES | grep -qE -- "-d $1/32 -p $2 .*--dport $3 -j KUBE-SVC-"
}
wait_for "kube-proxy's rules for the cluster DNS and the API server's Service" 60 \
  eval 'service_rules "$DNS_IP" udp 53 && service_rules "$DNS_IP" tcp 53 &&
        service_rules "$(kc get service kubernetes -o jsonpath={.spec.clusterIP})" tcp 443'
# A pod on the pod network: its own address, cluster DNS (a Service's name through the search
# path) and a Service through kube-proxy (the API server's, from the pod's side).
kc apply -f - > /dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: hello, namespace: default}
spec:
  restartPolicy: Never
  containers:
  - name: hello
    image: "localhost/unet-cluster/debian:$DEBIAN_SUITE"
    imagePullPolicy: Never
    command: [bash, -c, 'getent hosts kubernetes.default | tr -s " " | tr "\n" " " &&
      exec 3<> /dev/tcp/kubernetes.default/443 && echo "reached from \$(hostname -i) as uid \$(id -u)"']
EOF
wait_for "hello pod Succeeded" 120 \
  kc wait --for=jsonpath='{.status.phase}'=Succeeded pod/hello --timeout=5s
log "  hello pod says: $(kc logs hello)"
kc delete pod hello --wait=false > /dev/null
(( last >= 4 )) || { log "node up in $(( $(date +%s) - t_start ))s; KUBECONFIG=$KUBECONFIG_ADMIN"; exit 0; }

# ---- 4. Argo Workflows -----------------------------------------------------------------------
need_built "$ARGO_DIR/bin/argo" "$ARGO_IMAGES/argocli.tar"
log "[4/4] Argo Workflows $ARGO_V: its cluster install, the server over TLS through a port-forward"
kc create namespace argo --dry-run=client -o yaml | kc apply -f - > /dev/null
# The controller's ConfigMap (config/config.go), before the install so that the controller
# starts with it (the install's own copy of it is empty and, applied server-side, leaves this
# data alone): our executor image (build.sh argo-images; the built-in default is quay.io's,
# workflow/controller/config.go executorImage), metrics on in plain http on :9090
# (util/telemetry/exporter_prometheus.go), which Prometheus, or a test on the node, scrapes at
# the controller pod's address. Applied server-side under a manager of its own: kubectl's
# server-side apply takes over what its client-side apply set (csaupgrade) and would drop it.
kc apply --server-side --field-manager=unet-cluster -f - > /dev/null <<EOF
apiVersion: v1
kind: ConfigMap
metadata: {name: workflow-controller-configmap, namespace: argo}
data:
  executor: |
    image: localhost/unet-cluster/argoexec:$ARGO_V
    imagePullPolicy: IfNotPresent
  metricsConfig: |
    enabled: true
    port: 9090
    secure: false
  telemetryConfig: |
    enabled: false
EOF
# TLS for argo server (--secure, its default): a CA and a server certificate for localhost and
# 127.0.0.1, where the port-forward below serves it, made at the first start (or when it
# expires within a day), in the Secret that the server reads (cmd/argo/commands/server.go
# --tls-certificate-secret-name, util/tls/tls.go GetServerTLSConfigFromSecret: tls.crt and
# tls.key in its own namespace). The CA's key is deleted once it has signed; clients get the CA
# certificate, $ARGO_PKI/ca.crt.
ARGO_PKI="$PKI/argo-server"
if ! openssl x509 -checkend 86400 -noout -in "$ARGO_PKI/tls.crt" > /dev/null 2>&1; then
  rm -rf "$ARGO_PKI"
  (umask 077 && mkdir -p "$ARGO_PKI" && cd "$ARGO_PKI" \
    && openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 \
      -keyout ca.key -out ca.crt -subj "/CN=unet-cluster argo-server CA" \
      -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign \
    && openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout tls.key \
      -out tls.csr -subj /CN=argo-server \
    && printf '%s\n' "subjectAltName=DNS:localhost,IP:127.0.0.1" extendedKeyUsage=serverAuth \
      basicConstraints=critical,CA:FALSE > tls.ext \
    && openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -set_serial "0x$(openssl rand -hex 16)" \
      -days 30 -extfile tls.ext -out tls.crt \
    && rm ca.key tls.csr tls.ext && chmod 644 ca.crt tls.crt && chmod 755 .) > "$LOGS/openssl.log" 2>&1 \
    || { cat "$LOGS/openssl.log" >&2; die "could not make argo server's certificate"; }
fi
kc -n argo create secret tls argo-server-tls --cert="$ARGO_PKI/tls.crt" --key="$ARGO_PKI/tls.key" \
  --dry-run=client -o yaml | kc apply -f - > /dev/null
# Argo's cluster install as its release builds install.yaml (Makefile: `kubectl kustomize
# manifests/cluster-install`, then dist/manifests/% turns `:latest` into the release's tag),
# from the module's own manifests:
# the full CRDs, the controller as argo/argo and `argo server` as argo/argo-server with their
# RBAC, the server's Service. What differs: the images are ours (build.sh argo-images), the
# server is given the certificate above, the one thing Argo's TLS docs have a user add, and the
# controller's DEFAULT_REQUEUE_TIME is 2s, as manifests/README.md tells users to set it: every
# pod event requeues a workflow through a rate limiter that waits that long (default 10s,
# workflow/controller/rate_limiters.go), and each step's end waited in it; measured A/B on this
# cluster, the tiny DAG's time between pods went 28 -> 13 s (tests/test_scale_cluster.py,
# benchmarks/README.md). The server runs with its defaults otherwise, --auth-mode=client among
# them: every call acts with the caller's own token (server/auth/gatekeeper.go); no token is a
# 401.
install="$STATE/argo-install"
module_manifests "github.com/argoproj/argo-workflows/v4@$ARGO_V" "$install"
cat > "$install/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [manifests/cluster-install]
images:
- {name: quay.io/argoproj/workflow-controller, newName: localhost/unet-cluster/workflow-controller, newTag: $ARGO_V}
- {name: quay.io/argoproj/argocli, newName: localhost/unet-cluster/argocli, newTag: $ARGO_V}
patches:
- target: {kind: Deployment, name: argo-server}
  patch: '[{"op": "add", "path": "/spec/template/spec/containers/0/args/-",
            "value": "--tls-certificate-secret-name=argo-server-tls"}]'
- target: {kind: Deployment, name: workflow-controller}
  patch: '[{"op": "add", "path": "/spec/template/spec/containers/0/env/-",
            "value": {"name": "DEFAULT_REQUEUE_TIME", "value": "2s"}}]'
EOF
kc apply --server-side -k "$install" > /dev/null
wait_for "Argo CRDs Established" 60 kc wait --for=condition=Established crd --all --timeout=5s
wait_for "workflow-controller and argo-server rolled out" 180 \
  kc -n argo rollout status deploy/workflow-controller deploy/argo-server --timeout=5s
# Clients reach the server as Argo's docs tell users to, through `kubectl port-forward
# svc/argo-server`, on loopback: behind cluster/forward.py, which keeps 127.0.0.1:2746 itself and
# starts kubectl again whenever it ends (on the first connection the server resets, or when its
# pod goes away), so that no call is refused in between.
start argo-port-forward python3 "$here/forward.py" 127.0.0.1:2746 2746 -- \
  --kubeconfig "$KUBECONFIG_ADMIN" -n argo svc/argo-server
ARGO_URL=https://127.0.0.1:2746
argo_curl() { curl -s --cacert "$ARGO_PKI/ca.crt" "$@"; }
refuses_anonymous() {   # 503 until it has started; then 401, or the server is open
  [[ "$(argo_curl -o /dev/null -w '%{http_code}' "$ARGO_URL/api/v1/workflows/argo")" == 401 ]]
}
wait_for "argo server over TLS, refusing a call without a token (401)" 90 refuses_anonymous
# The UI that argo server embeds is the one cluster/build.sh built from source (its webpack
# bundle), never a placeholder page.
argo_curl -f "$ARGO_URL/" | grep -Eq '<script[^>]* src="[^"]*main\.[0-9a-f]+\.js"' \
  || die "argo server serves no built UI at / (cluster/build.sh ui argo)"
# The executor needs to write WorkflowTaskResults (Argo's manifests/quick-start executor role).
kc apply -f - > /dev/null <<EOF
apiVersion: v1
kind: ServiceAccount
metadata: {name: hello-executor, namespace: argo}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: executor, namespace: argo}
rules:
- {apiGroups: [argoproj.io], resources: [workflowtaskresults], verbs: [create, patch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: hello-executor, namespace: argo}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: executor}
subjects: [{kind: ServiceAccount, name: hello-executor, namespace: argo}]
EOF
kc -n argo delete workflow hello --ignore-not-found > /dev/null
kc create -f - > /dev/null <<EOF
apiVersion: argoproj.io/v1alpha1
kind: Workflow
metadata: {name: hello, namespace: argo}
spec:
  entrypoint: main
  serviceAccountName: hello-executor
  templates:
  - name: main
    outputs: {parameters: [{name: msg, valueFrom: {path: /tmp/msg}}]}
    container: {image: "localhost/unet-cluster/debian:$DEBIAN_SUITE",
                command: [sh, -c, 'echo hello from argo | tee /tmp/msg']}
EOF
wait_for "hello Workflow Succeeded" 180 \
  kc -n argo wait --for=jsonpath='{.status.phase}'=Succeeded workflow/hello --timeout=5s
log "  hello Workflow output: $(kc -n argo get workflow hello -o jsonpath='{.status.nodes.hello.outputs.parameters[0].value}')"
# The same through `argo server`, as the argo CLI reaches it: over TLS with the CA (Go reads
# SSL_CERT_FILE) and a token, here the controller's account's (it may read workflows).
SSL_CERT_FILE="$ARGO_PKI/ca.crt" ARGO_SERVER=127.0.0.1:2746 ARGO_HTTP1=true \
  ARGO_TOKEN="Bearer $(kc -n argo create token argo --duration=10m)" \
  "$ARGO_DIR/bin/argo" -n argo get hello -o name > /dev/null || die "argo server does not list the hello Workflow"
# Every listener of ours is on loopback, or on a port that the rules above guard.
open="$(ss -Hltnp | grep -E '"(etcd|kube[a-z-]*|kubelet|containerd)"' \
  | awk '$4 !~ /^(127\.0\.0\.1|\[::1\]):/ && $4 !~ /:6443$/' || true)"
[[ -z "$open" ]] || die "listening beyond loopback: $open"
readable="$(find "$STATE/pki" -type f \( -name '*.key' -o -name '*.conf' \) -perm /o+r; \
  find "$STATE" -maxdepth 1 -type f -name '*.conf' -perm /o+r)"
[[ -z "$readable" ]] || die "keys or kubeconfigs readable by others: $readable"
log "up: etcd $ETCD_VERSION, Kubernetes $K8S_VERSION, containerd $(containerd --version | awk '{print $3}'), Argo $ARGO_V in $(( $(date +%s) - t_start ))s"
log "KUBECONFIG=$KUBECONFIG_ADMIN ARGO_SERVER=127.0.0.1:2746 ARGO_HTTP1=true"
log "argo server's CA (argo CLI: SSL_CERT_FILE, Python: REQUESTS_CA_BUNDLE): $ARGO_PKI/ca.crt"
log "a token (Bearer, as the argo CLI wants it): ARGO_TOKEN=\"Bearer \$(kubectl -n <namespace> create token <account>)\""
