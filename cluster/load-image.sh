#!/usr/bin/env bash
# Load images from podman's storage into the running cluster's containerd (namespace k8s.io),
# where the kubelet finds them by name: no registry is reachable here, so the pods' pull
# policy must be IfNotPresent or Never (config/pipeline.yaml: images.pull_policy).
#   bash cluster/load-image.sh IMAGE...      e.g. ghcr.io/unet-argo/unet-cpu:0.1.0
# `podman save` is streamed into `ctr images import` (no tar on disk: the CPU image is ~6 GB).
# An image whose config digest in containerd is podman's image ID (the same image) is skipped.
# Once unpacked, an image's layer blobs are deleted from containerd's content store (see
# discard_layers): the node keeps one copy of each image, its snapshots, not two.
# Run after cluster/up.sh (down.sh removes containerd's images).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/lib.sh"
(( $# )) || die "usage: bash cluster/load-image.sh IMAGE..."
ctr_() { ctr --address "$CONTAINERD_SOCK" -n k8s.io "$@"; }
# The manifest digest of the image NAME in containerd (empty when it is not there).
manifest_of() { ctr_ images ls "name==$1" | awk 'NR == 2 {print $3}'; }
# The config digest of the image NAME in containerd (empty when it is not there): the
# manifest's config.digest, which is what podman reports as the image ID.
loaded_id() {
  local manifest
  manifest="$(manifest_of "$1")"
  [[ -n "$manifest" ]] || return 0
  ctr_ content get "$manifest" | python3 -c 'import json, sys; print(json.load(sys.stdin)["config"]["digest"])'
}
# The chain ID of IMAGE's top layer (the snapshot a container of it starts from: containerd's
# WithNewSnapshot prepares on identity.ChainID(config.rootfs.diff_ids)).
chain_id() {
  ctr_ content get "$(loaded_id "$1")" | python3 -c '
import hashlib, json, sys
chain = None
for diff in json.load(sys.stdin)["rootfs"]["diff_ids"]:
    chain = diff if chain is None else "sha256:" + hashlib.sha256(f"{chain} {diff}".encode()).hexdigest()
print(chain)'
}
# Delete IMAGE's layer blobs once its snapshots hold them unpacked: they are a second full copy
# of the image on the node's disk (6 GB for the CPU image), needed only to unpack again into
# another snapshotter or to push. This is what the CRI's own pull does with
# discard_unpacked_layers (up.sh sets it; pkg/cri/server/image_pull.go: the layers lose their
# GC labels), which `ctr images import` (1.6) cannot ask for. The manifest and config blobs
# stay: they name the image and its snapshots, and loaded_id reads them.
discard_layers() {
  local chain digests
  chain="$(chain_id "$1")"
  ctr_ snapshots --snapshotter overlayfs info "$chain" > /dev/null 2>&1 \
    || die "$1: its top snapshot $chain is not there after the import; layers kept"
  digests="$(ctr_ content get "$(manifest_of "$1")" \
    | python3 -c 'import json, sys; print(*(l["digest"] for l in json.load(sys.stdin)["layers"]))')"
  # shellcheck disable=SC2086  # one argument per digest
  ctr_ content rm $digests > /dev/null
}
ctr_ version > /dev/null 2>&1 || die "containerd is not running ($CONTAINERD_SOCK): bash cluster/up.sh first"

for image in "$@"; do
  id="$(podman image inspect --format '{{.Id}}' "$image" 2> /dev/null)" \
    || die "$image is not in podman's storage (containers/podman/build.sh builds the CPU image)"
  # containerd stores a name without a registry under docker.io/ (reference.ParseNormalizedNamed);
  # ours all name one (ghcr.io/..., localhost/...).
  if [[ "$(loaded_id "$image")" == "sha256:$id" ]]; then
    log "$image: loaded already (podman image ${id:0:12})"; continue
  fi
  t0=$SECONDS
  log "$image: podman save | ctr images import ($(podman image inspect --format '{{.Size}}' "$image" | numfmt --to=iec))"
  podman save --format docker-archive "$image" | ctr_ images import - > /dev/null
  [[ "$(loaded_id "$image")" == "sha256:$id" ]] || die "$image: containerd holds another image after the import"
  discard_layers "$image"
  log "$image: loaded in $(( SECONDS - t0 ))s"
done
