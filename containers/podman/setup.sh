#!/usr/bin/env bash
# Make rootful podman run OCI images on a Debian 12 machine without Docker (CI, the
# development VMs): install it, and set the two engine settings these machines need
# (../../../shared/CONTAINERS.md): runc instead of crun (hybrid cgroups), and rlimits no
# higher than the current hard limits (root lacks CAP_SYS_RESOURCE). Idempotent.
set -euo pipefail

if ! command -v podman >/dev/null || ! command -v mmdebstrap >/dev/null \
    || ! command -v runc >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq podman buildah runc mmdebstrap uidmap >/dev/null \
    || { apt-get update -qq && apt-get install -y -qq podman buildah runc mmdebstrap uidmap >/dev/null; }
fi

conf=/etc/containers/containers.conf
nofile=$(ulimit -Hn)
nproc=$(( $(ulimit -Hu) < 32768 ? $(ulimit -Hu) : 32768 ))
if ! grep -q '^# unet-argo' "$conf" 2>/dev/null; then
  mkdir -p /etc/containers
  cat >> "$conf" <<CONF
# unet-argo: containers/podman/setup.sh
[containers]
default_ulimits = ["nofile=${nofile}:${nofile}", "nproc=${nproc}:${nproc}"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
CONF
fi
podman info --format '{{.Host.OCIRuntime.Name}} {{.Store.GraphDriverName}}'
