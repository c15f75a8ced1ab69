#!/usr/bin/env bash
# Build the single-node cluster's binaries and images from the Go module proxy and Debian's
# packages into a version-keyed cache: ~/.cache/unet-cluster/<component>-<version>/.
# Nothing is built inside this repository. A stage whose folder has .done is skipped.
#   bash cluster/build.sh [etcd|kubernetes|kube-proxy|cni-plugins|coredns|images|ui|argo|argo-images|training-operator|training-operator-image ...]
#   (default: all but training-operator, in order; the operator is only for the multi-node tests)
# Heavy work runs under `nice -n 19`; each stage's wall time and size go to $CACHE/build-times.tsv.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/lib.sh"
NICE=(nice -n 19)
mkdir -p "$CACHE"

# run_stage NAME DIR FUNC: skip when DIR/.done exists, else time FUNC and record it.
run_stage() {
  local name="$1" dir="$2" fn="$3" t0
  if [[ -f "$dir/.done" ]]; then log "$name: cached in $dir"; return; fi
  log "$name: building into $dir"
  rm -rf "$dir"; mkdir -p "$dir/bin"
  t0=$(date +%s)
  (cd "$dir" && "$fn" "$dir")   # a subshell: a stage's cd or removed folder cannot leak into the next
  touch "$dir/.done"
  local secs=$(( $(date +%s) - t0 ))
  printf '%s\t%s\t%ss\t%s\t%s\n' "$(date -u +%FT%TZ)" "$name" "$secs" "$(du -sh "$dir" | cut -f1)" \
    "$(lscpu | sed -n 's/^Model name: *//p')" >> "$CACHE/build-times.tsv"
  log "$name: done in ${secs}s"
}

# A throwaway main module (outside the repository) that requires the upstream module.
new_module() {  # DIR MODULE@VERSION
  mkdir -p "$1/mod"; cd "$1/mod"
  [[ -f go.mod ]] || go mod init "unet-cluster/${2%%@*}" > /dev/null 2>&1
  "${NICE[@]}" go get "$2"
}

build_etcd() {
  # server/v3 is etcd's main package (server/main.go). Its go.mod replaces api, client and pkg
  # with ../ folders; replaces in a dependency are ignored, the published v3.6.x are used.
  new_module "$1" "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
  "${NICE[@]}" go build -trimpath -ldflags "-s -w" -o "$1/bin/etcd" go.etcd.io/etcd/server/v3
}

# k8s.io/kubernetes as a requirement of a throwaway module in DIR. It requires its staging
# modules at v0.0.0 with `=> ./staging/...` replaces (its go.mod), which do not apply here:
# each is pointed at the published v0.35.x instead.
k8s_module() {  # DIR
  local up
  new_module "$1" "k8s.io/kubernetes@$K8S_VERSION"
  up="$(go list -m -f '{{.Dir}}' "k8s.io/kubernetes")"
  sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p' "$up/go.mod" | while read -r m; do
    go mod edit -replace "$m=$m@$K8S_STAGING"
  done
}

# k8s_build DIR CMD...: Kubernetes commands with the tags and ldflags of a release build
# (hack/lib/golang.sh: selinux,notest,grpcnotrace; -s -w; -trimpath; hack/lib/version.sh sets
# both version packages).
k8s_build() {
  local d="$1" v="$K8S_VERSION" minor ldflags="-s -w" p; shift
  minor="${v#v1.}"; minor="${minor%%.*}"
  for p in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    ldflags+=" -X $p.gitVersion=$v -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
    ldflags+=" -X $p.buildDate=$(date -u +%FT%TZ)"
  done
  "${NICE[@]}" go build -trimpath -tags selinux,notest,grpcnotrace -ldflags "$ldflags" \
    -o "$d/bin/" "${@/#/k8s.io/kubernetes/cmd/}"
}

build_kubernetes() {
  local d="$1" up
  k8s_module "$d"
  k8s_build "$d" kube-apiserver kube-controller-manager kube-scheduler kubelet kubeadm
  # The pause binary for the sandbox image, from the module's build/pause/linux/pause.c.
  up="$(go list -m -f '{{.Dir}}' "k8s.io/kubernetes")"
  "${NICE[@]}" gcc -Os -Wall -Werror -static -DVERSION="v$PAUSE_TAG-unet" \
    -o "$d/bin/pause" "$up/build/pause/linux/pause.c"
}

build_kube_proxy() {  # the Service proxy (iptables mode), from the same module and version
  k8s_module "$1"
  k8s_build "$1" kube-proxy
}

build_cni_plugins() {
  # The CNI plugins the node's network uses (cluster/up.sh): bridge, host-local, loopback and
  # portmap, each its own main package in the module (plugins/main, plugins/ipam, plugins/meta).
  local p="github.com/containernetworking/plugins/plugins"
  new_module "$1" "github.com/containernetworking/plugins@$CNI_PLUGINS_VERSION"
  "${NICE[@]}" go build -trimpath -ldflags "-s -w -X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion=$CNI_PLUGINS_VERSION" \
    -o "$1/bin/" "$p/main/bridge" "$p/ipam/host-local" "$p/main/loopback" "$p/meta/portmap"
}

build_coredns() {
  # CoreDNS's own coremain (what its main package runs) with the plugins of the Corefile that
  # cluster/up.sh gives it, listed in a main package of this build (a custom build as
  # plugin.cfg's comments describe, without the cloud providers' SDKs); the order in which
  # plugins run is coredns's core/dnsserver/zdirectives.go either way. Then its image: the static
  # binary FROM scratch as CoreDNS's Dockerfile ships it, as a user that is not root.
  local d="$1" m="github.com/coredns/coredns" p
  new_module "$d" "$m@$COREDNS_VERSION"
  {
    printf 'package main\n\nimport (\n\t"%s/coremain"\n' "$m"
    for p in errors health ready kubernetes metrics forward cache loop reload loadbalance; do
      printf '\t_ "%s/plugin/%s"\n' "$m" "$p"
    done
    printf ')\n\nfunc main() { coremain.Run() }\n'
  } > main.go
  "${NICE[@]}" go mod tidy > /dev/null 2>&1 || "${NICE[@]}" go mod tidy
  "${NICE[@]}" go build -trimpath -ldflags "-s -w -X $m/coremain.GitCommit=$COREDNS_VERSION" \
    -o "$d/bin/coredns" .
  ensure_podman; mkdir -p "$d/ctx"
  cp "$d/bin/coredns" "$d/ctx/coredns"
  printf 'FROM scratch\nCOPY coredns /coredns\nUSER 65532:65532\nENTRYPOINT ["/coredns"]\n' > "$d/ctx/Containerfile"
  podman build -q -t "localhost/unet-cluster/coredns:$COREDNS_VERSION" "$d/ctx" > /dev/null
  podman save -q -o "$d/coredns.tar" "localhost/unet-cluster/coredns:$COREDNS_VERSION"
  rm -rf "$d/ctx"
}

argo_module() {  # the Argo module's folder in the module cache (downloaded if needed)
  module_dir "github.com/argoproj/argo-workflows/v4@$(argo_version)"
}

# The lockfile's git dependency is argo-ui; where GitHub cannot be reached it is pointed at the
# vendored copy of the same commit (checked by sha256): package.json's pin becomes a file:
# dependency and the lockfile's entry is renamed to match, its dependencies untouched.
vendor_argo_ui() {  # UI_FOLDER
  local ui="$1" tgz="$VENDOR/argo-ui-${ARGO_UI_COMMIT:0:12}.tar.gz" git pin others
  git="git+https://github.com/argoproj/argo-ui.git"
  pin="$(sed -n "s|.*\"argo-ui\": \"$git#\([0-9a-f]*\)\".*|\1|p" "$ui/package.json")"
  [[ "$pin" == "$ARGO_UI_COMMIT" ]] \
    || die "ui: ui/package.json pins argo-ui at '${pin:-no git commit}', the vendored copy is $ARGO_UI_COMMIT"
  others="$(grep -o 'resolved "git+[^"#]*' "$ui/yarn.lock" | grep -v "$git" || true)"
  [[ -z "$others" ]] || die "ui: yarn.lock has git dependencies no registry serves: ${others//$'\n'/ }"
  [[ -f "$tgz" ]] || die "ui: GitHub is unreachable and $tgz is absent (UNET_VENDOR)"
  echo "$ARGO_UI_SHA256  $tgz" | sha256sum -c --quiet - > /dev/null 2>&1 \
    || die "ui: $tgz does not match its sha256 $ARGO_UI_SHA256"
  tar -xzf "$tgz" -C "$(dirname "$ui")"
  sed -i "s|\"argo-ui\": \"$git#$pin\"|\"argo-ui\": \"file:../argo-ui\"|" "$ui/package.json"
  sed -i -e "s|^\"argo-ui@$git#$pin\":|\"argo-ui@file:../argo-ui\":|" \
    -e "\|^  resolved \"$git#$pin\"|d" "$ui/yarn.lock"
  log "ui: argo-ui from $tgz (GitHub unreachable)"
}

build_ui() {
  # Argo's UI as its Makefile builds it (`yarn --cwd ui build`, NODE_ENV=production), from the
  # running version's own ui/ source and frozen yarn.lock; webpack also copies ../api's schema.
  # Only dist/app is kept (~33 MB); yarn's cache and node_modules (~1.4 GB) are dropped, and with
  # them the temporary directory that npm, yarn and node's packages write into (yarn--*,
  # core-js-banners, v8-compile-cache-*: left in /tmp otherwise).
  local d="$1" v mod work yarn
  v="$(argo_version)"; mod="$(argo_module)"; work="$d/work"
  mkdir -p "$work/tmp"; cp -r "$mod/ui" "$mod/api" "$work/"; chmod -R u+w "$work"
  export TMPDIR="$work/tmp"
  "${NICE[@]}" npm install --silent --no-audit --no-fund --prefix "$work/yarn" "yarn@$YARN_VERSION"
  yarn="$work/yarn/node_modules/.bin/yarn"
  if timeout 20 git ls-remote https://github.com/argoproj/argo-ui.git HEAD > /dev/null 2>&1; then
    log "ui: argo-ui from GitHub, the upstream yarn.lock as it is"
  else
    vendor_argo_ui "$work/ui"
  fi
  cd "$work/ui"
  YARN_CACHE_FOLDER="$work/yarn-cache" "${NICE[@]}" "$yarn" install --frozen-lockfile \
    --non-interactive --ignore-optional --network-timeout 600000 --silent
  NODE_OPTIONS=--max-old-space-size=2048 VERSION="$v" YARN_CACHE_FOLDER="$work/yarn-cache" \
    "${NICE[@]}" "$yarn" build > "$d/webpack.log" 2>&1 || { tail -n 30 "$d/webpack.log" >&2; die "ui: yarn build failed"; }
  compgen -G "dist/app/main.*.js" > /dev/null || die "ui: yarn build made no dist/app/main.*.js"
  mv dist/app "$d/app"; cd "$d"; rm -rf "$work"
}

build_argo() {
  local d="$1" v src ui
  v="$(argo_version)"; ui="$(ui_dir)"; cd "$d"
  # ui/embed.go embeds dist/app with go:embed and argo server has no flag for another folder:
  # the UI built by the ui stage goes into a writable copy of the module before `go build`.
  [[ -f "$ui/.done" ]] || die "argo: build the UI first (cluster/build.sh ui)"
  src="$d/src"
  cp -r "$(argo_module)" "$src"
  chmod -R u+w "$src"; rm -rf "$src/ui/dist"; mkdir -p "$src/ui/dist"
  cp -r "$ui/app" "$src/ui/dist/app"
  # In git, workflow/executor/osspecific/signal_linux.go is a symlink to signal_darwin.go;
  # module zips drop symlinks, so the module as served lacks it and argoexec does not compile
  # ("undefined: Setpgid"). Put the link back in the copy.
  local sig="$src/workflow/executor/osspecific/signal_linux.go"
  [[ -e "$sig" ]] || ln -s signal_darwin.go "$sig"
  local tags=""
  # v4.1 needs this tag (its Makefile); v4.0.x does not know it.
  grep -q kubernetes_protomessage_one_more_release "$src/Makefile" && tags="kubernetes_protomessage_one_more_release"
  local ldflags="-s -w -X github.com/argoproj/argo-workflows/v4.version=$v -X github.com/argoproj/argo-workflows/v4.gitTag=$v"
  ldflags+=" -X github.com/argoproj/argo-workflows/v4.gitTreeState=clean -X github.com/argoproj/argo-workflows/v4.buildDate=$(date -u +%FT%TZ)"
  cd "$src"
  "${NICE[@]}" go build -trimpath -tags "$tags" -ldflags "$ldflags" -o "$d/bin/" \
    ./cmd/workflow-controller ./cmd/argoexec ./cmd/argo
  rm -rf "$src"
}

build_training_operator() {
  # The Kubeflow training operator's one binary (cmd/training-operator.v1, as its Dockerfile
  # builds it: CGO off). The module has no replace directives, so a plain requirement builds
  # it as released; its manifests stay in the module cache, where cluster/operator.sh and lint
  # read them.
  local d="$1"
  new_module "$d" "github.com/kubeflow/training-operator@$TRAINING_OPERATOR_VERSION"
  "${NICE[@]}" go build -trimpath -ldflags "-s -w" -o "$d/bin/training-operator" \
    github.com/kubeflow/training-operator/cmd/training-operator.v1
}

build_training_operator_image() {
  # Its Dockerfile (build/images/training-operator): the binary as /manager, its entrypoint,
  # run as root as upstream's distroless/static:latest does.
  [[ -x "$OPERATOR_DIR/bin/training-operator" ]] || die "build training-operator first"
  debian_image "$OPERATOR_IMAGE" "$1/training-operator.tar" "$OPERATOR_DIR/bin/training-operator" \
    /manager 0
}

ensure_podman() {
  command -v podman > /dev/null && command -v mmdebstrap > /dev/null \
    || apt-get install -y -q podman mmdebstrap > /dev/null
}

build_images() {  # pause (sandbox image) and a Debian base that is also the hello image
  local d="$1" ctx="$1/ctx"
  [[ -x "$K8S_DIR/bin/pause" ]] || die "build kubernetes first"
  ensure_podman; mkdir -p "$ctx"
  # pause: FROM scratch with the static binary, as build/pause/Dockerfile does.
  cp "$K8S_DIR/bin/pause" "$ctx/pause"
  printf 'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n' > "$ctx/Containerfile"
  podman build -q -t "localhost/unet-cluster/pause:$PAUSE_TAG" "$ctx" > /dev/null
  "${NICE[@]}" mmdebstrap --quiet --variant=minbase --include=ca-certificates,media-types \
    "$DEBIAN_SUITE" "$ctx/rootfs.tar"
  podman import -q "$ctx/rootfs.tar" "localhost/unet-cluster/debian:$DEBIAN_SUITE" > /dev/null
  podman save -q -o "$d/pause.tar" "localhost/unet-cluster/pause:$PAUSE_TAG"
  podman save -q -o "$d/debian.tar" "localhost/unet-cluster/debian:$DEBIAN_SUITE"
  rm -rf "$ctx"
}

# debian_image TAG TAR BINARY PATH UID: BINARY at PATH, its entrypoint, run as UID, on the
# cluster's Debian base (the upstream images' distroless bases are served by no registry here);
# built by podman and saved to TAR.
debian_image() {
  local ctx; ctx="$(dirname "$2")/ctx"
  [[ -f "$IMAGES_DIR/debian.tar" ]] || die "build images first"
  ensure_podman
  podman image exists "localhost/unet-cluster/debian:$DEBIAN_SUITE" \
    || podman load -q -i "$IMAGES_DIR/debian.tar" > /dev/null
  rm -rf "$ctx"; mkdir -p "$ctx"; cp "$3" "$ctx/binary"
  printf 'FROM localhost/unet-cluster/debian:%s\nCOPY binary %s\nUSER %s\nENTRYPOINT ["%s"]\n' \
    "$DEBIAN_SUITE" "$4" "$5" "$4" > "$ctx/Containerfile"
  podman build -q -t "$1" "$ctx" > /dev/null
  podman save -q -o "$2" "$1"
  rm -rf "$ctx"
}

build_argo_images() {
  # Argo's three images (its Dockerfile's targets argoexec, workflow-controller and argocli) from
  # the binaries of the argo stage; the controller and the CLI as Argo's uid 8737, as its images
  # run them.
  local d="$1" v image name bin uid
  v="$(argo_version)"
  [[ -x "$(argo_dir)/bin/argoexec" ]] || die "build argo first"
  for image in argoexec:argoexec:0 workflow-controller:workflow-controller:8737 argocli:argo:8737; do
    IFS=: read -r name bin uid <<< "$image"
    debian_image "localhost/unet-cluster/$name:$v" "$d/$name.tar" "$(argo_dir)/bin/$bin" "/bin/$bin" "$uid"
  done
}

stages=("$@"); [[ ${#stages[@]} -gt 0 ]] || stages=(etcd kubernetes kube-proxy cni-plugins coredns images ui argo argo-images)
for s in "${stages[@]}"; do
  case "$s" in
    etcd) run_stage etcd "$ETCD_DIR" build_etcd ;;
    kubernetes) run_stage kubernetes "$K8S_DIR" build_kubernetes ;;
    ui) run_stage ui "$(ui_dir)" build_ui ;;
    argo) run_stage argo "$(argo_dir)" build_argo ;;
    images) run_stage images "$IMAGES_DIR" build_images ;;
    argo-images) run_stage argo-images "$(argo_images_dir)" build_argo_images ;;
    kube-proxy) run_stage kube-proxy "$KUBE_PROXY_DIR" build_kube_proxy ;;
    cni-plugins) run_stage cni-plugins "$CNI_DIR" build_cni_plugins ;;
    coredns) run_stage coredns "$COREDNS_DIR" build_coredns ;;
    training-operator) run_stage training-operator "$OPERATOR_DIR" build_training_operator ;;
    training-operator-image) run_stage training-operator-image "$OPERATOR_IMAGE_DIR" build_training_operator_image ;;
    *) die "unknown stage $s (etcd, kubernetes, kube-proxy, cni-plugins, coredns, images, ui, argo, argo-images, training-operator, training-operator-image)" ;;
  esac
done
log "build: $(du -sh "$CACHE" | cut -f1) in $CACHE"
