#!/usr/bin/env bash
# Install the Kubeflow training operator (PyTorchJob) on the running single-node cluster as the
# README tells a user to (`kubectl apply --server-side -k` of its manifests/overlays/standalone):
# the module's own standalone overlay, all CRDs, the operator's Deployment in namespace
# kubeflow, its Service and validating webhook. What differs: the image is ours (cluster/build.sh
# training-operator-image), and so is the workers' init image (below). Idempotent.
#   bash cluster/operator.sh          # install (or keep) it; wait until its webhook answers
#   bash cluster/operator.sh stop     # remove its Deployment and webhook registration
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/lib.sh"
NS=kubeflow                                   # the overlay's namespace
WEBHOOK=validator.training-operator.kubeflow.org   # cmd/training-operator.v1/main.go webhookConfigurationName
# The operator gives every Worker an init container that loops on `nslookup <master>` until the
# master's Service resolves (pkg/controller.v1/pytorch/initcontainer.go), in alpine:3.10 by
# default. This cluster has no registry, so it gets a stand-in built from the cluster's Debian
# base whose `nslookup` is `getent hosts`: the pod's own resolver, the cluster's DNS.
INIT_IMAGE="localhost/unet-cluster/pytorch-init:$DEBIAN_SUITE-2"
kc() { kubectl --kubeconfig "$KUBECONFIG_ADMIN" "$@"; }

if [[ "${1:-}" == stop ]]; then
  # The webhook first: with its failurePolicy Fail, no PyTorchJob could be written without it.
  kc delete validatingwebhookconfiguration "$WEBHOOK" --ignore-not-found > /dev/null
  kc -n "$NS" delete deployment training-operator --ignore-not-found --wait > /dev/null
  log "training-operator stopped"; exit 0
fi

[[ -f "$OPERATOR_IMAGE_DIR/training-operator.tar" ]] \
  || die "$OPERATOR_IMAGE_DIR/training-operator.tar missing: run bash cluster/build.sh training-operator training-operator-image"
[[ -f "$KUBECONFIG_ADMIN" ]] && kc get --raw /readyz > /dev/null 2>&1 \
  || die "no cluster answers at $KUBECONFIG_ADMIN: run bash cluster/up.sh"

if ! podman image exists "$INIT_IMAGE"; then
  podman image exists "localhost/unet-cluster/debian:$DEBIAN_SUITE" \
    || podman load -q -i "$IMAGES_DIR/debian.tar" > /dev/null
  ctx="$(mktemp -d)"
  printf '#!/bin/sh\n# stand-in for nslookup: resolve with the pod resolver (cluster DNS)\nexec getent hosts "$1"\n' \
    > "$ctx/nslookup"
  printf 'FROM localhost/unet-cluster/debian:%s\nCOPY --chmod=755 nslookup /usr/local/bin/nslookup\n' \
    "$DEBIAN_SUITE" > "$ctx/Containerfile"
  podman build -q -t "$INIT_IMAGE" "$ctx" > /dev/null
  rm -rf "$ctx"
fi
podman image exists "$OPERATOR_IMAGE" \
  || podman load -q -i "$OPERATOR_IMAGE_DIR/training-operator.tar" > /dev/null
bash "$here/load-image.sh" "$INIT_IMAGE" "$OPERATOR_IMAGE"

# The overlay from the module, in a copy beside our kustomization.
install="$STATE/operator-install"
module_manifests "github.com/kubeflow/training-operator@$TRAINING_OPERATOR_VERSION" "$install"
cat > "$install/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [manifests/overlays/standalone]
images:
- {name: ghcr.io/kubeflow/training-v1/training-operator, newName: ${OPERATOR_IMAGE%:*}, newTag: $TRAINING_OPERATOR_VERSION}
patches:
- target: {kind: Deployment, name: training-operator}
  patch: '[{"op": "add", "path": "/spec/template/spec/containers/0/args",
            "value": ["--pytorch-init-container-image=$INIT_IMAGE"]}]'
EOF
kc apply --server-side -k "$install" > /dev/null
# Ready once its cert rotator has filled the webhook Secret, the kubelet has mounted it (it
# refreshes a Secret volume on its pod sync, up to a minute) and the webhook server started
# (main.go setupProbeEndpoints, open-policy-agent cert-controller rotator.go).
t0=$SECONDS
kc -n "$NS" rollout status deployment/training-operator --timeout=300s > /dev/null \
  || { kc -n "$NS" logs deployment/training-operator --tail=20 >&2 || true; die "training-operator not ready"; }
# The API server reaches the webhook through the operator's Service (kube-proxy), with the CA
# that the rotator put into the registration: a job with two masters must be refused by it.
refused() {
  local said
  said="$(kc create --dry-run=server -f - 2>&1 <<EOF || true
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata: {name: webhook-check, namespace: default}
spec:
  pytorchReplicaSpecs:
    Master:
      replicas: 2
      template: {spec: {containers: [{name: pytorch, image: "$INIT_IMAGE"}]}}
EOF
)"
  grep -q 'admission webhook "validator.pytorchjob.training-operator.kubeflow.org" denied' <<< "$said"
}
for _ in $(seq 60); do refused && break; sleep 2; done
refused || die "the operator's validating webhook does not answer through its Service"
log "training-operator $TRAINING_OPERATOR_VERSION ready, its webhook answering, after $(( SECONDS - t0 ))s"
