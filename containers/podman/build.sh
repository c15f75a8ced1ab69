#!/usr/bin/env bash
# Build the CPU step image from containers/Dockerfile.cpu with podman, on a machine that
# reaches package registries but no container registry (CI, the development VMs):
#
#   containers/podman/build.sh            # -> ghcr.io/unet-argo/unet-cpu:<version>
#
# - the base is made from Debian's packages (mmdebstrap -> podman import), plus a
#   python3/venv layer, and passed as BASE_IMAGE; nothing is pulled;
# - torch comes from a local wheel folder (TORCH_WHEELS, default /opt/wheels) mounted into
#   the build, with PyPI as the index for everything else;
# - a TLS-intercepting proxy's CA bundle (PIP_CA, default the host's bundle) is a build
#   secret: pip trusts it during the build, and nothing of it is in the image.
# On a machine with Docker and a registry, use `make -C containers cpu` instead.
set -euo pipefail
cd "$(dirname "$0")/../.."

version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
image=${IMAGE:-ghcr.io/unet-argo/unet-cpu:${version}}
debian=localhost/unet-base/debian:bookworm
python=localhost/unet-base/python:3-bookworm
wheels=${TORCH_WHEELS:-/opt/wheels}
ca=${PIP_CA:-/etc/ssl/certs/ca-certificates.crt}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if ! podman image exists "$debian"; then
  mmdebstrap --quiet --variant=minbase bookworm "$work/rootfs.tar"
  podman import --quiet "$work/rootfs.tar" "$debian" >/dev/null
fi
if ! podman image exists "$python"; then
  printf '%s\n' "FROM $debian" \
    'RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python-is-python3 ca-certificates && rm -rf /var/lib/apt/lists/*' \
    > "$work/Containerfile"
  podman build --quiet -t "$python" -f "$work/Containerfile" "$work" >/dev/null
fi

args=(--build-arg "BASE_IMAGE=$python" --build-arg "TORCH_INDEX_URL=https://pypi.org/simple")
if ls "$wheels"/torch-*.whl >/dev/null 2>&1; then
  args+=(--volume "$wheels:/wheels:ro" --build-arg TORCH_FIND_LINKS=/wheels)
fi
[ -f "$ca" ] && args+=(--secret "id=pip-ca,src=$ca")
# The runner compares this label with the checkout it runs (workflows/local/pods.py).
if sources=$(python3 -c 'from workflows.local.pods import source_digest; print(source_digest())' 2>/dev/null); then
  args+=(--label "unet-argo.sources=$sources")
fi
podman build --layers -f containers/Dockerfile.cpu -t "$image" "${args[@]}" .
echo "$image"
