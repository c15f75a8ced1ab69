"""11. The GPU path: ``steps.train``'s own epoch on a CUDA card, the train step against the
MONAI loop, and the loader's device-side augmentation.

- **Epoch**: the real ``Trainer`` of ``steps.train`` (its DataLoader workers, pinned memory,
  device-side augmentation and train step) runs one warm-up epoch and one timed epoch at the
  anchors' batch 64, eager and with ``--cuda-compile``. The time the GPU waits for input is
  measured with CUDA events: one recorded before the loop asks its loader for the next
  batch, one as the batch arrives. While the GPU still has queued work the two complete back
  to back; the gap between them is time the GPU sat idle because the host was waiting for
  the loader. Reported as a share of the epoch (the target is under 5 %). Baseline: NVIDIA's
  published nnU-Net 2D figure (1238.68 img/s, 1x A100 80G, AMP, batch 64).
- **Layout** (:func:`layout_ab`): our train step with channels_last against the contiguous
  layout, alternating rounds (``steps.devices.CUDA_CHANNELS_LAST`` follows the verdict).
- **Train step** (``benchmarks.trainstep.gpu_rows``): ours against the MONAI loop at batch 64,
  mixed precision, both fed on the main thread.
- **Loader** (``benchmarks.loader.device_rows``): augmentation on the device.

With ``--smoke`` the same code runs on the CPU with tiny shapes (the rows say so); the events
are then absent and only the host's wait is reported.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import loader, trainstep
from benchmarks.common import Row, Settings, dataset_dir, gpu_rows_device, in_child, step_env
from benchmarks.trainstep import NVIDIA_A100_AMP_IMG_S, NVIDIA_CARD
from steps import devices, train

PROFILE_WORKERS = 8          # train.num_workers of profile cuda_1gpu (config/pipeline.yaml)


def _trainer_class():
    """``steps.train.Trainer`` with its loader timed (imported late: the parent process of
    the benchmarks never imports torch's CUDA state)."""

    class InputTimedTrainer(train.Trainer):
        waits: list

        def _loader(self, first_step: int, n_steps: int):
            return self._timed(super()._loader(first_step, n_steps))

        def _mark(self):
            if self.info.kind != "cuda":
                return None
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event

        def _timed(self, batches):
            iterator = iter(batches)
            while True:
                before, host = self._mark(), time.perf_counter()
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
                self.waits.append((time.perf_counter() - host, before, self._mark()))
                yield batch

    return InputTimedTrainer


def epoch_profile(dataset: Path, device: str, batch: int, steps: int, workers: int,
                  filters: int, levels: int, compiled: bool, channels_last: bool = True) -> dict:
    """One warm-up epoch (the loader's workers start, cuDNN tunes, torch.compile compiles),
    then one timed epoch of ``steps.train``'s loop: img/s, and the GPU's and the host's wait
    for input (seconds and share of the epoch)."""

    devices.CUDA_CHANNELS_LAST = channels_last
    with tempfile.TemporaryDirectory() as scratch:
        args = train.build_parser().parse_args([
            "--dataset", str(dataset), "--model", str(Path(scratch) / "model"),
            "--device", device, "--precision", "auto", "--batch-size", str(batch),
            "--num-workers", str(workers), "--steps-per-epoch", str(steps),
            "--max-epochs", "2", "--base-filters", str(filters), "--levels", str(levels),
            "--cuda-compile", "true" if compiled else "false"])
        trainer = _trainer_class()(train.preflight(args), 0, 1, 0)
    trainer.waits = []
    trainer.run_epoch()
    progress = trainer.progress
    progress.epoch, progress.epoch_loss, progress.epoch_steps = 1, 0.0, 0
    trainer.waits = []
    epoch = trainer.run_epoch()
    devices.synchronize(trainer.info)
    trainer.batches = None                       # the loader's workers stop
    gpu = [b.elapsed_time(a) / 1e3 for _, b, a in trainer.waits if b is not None]
    host = sum(w for w, _, _ in trainer.waits)
    return {"img_per_s": epoch["img_per_s"], "seconds": epoch["seconds"], "steps": steps,
            "workers": workers, "host_wait_s": host, "host_wait_share": host / epoch["seconds"],
            "gpu_wait_s": sum(gpu) if gpu else None,
            "gpu_wait_share": sum(gpu) / epoch["seconds"] if gpu else None}


def ours_in_layout(channels_last: bool, *args) -> tuple[float, float]:
    """``benchmarks.trainstep.run_ours`` with the CUDA memory layout chosen."""

    devices.CUDA_CHANNELS_LAST = channels_last
    return trainstep.run_ours(*args)


def layout_ab(settings: Settings, device: str, rounds: int = 2) -> dict:
    """Our train step (compute only and end to end) with channels_last and with the default
    contiguous layout, alternating rounds in fresh processes; medians and every round."""
    args = (dataset_dir(settings, "default"), settings.patch, settings.gpu_batch,
            settings.gpu_train_steps, settings.base_filters, settings.levels, device)
    by_layout = {"channels_last": [], "contiguous": []}
    for _ in range(rounds):
        for layout in by_layout:
            by_layout[layout].append(in_child(ours_in_layout, layout == "channels_last", *args,
                                              env=step_env())[0])
    return {layout: {"end_to_end": float(np.median([r[0] for r in runs])),
                     "compute_only": float(np.median([r[1] for r in runs])), "rounds": runs}
            for layout, runs in by_layout.items()}


def run(settings: Settings) -> dict:
    chosen = gpu_rows_device(settings)
    if chosen is None:
        return {"rows": [], "details": {"why": "no GPU on this machine"}}
    device, name = chosen
    dataset, env = dataset_dir(settings, "default"), step_env()
    steps, workers = (4, 2) if settings.smoke else (100, PROFILE_WORKERS)
    where = f"batch {settings.gpu_batch}, {workers} workers, {name}"
    rows, details = [], {"device": name, "batch": settings.gpu_batch, "epochs": {}}
    for compiled in (False, True):
        label = "torch.compile" if compiled else "eager"
        epoch, _ = in_child(epoch_profile, dataset, device, settings.gpu_batch, steps, workers,
                            settings.base_filters, settings.levels, compiled, env=env)
        details["epochs"][label] = epoch
        print(f"gpu: epoch {label}: {json.dumps(epoch)}", file=sys.stderr, flush=True)
        rows.append(Row("gpu", f"steps.train epoch img/s, {label}, {where}", "img/s",
                        epoch["img_per_s"], NVIDIA_A100_AMP_IMG_S,
                        f"NVIDIA's published figure ({NVIDIA_CARD})"))
    layouts = layout_ab(settings, device, rounds=1 if settings.smoke else 2)
    details["layout_ab"] = layouts
    rows += [Row("gpu", f"channels_last img/s {what}, batch {settings.gpu_batch}, {name}",
                 "img/s", layouts["channels_last"][what.replace(" ", "_")],
                 layouts["contiguous"][what.replace(" ", "_")],
                 "the contiguous layout (steps.devices.CUDA_CHANNELS_LAST off)")
             for what in ("compute only", "end to end")]
    for part in (trainstep.gpu_rows, loader.device_rows):
        part_rows, part_details = part(settings, device, name)
        rows += part_rows
        details[part.__module__.rsplit(".", 1)[-1]] = part_details
        print(f"gpu: {part.__module__}: {json.dumps(part_details)}", file=sys.stderr, flush=True)
    details["wait_target_share"] = 0.05
    return {"rows": rows, "details": details}
