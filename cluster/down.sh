#!/usr/bin/env bash
# Stop the single-node cluster that cluster/up.sh started and leave no process, mount, network
# namespace, link, cgroup or iptables/ip6tables rule of it behind, touching only what it made:
# the cgroups under its own root, the rules that were not there before up.sh (a snapshot), the
# log links into its state folder. Removes
# $STATE and $RUN_DIR (certificates, etcd data, containerd's images) unless KEEP_STATE=1 (a host
# sysctl that could not be put back keeps its record there, and down.sh fails); the build cache
# stays. KEEP_LOGS=DIR first copies the cluster's logs and its pods' into DIR, a new folder
# (lib.sh keep_logs), before the pods are deleted and the kubelet removes theirs.
#   bash cluster/down.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/lib.sh"

ctr_() { ctr --address "$CONTAINERD_SOCK" -n k8s.io "$@"; }

if [[ -n "${KEEP_LOGS:-}" ]]; then
  keep_logs "$KEEP_LOGS" && log "the cluster's logs and its pods' kept in $KEEP_LOGS"
fi
stop argo-port-forward 3
# No controller may replace the pods deleted below (the Deployments of CoreDNS, Argo and the
# training operator would).
stop kube-controller-manager
stop kube-scheduler
# Let the kubelet tear its pods down itself (containers, sandboxes, CNI DEL), then stop it.
if alive "$(pid_of kubelet)" && [[ -f "$KUBECONFIG_ADMIN" ]]; then
  log "deleting all pods so that the kubelet removes their containers"
  kubectl --kubeconfig "$KUBECONFIG_ADMIN" delete pods --all -A --grace-period=0 --force \
    --wait=false > /dev/null 2>&1 || true
  for _ in $(seq 60); do
    [[ -z "$(ctr_ tasks ls -q 2> /dev/null)" ]] && break; sleep 1
  done
fi
stop kubelet
stop kube-proxy   # its KUBE-* rules go with the others below
# Whatever is left: kill and delete each task through containerd (this unmounts its rootfs).
if alive "$(pid_of containerd)"; then
  for id in $(ctr_ tasks ls -q 2> /dev/null); do
    ctr_ tasks kill -s SIGKILL "$id" > /dev/null 2>&1 || true
  done
  sleep 1
  for id in $(ctr_ tasks ls -q 2> /dev/null); do ctr_ tasks delete -f "$id" > /dev/null 2>&1 || true; done
fi
stop containerd
# Shims that outlived it: containerd 1.6 records each one's pid in its task folder.
for f in "$RUN_DIR"/containerd/io.containerd.runtime.v2.task/*/*/shim.pid; do
  [[ -f "$f" ]] && kill -9 "$(cat "$f")" 2> /dev/null || true
done
stop kube-apiserver
stop etcd

# Any container process still alive sits under the kubelet's cgroupRoot: kill it by pid.
for h in $(cgroup_hierarchies); do
  for f in $(find "$h/$CGROUP_ROOT" -name cgroup.procs 2> /dev/null); do
    while read -r p; do kill -9 "$p" 2> /dev/null || true; done < "$f"
  done
done
# Mounts under our folders, deepest first: rootfs overlays, shm, the kubelet's tmpfs volumes and
# its root folder, and the pods' network namespaces (up.sh keeps them under containerd's state).
mounts() { awk '{print $5}' /proc/self/mountinfo | grep -E "^($STATE|$RUN_DIR)(/|$)" | sort -r || true; }
for m in $(mounts); do umount "$m" 2> /dev/null || umount -l "$m" 2> /dev/null || true; done
if ip link show unetcni0 > /dev/null 2>&1; then ip link delete unetcni0; fi
# The kubelet's cgroups (cgroupfs driver: $CGROUP_ROOT/kubepods/... in each hierarchy), deepest first.
for h in $(cgroup_hierarchies); do
  find "$h/$CGROUP_ROOT" -depth -type d -exec rmdir {} \; 2> /dev/null || true
done
# new_rules IPT TABLE: the KUBE-* and unet-cluster rules that were not there before up.sh
# (another node's, and anything else's, stay).
new_rules() {
  our_rules "$1" "$2" | grep -vxF -f <(sed -n "s/^$1 $2 //p" "$RUN_DIR/before.rules" 2> /dev/null) || true
}
for ipt in iptables ip6tables; do
  for t in $IPT_TABLES; do
    made="$(new_rules "$ipt" "$t")"
    { grep '^-A' <<< "$made" || true; } | sed 's/^-A/-D/' \
      | while read -r rule; do eval "$ipt -t $t $rule" || true; done
    for c in $(awk '/^-N /{print $2}' <<< "$made"); do
      "$ipt" -t "$t" -F "$c"; "$ipt" -t "$t" -X "$c" 2> /dev/null || true
    done
  done
done
# The kubelet's links to its pod logs (/var/log/containers is fixed: kuberuntime/legacy.go).
for l in /var/log/containers/*; do
  [[ -L "$l" && "$(readlink "$l")" == "$STATE/"* ]] && rm -f "$l"
done
if [[ -f "$RUN_DIR/made-var-log-containers" ]]; then rmdir /var/log/containers 2> /dev/null || true; fi
# The host sysctls that the kubelet changed, back to what up.sh found; one that does not take
# its value is left behind (below), and its record kept for the next down.sh.
sysctls=""
if [[ -f "$RUN_DIR/sysctl.saved" ]]; then
  sysctls="$(restore_sysctls "$RUN_DIR/sysctl.saved")" && rm -f "$RUN_DIR/sysctl.saved"
fi
# containerd 1.6 puts shim sockets in /run/containerd/s whatever its state folder: drop the
# folders if they are empty (another containerd may use them).
rmdir /run/containerd/s /run/containerd/runc/k8s.io /run/containerd/runc /run/containerd 2> /dev/null || true
# Verify: nothing of ours runs, is mounted, filtered, linked or left in a cgroup.
rules="$(for ipt in iptables ip6tables; do for t in $IPT_TABLES; do new_rules "$ipt" "$t"; done; done)"
cg="$(for h in $(cgroup_hierarchies); do [[ ! -d "$h/$CGROUP_ROOT" ]] || echo "$h/$CGROUP_ROOT"; done)"
links="$(find /var/log/containers -maxdepth 1 -type l -lname "$STATE/*" 2> /dev/null || true)"
if [[ "${KEEP_STATE:-0}" != 1 ]]; then
  rm -rf "$STATE"
  if [[ -z "$sysctls" ]]; then rm -rf "$RUN_DIR"
  else find "$RUN_DIR" -mindepth 1 ! -name sysctl.saved -delete 2> /dev/null || true; fi
fi
left="$(mounts)"
procs="$(for e in /proc/[0-9]*/exe; do readlink "$e" 2> /dev/null | grep -qE "^($CACHE|$STATE|$RUN_DIR)/" && echo "${e%/exe}"; done || true)"
procs+="$(pgrep -af -- "containerd --config $STATE|-address $CONTAINERD_SOCK" || true)"
if [[ -n "$left$procs$rules$cg$links$sysctls" ]]; then
  log "left behind:"
  printf '%s\n' "$left" "$procs" "$rules" "$cg" "$links" "$sysctls" | grep -v '^$' >&2
  exit 1
fi
log "down: no process, mount, cgroup, iptables/ip6tables rule, log link or changed host sysctl of the cluster is left"
