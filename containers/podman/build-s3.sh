#!/usr/bin/env bash
# Build the SeaweedFS image of docker-compose.yml's `seaweedfs` profile with podman, where no
# registry can be reached: the base is the Debian python image containers/podman/build.sh
# makes from Debian's packages, and pip trusts a proxy's CA bundle given as a build secret.
#   containers/podman/build-s3.sh        # -> localhost/unet-argo/seaweedfs:<version>
set -euo pipefail
cd "$(dirname "$0")/../.."
version=$(sed -n 's/^ARG SEAWEEDFS_VERSION=//p' containers/seaweedfs/Containerfile)
image=${IMAGE:-localhost/unet-argo/seaweedfs:${version}}
base=localhost/unet-base/python:3-bookworm
ca=${PIP_CA:-/etc/ssl/certs/ca-certificates.crt}
podman image exists "$base" || BASE_ONLY=1 bash containers/podman/build.sh >/dev/null
args=(--build-arg "BASE_IMAGE=$base")
[ -f "$ca" ] && args+=(--secret "id=pip-ca,src=$ca")
podman build --layers -f containers/seaweedfs/Containerfile -t "$image" "${args[@]}" \
  containers/seaweedfs
echo "$image"
