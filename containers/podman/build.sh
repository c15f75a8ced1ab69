#!/usr/bin/env bash
# Build the CPU step image from containers/Dockerfile.cpu with podman, on a machine that
# reaches package registries but no container registry (CI, the development VMs):
#
#   containers/podman/build.sh            # -> images.cpu of config/pipeline.yaml
#
# - the base is made from Debian's packages (mmdebstrap -> podman import), plus a
#   python3/venv layer, and passed as BASE_IMAGE; nothing is pulled;
# - torch comes from a local wheel folder mounted into the build: TORCH_WHEELS if set, else
#   /opt/wheels when it holds a torch wheel (the CPU build, on some machines; PyPI serves its
#   dependencies), else torch and all its dependencies from PyPI, downloaded once into
#   ~/.cache/unet-wheels/torch-<version>-cp<python>/ and installed from there alone. PyPI's
#   torch is the CUDA build: `import torch` needs its nvidia-* libraries even on a CPU, so
#   the image carries them (6.1 GB, against 1.65 GB with the CPU build);
# - a TLS-intercepting proxy's CA bundle (PIP_CA, default the host's bundle) is a build
#   secret: pip trusts it during the build, and nothing of it is in the image.
# On a machine with Docker and a registry, use `make -C containers cpu` instead.
set -euo pipefail
cd "$(dirname "$0")/../.."

# The image's name and tag are the pipeline config's (images.cpu), where they are stated once.
image=${IMAGE:-$(python3 -c 'from workflows.config import load_config
cpu = load_config().images.cpu
print(f"{cpu.repository}:{cpu.tag}")')}
debian=localhost/unet-base/debian:bookworm
python=localhost/unet-base/python:3-bookworm
torch=${TORCH_VERSION:-$(sed -n 's/^ARG TORCH_VERSION=//p' containers/Dockerfile.cpu)}
pyver=3.11        # Debian bookworm's python3, the base made below
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
# BASE_ONLY=1: stop at the Debian python base (containers/podman/build-s3.sh builds on it).
[ -z "${BASE_ONLY:-}" ] || { echo "$python"; exit 0; }

# torch and every wheel it needs, for the base's Python (this machine's platform tags: a
# Debian 12 host, like the base), fetched once per version into $torch_cache. Filled in a
# temporary folder and renamed, so an interrupted download is never taken for a full one.
torch_cache=${XDG_CACHE_HOME:-$HOME/.cache}/unet-wheels/torch-$torch-cp${pyver/./}
fill_torch_cache() {
  [ -d "$torch_cache" ] && return
  mkdir -p "$(dirname "$torch_cache")"
  rm -rf "$torch_cache.part"
  echo "downloading torch==$torch and its dependencies into $torch_cache" >&2
  python3 -m pip download --quiet --dest "$torch_cache.part" --only-binary=:all: \
    --python-version "$pyver" "torch==$torch"
  mv "$torch_cache.part" "$torch_cache"
}

args=(--build-arg "BASE_IMAGE=$python" --build-arg "TORCH_VERSION=$torch"
      --build-arg "TORCH_INDEX_URL=https://pypi.org/simple")
if [ -n "${TORCH_WHEELS:-}" ] || ls /opt/wheels/torch-"$torch"[-+]*.whl >/dev/null 2>&1; then
  args+=(--volume "${TORCH_WHEELS:-/opt/wheels}:/wheels:ro" --build-arg TORCH_FIND_LINKS=/wheels)
else
  fill_torch_cache
  args+=(--volume "$torch_cache:/wheels:ro" --build-arg TORCH_FIND_LINKS=/wheels
         --build-arg TORCH_WHEELS_ONLY=1)
fi
[ -f "$ca" ] && args+=(--secret "id=pip-ca,src=$ca")
# The runner compares this label with the checkout it runs (emulator/pods.py).
if sources=$(python3 -c 'from emulator.pods import source_digest; print(source_digest())' 2>/dev/null); then
  args+=(--label "unet-argo.sources=$sources")
fi

# A rebuild leaves the image it replaces untagged, with its own 5.4 GB copy of the venv, and
# the build stages of older sources: remove those (only images this script labelled; one still
# used by a container stays). Build stages of the current sources stay, as the layer cache.
prune_superseded() {
  local id
  if [ -n "$replaced" ] && [ "$replaced" != "$(image_id)" ]; then
    podman rmi "$replaced" >/dev/null 2>&1 || true
  fi
  for id in $(podman images --quiet --filter dangling=true --filter label=unet-argo.sources); do
    [ "$(podman image inspect --format '{{index .Labels "unet-argo.sources"}}' "$id")" = "${sources:-}" ] \
      || podman rmi "$id" >/dev/null 2>&1 || true
  done
}
image_id() { podman image inspect --format '{{.Id}}' "$image" 2>/dev/null || true; }

replaced=$(image_id)
podman build --layers -f containers/Dockerfile.cpu -t "$image" "${args[@]}" .
prune_superseded
echo "$image"
