"""2. Loader, one core: our batch sampler + full augmentation vs a MONAI-transform pipeline.

Baseline: per slice, a random slice of a random case from the anchors' float32 layout,
``SpatialPadd`` + ``RandCropByPosNegLabeld`` (pos 0.33, neg 0.67), then MONAI's
``RandZoomd`` (p 0.15, zoom in 1–1/0.7), ``RandFlipd`` on each axis (p 0.33),
``RandGaussianNoised`` (p 0.15, std up to 0.33), ``RandGaussianSmoothd`` (p 0.15, σ 0.5–1.5),
``RandScaleIntensityd`` (p 0.15, ×0.7–1.3), and the DALI-style contrast (p 0.15, ×0.65–1.5
clamped to the slice's range) as a small MONAI ``RandomizableTransform``; slices are stacked
into a batch.
"""
from __future__ import annotations

import time
import warnings

from monai.data import set_track_meta
from monai.transforms import (Compose, MapTransform, RandCropByPosNegLabeld, RandFlipd,
                              RandGaussianNoised, RandGaussianSmoothd, RandomizableTransform,
                              RandScaleIntensityd, RandZoomd, SpatialPadd)
import numpy as np
import torch

from benchmarks.common import Row, Settings, dataset_dir, in_child, step_env
from steps import devices
from steps.dataset import open_cases, read_metadata
from steps.sampler import SliceSampler, augment, torch_seed


def _contrast_transform():

    class RandContrastClampd(RandomizableTransform, MapTransform):
        def __init__(self, keys, prob: float, low: float, high: float):
            MapTransform.__init__(self, keys)
            RandomizableTransform.__init__(self, prob)
            self.low, self.high, self.factor = low, high, 1.0

        def randomize(self, data=None):
            super().randomize(None)
            self.factor = self.R.uniform(self.low, self.high)

        def __call__(self, data):
            self.randomize()
            if not self._do_transform:
                return data
            d = dict(data)
            for key in self.keys:
                x = d[key]
                d[key] = (x * self.factor).clamp(x.min(), x.max())
            return d

    return RandContrastClampd


def monai_pipeline(patch: tuple[int, int], seed: int):
    keys = ["image", "label"]
    pipeline = Compose([
        SpatialPadd(keys, spatial_size=patch),
        RandCropByPosNegLabeld(keys, label_key="label", spatial_size=patch, pos=0.33,
                               neg=0.67, num_samples=1),
        RandZoomd(keys, prob=0.15, min_zoom=1.0, max_zoom=1 / 0.7, mode=("bilinear", "nearest")),
        RandFlipd(keys, prob=0.33, spatial_axis=0),
        RandFlipd(keys, prob=0.33, spatial_axis=1),
        RandGaussianNoised(["image"], prob=0.15, mean=0.0, std=0.33),
        RandGaussianSmoothd(["image"], prob=0.15, sigma_x=(0.5, 1.5), sigma_y=(0.5, 1.5)),
        RandScaleIntensityd(["image"], prob=0.15, factors=0.3),
        _contrast_transform()(["image"], prob=0.15, low=0.65, high=1.5),
    ])
    pipeline.set_random_state(seed)
    return pipeline


def _mapped(dataset) -> list:
    """The cases, memory-mapped and every page touched once: both sides start as a training
    run does after its first pass over the data, not with first-touch page faults."""

    cases = open_cases(dataset, read_metadata(dataset, check_hashes=False))
    for case in cases:
        np.asarray(case.image).max(), np.asarray(case.label).max()
    return cases


def run_monai(dataset, patch, batch: int, batches: int, track_meta: bool = True) -> float:
    """Slices per second of the MONAI pipeline (after one warm-up batch); ``track_meta=False``
    is MONAI's switch from MetaTensor to plain tensors (its default is True)."""

    warnings.filterwarnings("ignore")
    set_track_meta(track_meta)
    cases = _mapped(dataset)
    pipeline = monai_pipeline(patch, 0)
    rng = np.random.default_rng(0)

    def one_batch():
        images, labels = [], []
        for _ in range(batch):
            case = cases[int(rng.integers(len(cases)))]
            z = int(rng.integers(case.label.shape[0]))
            item = {"image": np.asarray(case.image[:, z], dtype=np.float32),
                    "label": np.asarray(case.label[z])[np.newaxis]}
            out = pipeline(item)[0]
            images.append(torch.as_tensor(out["image"]))
            labels.append(torch.as_tensor(out["label"]))
        return torch.stack(images), torch.stack(labels)

    try:
        one_batch()
        start = time.perf_counter()
        for _ in range(batches):
            one_batch()
        return batches * batch / (time.perf_counter() - start)
    finally:
        set_track_meta(True)    # a process-wide switch; --smoke runs the next benchmark here


def run_ours(dataset, patch, batch: int, batches: int, on_device: bool = False) -> float:
    """Slices per second of SliceSampler + augment, or of the sampler alone when
    ``on_device`` (what the CPU does when steps.train augments on a GPU or HPU)."""

    sampler = SliceSampler(_mapped(dataset), patch, batch, seed=0)

    def one_batch(step: int):
        images, labels = sampler(step)
        if not on_device:
            augment(images, labels, torch_seed(0, step, 0), inplace=True)

    one_batch(0)
    start = time.perf_counter()
    for step in range(1, batches + 1):
        one_batch(step)
    return batches * batch / (time.perf_counter() - start)


def run_on_device(dataset, patch, batch: int, batches: int, device: str) -> dict[str, float]:
    """Slices per second with augmentation on ``device``, as steps.train runs it there:
    ``augment_only`` re-augments one batch already on the device; ``with_host_sampling``
    adds SliceSampler on one host core and the copy. Timed to a device synchronisation."""

    info = devices.select_device(device, "fp32")
    sampler = SliceSampler(_mapped(dataset), patch, batch, seed=0)

    def on_device(step: int, images, labels):
        seed = torch_seed(0, step, 0)
        augment(devices.to_device(images, info),
                devices.host_to_device(labels, info.device, torch.long),
                seed, devices.device_generator(info, seed), inplace=True)

    def rate(one_batch) -> float:
        one_batch(0)
        devices.synchronize(info)
        start = time.perf_counter()
        for step in range(1, batches + 1):
            one_batch(step)
        devices.synchronize(info)
        return batches * batch / (time.perf_counter() - start)

    images, labels = (t.to(info.device) for t in sampler(0))
    return {"augment_only": rate(lambda step: on_device(step, images.clone(), labels.clone())),
            "with_host_sampling": rate(lambda step: on_device(step, *sampler(step)))}


def device_rows(settings: Settings, device: str, name: str) -> tuple[list[Row], dict]:
    """Augmentation on ``device`` at the GPU batch, against one round of the MONAI pipeline
    on one core (benchmark ``gpu`` calls this)."""
    ours_ds, anchor_ds = dataset_dir(settings, "default"), dataset_dir(settings, "anchor")
    baseline, _ = in_child(run_monai, anchor_ds, settings.patch, settings.batch,
                           max(1, settings.loader_batches // settings.loader_rounds), threads=1)
    rates, _ = in_child(run_on_device, ours_ds, settings.patch, settings.gpu_batch,
                        settings.loader_batches, device, threads=1, env=step_env())
    return ([Row("loader", f"augmentation on {name}, batch {settings.gpu_batch}", "slice/s",
                 rates["augment_only"], baseline, "MONAI transform pipeline (one CPU core)"),
             Row("loader", f"host sampling (one core) + augmentation on {name}", "slice/s",
                 rates["with_host_sampling"], baseline,
                 "MONAI transform pipeline (one CPU core)")],
            {"device_slices_per_s": rates, "monai_slices_per_s": baseline})


def run(settings: Settings) -> dict:
    ours_ds, anchor_ds = dataset_dir(settings, "default"), dataset_dir(settings, "anchor")
    patch, batch, batches = settings.patch, settings.batch, settings.loader_batches
    env = step_env()
    # Alternating rounds (baseline, ours, ...), so drift in machine speed hits both sides;
    # the baseline's batches are split over the rounds, each round a fresh process.
    rounds = {"baseline": [], "ours": []}
    for _ in range(settings.loader_rounds):
        rounds["baseline"].append(in_child(run_monai, anchor_ds, patch, batch,
                                           max(1, batches // settings.loader_rounds),
                                           threads=1)[0])
        rounds["ours"].append(in_child(run_ours, ours_ds, patch, batch, batches, threads=1,
                                       env=env)[0])
    baseline, ours = (float(np.median(rounds[k])) for k in ("baseline", "ours"))
    args = (patch, batch, batches)
    plain_tensors, _ = in_child(run_monai, anchor_ds, *args, False, threads=1)
    sampling_only, _ = in_child(run_ours, ours_ds, *args, True, threads=1, env=env)
    return {"rows": [Row("loader", "slices/s per core (sample + full augmentation)", "slice/s",
                         ours, baseline, "MONAI transform pipeline", ">= 10"),
                     Row("loader", "the same, MONAI without MetaTensor tracking", "slice/s",
                         ours, plain_tensors, "MONAI pipeline, set_track_meta(False)"),
                     Row("loader", "CPU side of GPU/HPU training (augmentation on the device)",
                         "slice/s", sampling_only, baseline, "MONAI transform pipeline")],
            "details": {"ours_env": env, "batch": settings.batch,
                        "batches": settings.loader_batches,
                        "slices_per_s_by_round": rounds,
                        "patch": list(settings.patch), "threads": 1,
                        "ours_reads": "default-mode float16 dataset (whole in-plane extent)",
                        "baseline_reads": "anchor-mode float32 dataset (192x160)",
                        "device_side_note": "steps.train runs augment on the training device "
                                            "(GPU/HPU) after the copy; the CPU then only "
                                            "samples; its rate there is benchmark 11 "
                                            "(gpu)"}}
