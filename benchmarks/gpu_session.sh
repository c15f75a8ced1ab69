#!/usr/bin/env bash
# The CUDA acceptance run in one call on a lent GPU machine (about 9 minutes on an H200):
#
#   bash benchmarks/gpu_session.sh OUT_DIR
#
# 1. python -m steps.device_check on CUDA: eager and torch.compile, 1 device, batch 32 (its
#    fp32 CPU reference at batch 64 took most of a 150 s limit on a 16-core host);
# 2. python -m benchmarks gpu: steps.train's own epoch (eager and --cuda-compile) with the
#    GPU's wait for input, the memory-layout A/B, ours against the MONAI loop at batch 64,
#    device-side augmentation;
# 3. steps.train on that GPU (2 short epochs), then steps.convert of its model: ONNX parity
#    on the CPU.
# Every stage has its own time limit, so the call ends inside the device's 10-minute limit
# and what finished comes back. benchmarks/results/gpu-nvidia-h200-2026-11-26.json is what
# its first version gave, and what the stages that did not finish gave in a second call. Expects our dependencies importable (monai, nibabel, pydantic, boto3).
set -uo pipefail
out=${1:?usage: gpu_session.sh OUT_DIR}
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

stage device_check 150 python3 -m steps.device_check --device cuda --batch 32 --steps 15 \
  --warmup 5 --json "$out/device_check.json"
stage benchmark 330 python3 -m benchmarks gpu --workdir "$work" --out "$out/gpu-benchmark.json"
dataset="$work/dataset-default"
stage train 70 python3 -m steps.train --dataset "$dataset" --model "$work/model" \
  --device cuda --batch-size 64 --max-epochs 2 --steps-per-epoch 100 --num-workers 8
stage convert 100 python3 -m steps.convert --model "$work/model" --dataset "$dataset" \
  --exported "$work/exported"
cp "$work/model/metrics.json" "$out/train-metrics.json" 2>/dev/null
cp "$work/exported/model-card.json" "$out/model-card.json" 2>/dev/null
grep -E "^(== |epoch [0-9]+:|error)|img/s|device_check:|parity" "$log" | grep -v "it/s\]" \
  | tail -n 60
