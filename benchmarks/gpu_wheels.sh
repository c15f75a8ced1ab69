#!/usr/bin/env bash
# The wheels that a lent GPU machine's image lacks for benchmarks.gpu_session (it has torch,
# numpy, tqdm, pyyaml, matplotlib, onnx): our dependencies at their tested versions
# (.ci/constraints.txt), built for its CPython 3.12 on x86-64, saved to DEST (default .whl,
# which git ignores and the device tool carries; benchmarks/README.md gives the call).
#
#   bash benchmarks/gpu_wheels.sh [DEST]
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
names=(monai nibabel pydantic pydantic-core annotated-types typing-inspection typing-extensions
       boto3 botocore s3transfer jmespath isal)
pins=()
for name in "${names[@]}"; do
  pin=$(grep -ix "$name==.*" .ci/constraints.txt) \
    || { echo "error: $name has no pin in .ci/constraints.txt" >&2; exit 2; }
  pins+=("$pin")
done
[ "$dest" != .whl ] || grep -qx '/.whl/' .git/info/exclude 2>/dev/null \
  || echo /.whl/ >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dest" "${pins[@]}"
ls "$dest"
