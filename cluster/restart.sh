#!/usr/bin/env bash
# Stop one of the cluster's host processes, keep it down for SECONDS, then start it again with
# the command line it had: an engine fault as a node has one (an API server restarted for an
# upgrade, a kubelet restarted, etcd restarted). tests/test_chaos.py injects faults with it.
#   bash cluster/restart.sh NAME [SECONDS]     NAME: a process of cluster/up.sh (kubelet, ...)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/lib.sh"

name="${1:?usage: restart.sh NAME [SECONDS]}" down="${2:-0}"
pid="$(pid_of "$name")"
alive "$pid" || die "$name is not running (no live pid in $RUN_DIR/$name.pid)"
mapfile -d '' argv < "/proc/$pid/cmdline"
stop "$name"
log "$name down for ${down}s"
sleep "$down"
start "$name" "${argv[@]}"
log "$name started again (pid $(pid_of "$name"))"
