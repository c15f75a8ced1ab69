#!/usr/bin/env bash
# The CUDA acceptance run in one call on a lent GPU machine (about 9 minutes):
#
#   bash benchmarks/gpu_session.sh OUT_DIR [SECONDS]
#
# 1. the versions: card, driver, torch, CUDA, cuDNN, host CPU;
# 2. steps.train by default (torch.compile, channels_last, side-stream prefetch) with a
#    checkpoint store, from empty compile caches: its first step cold and its epochs;
# 3. the same run retried as an Argo retry runs it (a fresh pod: empty local caches, the same
#    checkpoint store): it resumes and restores the compile cache; its first step warm;
# 4. python -m benchmarks gpu with what is left of SECONDS (default 560): every variant of
#    benchmarks.gpu.VARIANTS (fp16 with its GradScaler among them) in interleaved rounds,
#    end to end and compute only, and the profiles; from the compile caches of stage 2.
# GPU_EPOCHS (default 2) sets the cold run's epochs, UNET_GPU_VARIANTS the benchmark's variants.
# Every stage has its own time limit, so the call ends inside the device's 10-minute limit
# and what finished comes back. Expects our dependencies importable (monai, nibabel,
# pydantic, boto3).
set -uo pipefail
out=${1:?usage: gpu_session.sh OUT_DIR [SECONDS]}
total=${2:-560}
work=${GPU_WORK:-/tmp/unet-gpu}
export PYTHONUNBUFFERED=1
mkdir -p "$out" "$work"
log="$out/session.log"

stage() {   # stage NAME SECONDS COMMAND...: run it, log it, say how it ended
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "== $name: $*" | tee -a "$log"
  timeout "$limit" "$@" >> "$log" 2>&1
  echo "== $name: exit $? after $((SECONDS - start)) s" | tee -a "$log"
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
                                  "cudnn", torch.backends.cudnn.version())'
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) x $(nproc)"; } \
  > "$out/env.txt" 2>&1
cat "$out/env.txt"

stage dataset 120 python3 -c "import sys; from pathlib import Path
from benchmarks.common import Settings, dataset_dir
print(dataset_dir(Settings.make(False, Path(sys.argv[1]))))" "$work"
dataset="$work/dataset-default"
train=(python3 -m steps.train --dataset "$dataset" --device cuda --batch-size 64
       --num-workers 8)
epochs=${GPU_EPOCHS:-2}   # of the cold run; the retry adds one
stage cold 200 env TORCHINDUCTOR_CACHE_DIR="$work/inductor-a" TRITON_CACHE_DIR="$work/triton-a" \
  "${train[@]}" --model "$work/model-a" --max-epochs "$epochs" --steps-per-epoch 150 \
  --checkpoint-uri "$work/checkpoints"
stage retry 100 env TORCHINDUCTOR_CACHE_DIR="$work/inductor-b" TRITON_CACHE_DIR="$work/triton-b" \
  "${train[@]}" --model "$work/model-b" --max-epochs $((epochs + 1)) --steps-per-epoch 150 \
  --checkpoint-uri "$work/checkpoints"
left=$((total - SECONDS - 30))
stage benchmark $((left + 25)) env UNET_GPU_BUDGET_S="$left" \
  TORCHINDUCTOR_CACHE_DIR="$work/inductor-a" TRITON_CACHE_DIR="$work/triton-a" \
  python3 -m benchmarks gpu --workdir "$work" --out "$out/gpu-benchmark.json"
for run in model-a model-b; do
  cp "$work/$run/metrics.json" "$out/metrics-$run.json" 2>/dev/null
done
grep -E "^(== |epoch [0-9]+:|error|train: |gpu: )|img/s" "$log" | grep -v "it/s\]" | tail -n 80
