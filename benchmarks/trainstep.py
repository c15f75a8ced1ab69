"""3. Train step: img/s of ours vs MONAI DynUNet + the anchors' loss in a plain loop, on the CPU
(batch 16, fp32); :func:`gpu_rows` does the same on a GPU (batch 64, mixed precision) for
benchmark 11 (``gpu``).

Ours: steps.model's network, steps.losses.DeepSupervisionLoss, steps.devices' optimizer and
steps.train.train_step, fed by steps.sampler (sample + augment). Baseline: a DynUNet built
here with the anchors' settings, ``DiceLoss(include_background=False, softmax=True,
to_onehot_y=True, batch=True) + CrossEntropyLoss`` over the three deep-supervision heads
(weights 1, 0.5, 0.25, normalised), AdamW, fed by the MONAI loader of benchmark 2.
"End to end" includes building each batch; "compute only" repeats one prepared batch.
"""
from __future__ import annotations

import os
import time
import warnings

from monai.losses import DiceLoss
from monai.networks.nets import DynUNet
import numpy as np
import torch

from benchmarks.common import Row, Settings, dataset_dir, in_child, step_env
from benchmarks.loader import monai_pipeline
from steps import devices
from steps.dataset import open_cases, read_metadata
from steps.losses import DeepSupervisionLoss
from steps.model import ModelConfig, build_model
from steps.sampler import SliceSampler, augment, torch_seed
from steps.train import train_step

NVIDIA_A100_AMP_IMG_S = 1238.68   # NVIDIA nnUNet 2D, 1x A100 80G, AMP, batch 64
NVIDIA_CARD = "1x A100 80G, AMP, batch 64"


def _throughput(step, make_batch, steps: int, batch: int, info) -> tuple[float, float]:
    """(end-to-end img/s, compute-only img/s) on ``info``'s device after warm-up steps (one
    on the CPU, five on a GPU for cuDNN's autotuning), each figure timed to a device sync."""

    fixed = make_batch(0)
    for _ in range(1 if info.kind == "cpu" else 5):
        step(*fixed)
    devices.synchronize(info)
    start = time.perf_counter()
    for i in range(1, steps + 1):
        step(*make_batch(i))
    devices.synchronize(info)
    e2e = steps * batch / (time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(steps):
        step(*fixed)
    devices.synchronize(info)
    return e2e, steps * batch / (time.perf_counter() - start)


def _device(device: str):
    """(steps.devices' choice for ``device``, its GradScaler): fp32 on the CPU, mixed
    precision and cuDNN autotuning on a GPU, for both sides."""

    info = devices.select_device(device, "fp32" if device == "cpu" else "auto")
    if info.kind == "cuda":
        torch.backends.cudnn.benchmark = True
    return info, torch.amp.GradScaler("cuda", enabled=info.needs_grad_scaler())


def run_ours(dataset, patch, batch: int, steps: int, filters: int, levels: int,
             device: str = "cpu"):

    info, scaler = _device(device)
    devices.configure_backends(info)             # as steps.train does
    torch.manual_seed(0)
    net = devices.prepare_model(build_model(ModelConfig(base_filters=filters, levels=levels)),
                                info).train()
    optimizer = devices.make_optimizer("adamw", net.parameters(), 1e-3, 1e-4, info)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    loss_fn = DeepSupervisionLoss()
    sampler = SliceSampler(open_cases(dataset, read_metadata(dataset, check_hashes=False)),
                           patch, batch, seed=0)

    def make_batch(i: int):         # as steps.train: sampled on the host, augmented on device
        images, labels = sampler(i)
        seed = torch_seed(0, i, 0)
        return augment(devices.to_device(images, info),
                       devices.host_to_device(labels, info.device, torch.long), seed,
                       devices.device_generator(info, seed), inplace=True)

    def step(images, labels):
        train_step(net, loss_fn, optimizer, scheduler, scaler, info, images, labels)

    return _throughput(step, make_batch, steps, batch, info)


def run_baseline(dataset, patch, batch: int, steps: int, filters: int, levels: int,
                 device: str = "cpu"):


    warnings.filterwarnings("ignore")
    info, scaler = _device(device)
    torch.manual_seed(0)
    strides = [1] + [2] * (levels - 1)
    net = DynUNet(2, 4, 4, kernel_size=[3] * levels, strides=strides,
                  upsample_kernel_size=strides[1:],
                  filters=[min(filters * 2 ** i, 512) for i in range(levels)],
                  norm_name=("INSTANCE", {"affine": True}),
                  act_name=("leakyrelu", {"inplace": True, "negative_slope": 0.01}),
                  deep_supervision=True, deep_supr_num=2, res_block=False).to(info.device).train()
    dice = DiceLoss(include_background=False, softmax=True, to_onehot_y=True, batch=True)
    ce = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-4)
    weights = [1.0, 0.5, 0.25]
    cases = open_cases(dataset, read_metadata(dataset, check_hashes=False))
    pipeline, rng = monai_pipeline(patch, 0), np.random.default_rng(0)

    def make_batch(_i: int):
        images, labels = [], []
        for _ in range(batch):
            case = cases[int(rng.integers(len(cases)))]
            z = int(rng.integers(case.label.shape[0]))
            out = pipeline({"image": np.asarray(case.image[:, z], dtype=np.float32),
                            "label": np.asarray(case.label[z])[np.newaxis]})[0]
            images.append(torch.as_tensor(out["image"]))
            labels.append(torch.as_tensor(out["label"]))
        return (torch.stack(images).as_tensor().to(info.device),
                torch.stack(labels).as_tensor().long().to(info.device))

    def step(images, labels):
        optimizer.zero_grad()
        with info.autocast():
            heads = net(images).float()
        loss = sum(w * (dice(heads[:, i], labels) + ce(heads[:, i], labels[:, 0]))
                   for i, w in enumerate(weights)) / sum(weights)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    return _throughput(step, make_batch, steps, batch, info)


def run(settings: Settings) -> dict:
    threads = len(os.sched_getaffinity(0))
    args = (settings.patch, settings.batch, settings.train_steps, settings.base_filters,
            settings.levels)
    env = step_env()
    # Alternating rounds (baseline, ours, baseline, ...), each side a fresh process, so drift
    # in machine load hits both; medians are reported and every round is in the JSON.
    rounds = {"baseline": [], "ours": []}
    for _ in range(settings.train_rounds):
        rounds["baseline"].append(in_child(run_baseline, dataset_dir(settings, "anchor"), *args,
                                           threads=threads)[0])
        rounds["ours"].append(in_child(run_ours, dataset_dir(settings, "default"), *args,
                                       threads=threads, env=env)[0])
    (base_e2e, base_compute), (ours_e2e, ours_compute) = (
        tuple(float(np.median([r[i] for r in rounds[side]])) for i in (0, 1))
        for side in ("baseline", "ours"))
    spread = {side: {"end_to_end": [min(r[0] for r in rounds[side]),
                                    max(r[0] for r in rounds[side])],
                     "compute_only": [min(r[1] for r in rounds[side]),
                                      max(r[1] for r in rounds[side])]}
              for side in rounds}
    rows = [Row("train step", "img/s end to end (data included)", "img/s", ours_e2e, base_e2e,
                "MONAI DynUNet + DiceLoss+CE, plain loop, MONAI loader"),
            Row("train step", "img/s compute only", "img/s", ours_compute, base_compute,
                "MONAI DynUNet + DiceLoss+CE, plain loop")]
    return {"rows": rows, "details": {
        "batch": settings.batch, "patch": list(settings.patch), "steps": settings.train_steps,
        "threads": threads, "precision": "fp32", "ours_env": env,
        "rounds": settings.train_rounds, "img_s_by_round": rounds, "min_max": spread,
        "allocator": "glibc malloc (no LD_PRELOAD); ours with the pipeline's step env",
        "network": {"base_filters": settings.base_filters, "levels": settings.levels},
        "gpu": "benchmark 11 (gpu)",
    }}


def gpu_rows(settings: Settings, device: str, name: str) -> tuple[list[Row], dict]:
    """Batch 64 (the anchors' and NVIDIA's) in mixed precision on ``device``, ours vs the
    MONAI loop, and ours vs NVIDIA's published figure (benchmark ``gpu`` calls this)."""
    args = (settings.patch, settings.gpu_batch, settings.gpu_train_steps,
            settings.base_filters, settings.levels, device)
    (base_e2e, base_compute), _ = in_child(run_baseline, dataset_dir(settings, "anchor"), *args)
    (ours_e2e, ours_compute), _ = in_child(run_ours, dataset_dir(settings, "default"), *args,
                                           env=step_env())
    where = f"batch {settings.gpu_batch}, {name}"
    rows = [Row("train step", f"img/s end to end, {where}", "img/s", ours_e2e, base_e2e,
                "MONAI DynUNet + DiceLoss+CE, same device and precision, MONAI loader"),
            Row("train step", f"img/s compute only, {where}", "img/s", ours_compute,
                base_compute, "MONAI DynUNet + DiceLoss+CE, same device and precision")]
    if device == "cuda":
        rows.append(Row("train step", f"img/s end to end, {where}", "img/s", ours_e2e,
                        NVIDIA_A100_AMP_IMG_S, f"NVIDIA's published figure ({NVIDIA_CARD})"))
    return rows, {"nvidia_published_img_s": NVIDIA_A100_AMP_IMG_S, "card": NVIDIA_CARD,
                  "ours_img_s": [ours_e2e, ours_compute],
                  "monai_img_s": [base_e2e, base_compute], "steps": settings.gpu_train_steps}
