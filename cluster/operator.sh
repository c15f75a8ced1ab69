#!/usr/bin/env bash
# Install the Kubeflow training operator (PyTorchJob) on the running single-node cluster:
# its CRDs from the module's manifests/base/crds, and the controller as a host process with the
# admin kubeconfig (as cluster/up.sh runs Argo). Needs `bash cluster/build.sh training-operator`
# and a cluster from `bash cluster/up.sh`. Idempotent; cluster/down.sh stops it.
#   bash cluster/operator.sh          # start (or keep) it and wait until it is ready
#   bash cluster/operator.sh stop     # stop only the operator
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/lib.sh"
NS=kubeflow                       # pkg/cert/cert.go defaultOperatorNamespace (MY_POD_NAMESPACE unset)
SECRET=training-operator-webhook-cert   # cmd/training-operator.v1/main.go --webhook-secret-name default
METRICS=127.0.0.1:18080
PROBE=127.0.0.1:18081
WEBHOOK_PORT=9443
PID="$RUN_DIR/training-operator.pid"
# The operator gives every Worker an init container that loops on `nslookup <master>` until the
# master's Service resolves (pkg/controller.v1/pytorch/initcontainer.go), in alpine:3.10 by
# default. This cluster has no registry, so it gets a stand-in built from the cluster's Debian
# base whose `nslookup` is `getent hosts`: the pod's own resolver, the cluster's DNS.
INIT_IMAGE="localhost/unet-cluster/pytorch-init:$DEBIAN_SUITE-2"
kc() { kubectl --kubeconfig "$KUBECONFIG_ADMIN" "$@"; }
alive() { [[ -f "$PID" ]] && kill -0 "$(cat "$PID")" 2> /dev/null; }

if [[ "${1:-}" == stop ]]; then
  if alive; then kill "$(cat "$PID")"; for _ in $(seq 20); do alive || break; sleep 0.5; done; fi
  alive && kill -9 "$(cat "$PID")" 2> /dev/null || true
  [[ ! -f "$RUN_DIR/made-webhook-certs" ]] || rm -rf "${WEBHOOK_CERTS%/serving-certs}"
  rm -f "$PID" "$RUN_DIR/made-webhook-certs"; log "training-operator stopped"; exit 0
fi

[[ -x "$OPERATOR_DIR/bin/training-operator" ]] \
  || die "$OPERATOR_DIR/bin/training-operator missing: run bash cluster/build.sh training-operator"
[[ -f "$KUBECONFIG_ADMIN" ]] && kc get --raw /readyz > /dev/null 2>&1 \
  || die "no cluster answers at $KUBECONFIG_ADMIN: run bash cluster/up.sh"

# Its key folder is fixed, in /tmp (pkg/cert/cert.go certDir): it must be ours (down.sh
# removes it), and what is written there readable by root alone.
if [[ -e "$WEBHOOK_CERTS" && ! -f "$RUN_DIR/made-webhook-certs" ]]; then
  die "$WEBHOOK_CERTS exists and operator.sh did not make it (another operator's?)"
fi

# CRDs: only PyTorchJob is used; the controller is started with --enable-scheme=pytorchjob, so
# the other kinds' CRDs are not needed (main.go fills all schemes only when none is given).
kc apply --server-side -f "$OPERATOR_DIR/crds/kubeflow.org_pytorchjobs.yaml" > /dev/null
# (a poll: `kubectl wait` right after the apply fails on a CRD without status.conditions yet)
for _ in $(seq 60); do
  [[ "$(kc get crd pytorchjobs.kubeflow.org -o jsonpath='{.status.conditions[?(@.type=="Established")].status}')" == True ]] && break
  sleep 1
done
# The cert rotator (open-policy-agent/cert-controller rotator.go refreshCertIfNeeded) reads this
# Secret and fails without it; the operator's own manifests ship it empty. The validating
# webhook configuration is not registered: the API server could only reach it through a
# Service, and this cluster has no kube-proxy (cluster/README.md). The rotator skips a missing
# webhook configuration (ensureCerts: "Webhook not found") and still reports ready.
kc create namespace "$NS" --dry-run=client -o yaml | kc apply -f - > /dev/null
kc -n "$NS" get secret "$SECRET" > /dev/null 2>&1 || kc -n "$NS" create secret generic "$SECRET" > /dev/null

# The webhook server binds every interface (main.go sets only its port): loopback only, as
# up.sh guards Argo's ports; down.sh removes rules with this comment.
guard "$WEBHOOK_PORT"

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
bash "$here/load-image.sh" "$INIT_IMAGE"

mkdir -p "$LOGS" "$RUN_DIR"
if alive; then
  log "training-operator already running (pid $(cat "$PID"))"
else
  KUBECONFIG="$KUBECONFIG_ADMIN" setsid "$OPERATOR_DIR/bin/training-operator" \
    --enable-scheme=pytorchjob --pytorch-init-container-image="$INIT_IMAGE" \
    --metrics-bind-address="$METRICS" \
    --health-probe-bind-address="$PROBE" --webhook-server-port="$WEBHOOK_PORT" \
    --leader-elect=false >> "$LOGS/training-operator.log" 2>&1 < /dev/null &
  echo $! > "$PID"
fi
# In its Deployment (manifests/base/deployment.yaml) the kubelet mounts the Secret at the cert
# folder of pkg/cert/cert.go; the rotator only fills the Secret and then waits for the files
# (rotator.go ensureCertsMounted). A host process has no kubelet: write them as the mount would.
for _ in $(seq 120); do
  crt="$(kc -n "$NS" get secret "$SECRET" -o jsonpath='{.data.tls\.crt}' 2> /dev/null || true)"
  [[ -n "$crt" ]] && break; sleep 1
done
[[ -n "$crt" ]] || die "the operator's cert rotator did not fill secret $NS/$SECRET"
touch "$RUN_DIR/made-webhook-certs"
(umask 077 && mkdir -p "$WEBHOOK_CERTS")
for f in tls.crt tls.key ca.crt; do
  (umask 077 && kc -n "$NS" get secret "$SECRET" -o jsonpath="{.data.${f//./\\.}}" \
    | base64 -d > "$WEBHOOK_CERTS/$f.tmp")
  mv "$WEBHOOK_CERTS/$f.tmp" "$WEBHOOK_CERTS/$f"
done
# readyz turns ok once the certificates exist and the webhook server started (main.go
# setupProbeEndpoints); the controllers are registered right after the same channel closes.
t0=$SECONDS
until curl -fsS "http://$PROBE/readyz" > /dev/null 2>&1; do
  alive || { tail -n 20 "$LOGS/training-operator.log" >&2; die "training-operator exited"; }
  (( SECONDS - t0 < 120 )) || { tail -n 20 "$LOGS/training-operator.log" >&2; die "training-operator not ready after 120s"; }
  sleep 1
done
log "training-operator $TRAINING_OPERATOR_VERSION ready after $(( SECONDS - t0 ))s (log: $LOGS/training-operator.log)"
