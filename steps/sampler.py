"""2D training batches from the memory-mapped ``dataset`` artifact, and on-device augmentation.

Stateless sampling: batch ``step`` of rank ``rank`` is a pure function of
``(seed, step, rank)``. Resuming therefore needs only the global step, and the batches do not
depend on the number of DataLoader workers or on which worker builds them.

Each batch holds ``batch`` slices of shape (C, H, W) drawn from several volumes (each slice
picks its own training case). With probability ``foreground_p`` (the anchors' 0.33) the
(H, W) patch is centred on a random foreground voxel of a random foreground slice; otherwise
slice and patch offset are uniform. Cases smaller than the patch are padded (image with its
per-channel minimum, label with background), larger ones are cropped.

:func:`augment` applies the anchors' augmentations with torch ops on whatever device the
batch is on, drawing every random number from generators seeded by the same triple.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from steps.dataset import Case

FOREGROUND_P = 0.33


def batch_seed(seed: int, step: int, rank: int) -> np.random.SeedSequence:
    return np.random.SeedSequence([seed, step, rank])


def torch_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit torch seed derived from the same triple (for augmentation generators)."""
    return int(batch_seed(seed, step, rank).generate_state(2, dtype=np.uint32)
               .astype(np.uint64) @ np.array([1 << 31, 1], dtype=np.uint64))


def pad_crop_2d(array: np.ndarray, top: int, left: int, size: tuple[int, int],
                fill: np.ndarray | float) -> np.ndarray:
    """Window ``[top:top+h, left:left+w]`` of the last two axes; outside cells get ``fill``.

    ``array`` is (..., H, W); ``fill`` broadcasts against (..., 1, 1). Returns (..., h, w).
    """
    h, w = size
    height, width = array.shape[-2:]
    out = np.empty(array.shape[:-2] + (h, w), dtype=array.dtype)
    out[...] = fill
    y0, x0 = max(top, 0), max(left, 0)
    y1, x1 = min(top + h, height), min(left + w, width)
    if y1 > y0 and x1 > x0:
        out[..., y0 - top:y1 - top, x0 - left:x1 - left] = array[..., y0:y1, x0:x1]
    return out


def _offset(rng: np.random.Generator, extent: int, size: int, centre: int | None) -> int:
    """Top-left offset of a ``size`` window over ``extent`` (centred on ``centre`` if given)."""
    if extent <= size:
        return -((size - extent) // 2) if centre is None else \
            int(np.clip(centre - size // 2, extent - size, 0))
    if centre is None:
        return int(rng.integers(0, extent - size + 1))
    return int(np.clip(centre - size // 2, 0, extent - size))


class SliceSampler:
    """Builds batch ``step`` for ``rank``: images (B, C, H, W) float32, labels (B, H, W) int64."""

    def __init__(self, cases: list[Case], patch_size: tuple[int, int], batch: int, seed: int,
                 foreground_p: float = FOREGROUND_P):
        if not cases:
            raise ValueError("no training cases")
        self.cases = cases
        self.patch_size = (int(patch_size[0]), int(patch_size[1]))
        self.batch = batch
        self.seed = seed
        self.foreground_p = foreground_p
        # Slices that contain any foreground, per case: one pass over each label volume.
        self.fg_slices = [np.flatnonzero(np.asarray(c.label).reshape(c.label.shape[0], -1)
                                         .any(axis=1)) for c in cases]

    @property
    def n_slices(self) -> int:
        return sum(int(c.label.shape[0]) for c in self.cases)

    def _slice(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        case_index = int(rng.integers(len(self.cases)))
        case, fg = self.cases[case_index], self.fg_slices[case_index]
        depth, height, width = case.label.shape
        centre = None
        if fg.size and rng.random() < self.foreground_p:
            z = int(fg[rng.integers(fg.size)])
            ys, xs = np.nonzero(case.label[z])
            pick = int(rng.integers(ys.size))
            centre = (int(ys[pick]), int(xs[pick]))
        else:
            z = int(rng.integers(depth))
        top = _offset(rng, height, self.patch_size[0], None if centre is None else centre[0])
        left = _offset(rng, width, self.patch_size[1], None if centre is None else centre[1])
        image = np.asarray(case.image[:, z], dtype=np.float32)          # (C, H, W)
        fill = image.reshape(image.shape[0], -1).min(axis=1)[:, None, None]
        return (pad_crop_2d(image, top, left, self.patch_size, fill),
                pad_crop_2d(np.asarray(case.label[z]), top, left, self.patch_size, 0))

    def __call__(self, step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng(batch_seed(self.seed, step, rank))
        pairs = [self._slice(rng) for _ in range(self.batch)]
        images = torch.from_numpy(np.stack([p[0] for p in pairs]))
        labels = torch.from_numpy(np.stack([p[1] for p in pairs]).astype(np.int64))
        return images, labels


class StepDataset(torch.utils.data.Dataset):
    """Item ``i`` is the whole batch of global step ``first_step + i`` for ``rank``.

    Used with ``DataLoader(batch_size=None)`` so workers build whole batches in parallel.
    """

    def __init__(self, sampler: SliceSampler, first_step: int, n_steps: int, rank: int):
        self.sampler, self.first_step, self.n_steps, self.rank = sampler, first_step, n_steps, rank

    def __len__(self) -> int:
        return self.n_steps

    def __getitem__(self, index: int):
        return self.sampler(self.first_step + index, self.rank)


# ---------------------------------------------------------------- on-device augmentation

def _chance(gen: torch.Generator, n: int, p: float) -> torch.Tensor:
    return torch.rand(n, generator=gen) < p


def _uniform(gen: torch.Generator, n: int, low: float, high: float) -> torch.Tensor:
    return low + (high - low) * torch.rand(n, generator=gen)


def _zoom(images: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor):
    """Zoom in by ``1/scale`` about the centre: bilinear for images, nearest for labels."""
    n = images.shape[0]
    theta = torch.zeros(n, 2, 3, device=images.device)
    theta[:, 0, 0] = scale.to(images.device)
    theta[:, 1, 1] = scale.to(images.device)
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    images = F.grid_sample(images, grid.to(images.dtype), mode="bilinear",
                           padding_mode="border", align_corners=False)
    labels = F.grid_sample(labels[:, None].to(images.dtype), grid.to(images.dtype),
                           mode="nearest", padding_mode="border", align_corners=False)
    return images, labels[:, 0].round().long()


def _gaussian_blur(images: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Separable Gaussian blur with a per-sample ``sigma`` (N,); images (N, C, H, W)."""
    n, c, h, w = images.shape
    radius = math.ceil(3 * float(sigma.max()))
    offsets = torch.arange(-radius, radius + 1, dtype=images.dtype, device=images.device)
    sigma = sigma.to(images.device, images.dtype)
    kernel = torch.exp(-0.5 * (offsets[None] / sigma[:, None]) ** 2)
    kernel = kernel / kernel.sum(dim=1, keepdim=True)                  # (N, K)
    kernel = kernel.repeat_interleave(c, dim=0)                          # (N*C, K)
    flat = images.reshape(1, n * c, h, w)
    flat = F.pad(flat, (radius, radius, radius, radius), mode="reflect") \
        if min(h, w) > radius else F.pad(flat, (radius,) * 4, mode="replicate")
    flat = F.conv2d(flat, kernel[:, None, :, None], groups=n * c)
    flat = F.conv2d(flat, kernel[:, None, None, :], groups=n * c)
    return flat.reshape(n, c, h, w)


def augment(images: torch.Tensor, labels: torch.Tensor, seed: int,
            noise_generator: torch.Generator | None = None):
    """The anchors' augmentations, per sample, on ``images``' device.

    images (N, C, H, W) float, labels (N, H, W) int64 → new tensors of the same shapes.
    Per-sample decisions and magnitudes come from a CPU generator seeded with ``seed``; the
    noise comes from ``noise_generator`` (a device generator) or, when None, the CPU one.
    Each transform runs only on the samples it picked: at p 0.15 that is a sixth of the work.
    """
    gen = torch.Generator().manual_seed(seed)
    n, device = images.shape[0], images.device
    images, labels = images.clone(), labels.clone()

    def pick(p: float) -> torch.Tensor:
        return _chance(gen, n, p).to(device)

    zoom, scale = pick(0.15), _uniform(gen, n, 0.7, 1.0)
    if zoom.any():
        images[zoom], labels[zoom] = _zoom(images[zoom], labels[zoom], scale[zoom.cpu()])
    for dim in (-1, -2):
        flip = pick(0.33)
        images[flip], labels[flip] = images[flip].flip(dim), labels[flip].flip(dim)
    noisy, std = pick(0.15), _uniform(gen, n, 0.0, 0.33)
    if noisy.any():
        shape = (int(noisy.sum()),) + tuple(images.shape[1:])
        noise = torch.randn(shape, generator=gen).to(device) if noise_generator is None else \
            torch.randn(shape, generator=noise_generator, device=device)
        images[noisy] += noise * std[noisy.cpu()].to(device, images.dtype).view(-1, 1, 1, 1)
    blurred, sigma = pick(0.15), _uniform(gen, n, 0.5, 1.5)
    if blurred.any():
        images[blurred] = _gaussian_blur(images[blurred], sigma[blurred.cpu()])
    bright, factor = pick(0.15), _uniform(gen, n, 0.7, 1.3)
    if bright.any():
        images[bright] *= factor[bright.cpu()].to(device, images.dtype).view(-1, 1, 1, 1)
    contrast, factor = pick(0.15), _uniform(gen, n, 0.65, 1.5)
    if contrast.any():
        chosen = images[contrast]
        low = chosen.amin(dim=(1, 2, 3), keepdim=True)
        high = chosen.amax(dim=(1, 2, 3), keepdim=True)
        images[contrast] = torch.clamp(
            chosen * factor[contrast.cpu()].to(device, images.dtype).view(-1, 1, 1, 1), low, high)
    return images, labels
