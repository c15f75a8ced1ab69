"""2D training batches from the memory-mapped ``dataset`` artifact, and on-device augmentation.

Stateless sampling: batch ``step`` of rank ``rank`` is a pure function of
``(seed, step, rank)``. Resuming therefore needs only the global step, and the batches do not
depend on the number of DataLoader workers or on which worker builds them.

Each batch holds ``batch`` slices of shape (C, H, W) drawn from several volumes (each slice
picks its own training case). With probability ``foreground_p`` (the anchors' 0.33) the
(H, W) patch is centred on a random foreground voxel of a random foreground slice; otherwise
slice and patch offset are uniform. Cases smaller than the patch are padded (image with its
per-channel minimum, label with background), larger ones are cropped. The anchors' flips
(p 0.33 along each in-plane axis) happen here, while the patch is copied out of the memory
map: a flipped read costs next to nothing, and flips commute with the rest.

:func:`augment` applies the anchors' other augmentations with torch ops on whatever device
the batch is on, drawing every random number from generators seeded by the same triple.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from steps.dataset import Case, torch_view
from steps.devices import host_to_device

FOREGROUND_P = 0.33
FLIP_P = 0.33                # each of the two in-plane axes


@dataclass(frozen=True)
class Augmentation:
    """What :func:`augment` does to each sample, in this order (MONAI's nearest transform in
    brackets). Every ``*_p`` is a per-sample probability in [0, 1]; every range is
    ``(low, high)`` with ``low <= high``, and each picked sample draws its own magnitude
    uniformly from it. The defaults are the anchors' (nnU-Net's 2-D BraTS recipe).

    - ``zoom_p``, ``zoom_range``: zoom in by 1/scale, scale in (0, 1]: images bilinear, labels
      nearest, so the (H, W) shape is kept [RandZoom].
    - ``noise_p``, ``noise_std_range``: add Gaussian noise with this std, >= 0
      [RandGaussianNoise].
    - ``blur_p``, ``blur_sigma_range``: Gaussian blur in H and W, sigma > 0 in pixels
      [RandGaussianSmooth].
    - ``brightness_p``, ``brightness_range``: multiply by a factor > 0
      [RandScaleIntensity].
    - ``contrast_p``, ``contrast_range``: multiply by a factor > 0, then clamp to the
      sample's own range before (nnU-Net's contrast augmentation with its range preserved;
      MONAI's RandAdjustContrast applies a gamma instead).
    """
    zoom_p: float = 0.15
    zoom_range: tuple[float, float] = (0.7, 1.0)
    noise_p: float = 0.15
    noise_std_range: tuple[float, float] = (0.0, 0.33)
    blur_p: float = 0.15
    blur_sigma_range: tuple[float, float] = (0.5, 1.5)
    brightness_p: float = 0.15
    brightness_range: tuple[float, float] = (0.7, 1.3)
    contrast_p: float = 0.15
    contrast_range: tuple[float, float] = (0.65, 1.5)

    def __post_init__(self):
        # (the lowest value each range may take, and whether it may take it)
        floors = {"zoom_range": (0.0, False), "noise_std_range": (0.0, True),
                  "blur_sigma_range": (0.0, False), "brightness_range": (0.0, False),
                  "contrast_range": (0.0, False)}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_p"):
                if not 0.0 <= value <= 1.0:
                    raise ValueError(f"augmentation {f.name}={value} is not in [0, 1]")
                continue
            low, high = value
            floor, inclusive = floors[f.name]
            if not (low <= high and (low >= floor if inclusive else low > floor)):
                raise ValueError(f"augmentation {f.name}={value} is not a range (low, high) "
                                 f"with {floor} {'<=' if inclusive else '<'} low <= high")
        if self.zoom_range[1] > 1.0:
            raise ValueError(f"augmentation zoom_range={self.zoom_range}: a scale above 1 "
                             "would zoom out")


ANCHORS = Augmentation()


def batch_seed(seed: int, step: int, rank: int) -> np.random.SeedSequence:
    return np.random.SeedSequence([seed, step, rank])


def torch_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit torch seed derived from the same triple (for augmentation generators)."""
    return int(batch_seed(seed, step, rank).generate_state(2, dtype=np.uint32)
               .astype(np.uint64) @ np.array([1 << 31, 1], dtype=np.uint64))


def pad_crop_2d(array: torch.Tensor, top: int, left: int, size: tuple[int, int],
                fill: torch.Tensor | float, out: torch.Tensor,
                flips: Sequence[int] = ()) -> torch.Tensor:
    """Writes window ``[top:top+h, left:left+w]`` of ``array``'s last two axes into ``out``,
    flipped along ``flips`` (any of -1, -2).

    ``array`` is (..., H, W) and ``out`` (..., h, w), of any dtypes (the copy converts); cells of
    the window outside ``array`` get ``fill``, which broadcasts against (..., 1, 1).
    """
    h, w = size
    height, width = array.shape[-2:]
    y0, x0 = max(top, 0), max(left, 0)
    y1, x1 = min(top + h, height), min(left + w, width)
    if y0 > top or x0 > left or y1 < top + h or x1 < left + w:
        out[...] = fill
    if y1 > y0 and x1 > x0:
        out[..., y0 - top:y1 - top, x0 - left:x1 - left] = array[..., y0:y1, x0:x1]
    if flips:   # flipping the copy is 3x faster than a flipped read of the memory map
        out.copy_(out.flip(list(flips)))
    return out


def _offset(rng: np.random.Generator, extent: int, size: int, centre: int | None) -> int:
    """Top-left offset of a ``size`` window over ``extent`` (centred on ``centre`` if given)."""
    if extent <= size:
        return -((size - extent) // 2) if centre is None else \
            min(max(centre - size // 2, extent - size), 0)
    if centre is None:
        return int(rng.integers(0, extent - size + 1))
    return min(max(centre - size // 2, 0), extent - size)


def _foreground_voxel(rng: np.random.Generator, labels: np.ndarray, tries: int = 128) -> int:
    """A uniformly random index of a non-zero entry of ``labels`` (1D, at least one).

    Rejection sampling: the first foreground hit among ``tries`` uniform draws is uniform over
    the foreground, and listing the foreground (the exact fallback) costs 5x more.
    """
    draws = rng.integers(labels.size, size=tries)
    hits = draws[labels[draws] != 0]
    if hits.size:
        return int(hits[0])
    voxels = np.flatnonzero(labels)
    return int(voxels[rng.integers(voxels.size)])


class SliceSampler:
    """Builds batch ``step`` for ``rank``: images (B, C, H, W) float32, labels (B, H, W)
    uint8 (the label classes fit a byte; the device widens them, so a batch crosses the
    worker pipe and the bus with an eighth of the label bytes)."""

    def __init__(self, cases: list[Case], patch_size: tuple[int, int], batch: int, seed: int,
                 foreground_p: float = FOREGROUND_P):
        if not cases:
            raise ValueError("no training cases")
        self.cases = cases
        self.patch_size = (int(patch_size[0]), int(patch_size[1]))
        self.batch = batch
        self.seed = seed
        self.foreground_p = foreground_p
        self.label_arrays = [np.asarray(c.label) for c in cases]      # (D, H, W) each
        # Slices that contain any foreground, per case: one pass over each label volume.
        self.fg_slices = [np.flatnonzero(labels.reshape(labels.shape[0], -1).any(axis=1))
                          for labels in self.label_arrays]
        self.images = [torch_view(c.image) for c in cases]            # (C, D, H, W) each
        self.labels = [torch_view(c.label) for c in cases]            # (D, H, W) each

    @property
    def n_slices(self) -> int:
        return sum(int(c.label.shape[0]) for c in self.cases)

    def _fill(self, rng: np.random.Generator, image_out: torch.Tensor, label_out: torch.Tensor):
        """Draws one slice and writes its patch into image_out (C, h, w) and label_out (h, w)."""
        case_index = int(rng.integers(len(self.cases)))
        labels, fg = self.label_arrays[case_index], self.fg_slices[case_index]
        depth, height, width = labels.shape
        centre = None
        if fg.size and rng.random() < self.foreground_p:
            z = int(fg[rng.integers(fg.size)])
            centre = divmod(_foreground_voxel(rng, labels[z].reshape(-1)), width)
        else:
            z = int(rng.integers(depth))
        top = _offset(rng, height, self.patch_size[0], None if centre is None else centre[0])
        left = _offset(rng, width, self.patch_size[1], None if centre is None else centre[1])
        flips = [dim for dim in (-1, -2) if rng.random() < FLIP_P]
        image = self.images[case_index][:, z]                             # (C, H, W)
        fill = image.flatten(1).amin(dim=1)[:, None, None] if (
            top < 0 or left < 0 or top + self.patch_size[0] > height
            or left + self.patch_size[1] > width) else 0.0
        pad_crop_2d(image, top, left, self.patch_size, fill, image_out, flips)
        pad_crop_2d(self.labels[case_index][z], top, left, self.patch_size, 0, label_out, flips)

    def __call__(self, step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng(batch_seed(self.seed, step, rank))
        channels = self.images[0].shape[0]
        # numpy allocations: glibc hands back the previous batch's pages, torch.empty faults anew.
        images = torch.from_numpy(np.empty((self.batch, channels) + self.patch_size, np.float32))
        labels = torch.from_numpy(np.empty((self.batch,) + self.patch_size, np.uint8))
        for i in range(self.batch):
            self._fill(rng, images[i], labels[i])
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


_GRIDS: dict[tuple, torch.Tensor] = {}


def _base_grid(h: int, w: int, device, dtype) -> torch.Tensor:
    """Pixel centres of an (h, w) image in grid_sample's [-1, 1] coordinates
    (align_corners=False): (H, W, 2) as (x, y)."""
    key = (h, w, str(device), dtype)
    if key not in _GRIDS:
        ys = (torch.arange(h, device=device, dtype=dtype) * 2 + 1) / h - 1
        xs = (torch.arange(w, device=device, dtype=dtype) * 2 + 1) / w - 1
        _GRIDS[key] = torch.stack(torch.broadcast_tensors(xs[None, :], ys[:, None]), dim=-1)
    return _GRIDS[key]


def _zoom(images: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor):
    """Zoom in by ``1/scale`` (N,) about the centre: bilinear for images, nearest for labels."""
    n, _, h, w = images.shape
    grid = _base_grid(h, w, images.device, images.dtype)[None] * \
        host_to_device(scale, images.device, images.dtype).view(n, 1, 1, 1)
    images = F.grid_sample(images, grid, mode="bilinear", padding_mode="border",
                           align_corners=False)
    labels = F.grid_sample(labels[:, None].to(images.dtype), grid, mode="nearest",
                           padding_mode="border", align_corners=False)
    return images, labels[:, 0].round().long()


def _gaussian_kernel(sigma: float) -> list[float]:
    """The normalised 1D Gaussian of ``sigma`` pixels, truncated at 3 sigma: 2r + 1 taps."""
    radius = math.ceil(3 * sigma)
    weights = [math.exp(-0.5 * (j / sigma) ** 2) for j in range(-radius, radius + 1)]
    return [weight / sum(weights) for weight in weights]


def _gaussian_blur(images: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of images (N, C, H, W), truncated at 3 ``sigma``.

    Each pass is a weighted sum of shifted views with scalar weights: on a CPU about 5×
    faster than a grouped conv2d.
    """
    h, w = images.shape[-2:]
    kernel = _gaussian_kernel(sigma)
    radius = len(kernel) // 2
    mode = "reflect" if min(h, w) > radius else "replicate"
    padded = F.pad(images, (radius,) * 4, mode=mode)                   # (N, C, H+2r, W+2r)
    return _shifted_sum(_shifted_sum(padded, kernel, w, dim=3), kernel, h, dim=2)


def _gaussian_blur_batched(images: torch.Tensor, sigmas: list[float]) -> torch.Tensor:
    """:func:`_gaussian_blur` of each image (N, C, H, W) with its own sigma, in two grouped
    convolutions: on a GPU two kernels in place of 4r + 2 per image (the launches, not the
    arithmetic, were its cost). Each image's kernel is zero-padded to the widest radius R;
    reflecting R pixels gives every tap within an image's own radius the pixel that
    reflecting its own radius would (same values, another summation order)."""
    n, c, h, w = images.shape
    kernels = [_gaussian_kernel(sigma) for sigma in sigmas]
    radius = max(len(k) for k in kernels) // 2
    taps = torch.zeros(n, 2 * radius + 1, dtype=images.dtype)
    for i, kernel in enumerate(kernels):
        start = radius - len(kernel) // 2
        taps[i, start:start + len(kernel)] = torch.tensor(kernel, dtype=images.dtype)
    taps = host_to_device(taps, images.device).repeat_interleave(c, dim=0)   # (N*C, 2R+1)
    padded = F.pad(images, (radius,) * 4, mode="reflect").reshape(1, n * c, h + 2 * radius,
                                                                 w + 2 * radius)
    rows = F.conv2d(padded, taps[:, None, None, :], groups=n * c)        # (1, N*C, H+2R, W)
    return F.conv2d(rows, taps[:, None, :, None], groups=n * c).reshape(n, c, h, w)


def _shifted_sum(x: torch.Tensor, kernel: list[float], length: int, dim: int) -> torch.Tensor:
    """sum_j kernel[j] * x.narrow(dim, j, length): a 1D correlation along ``dim``."""
    out = x.narrow(dim, 0, length) * kernel[0]
    for j in range(1, len(kernel)):
        out.add_(x.narrow(dim, j, length), alpha=kernel[j])
    return out


def augment(images: torch.Tensor, labels: torch.Tensor, seed: int,
            noise_generator: torch.Generator | None = None, inplace: bool = False,
            spec: Augmentation = ANCHORS):
    """The augmentations other than the flips (see :class:`SliceSampler`): zoom, noise,
    blur, brightness and contrast, per sample, on ``images``' device, as ``spec`` says (by
    default the anchors', which give the same batches bit for bit as before it existed).

    images (N, C, H, W) float, labels (N, H, W) int64 → tensors of the same shapes (the inputs
    themselves when ``inplace``). Per-sample decisions and magnitudes come from a CPU generator
    seeded with ``seed``; the noise comes from ``noise_generator`` (a device generator) or,
    when None, the CPU one. Decisions stay on the host, so nothing waits for the device, and
    each transform touches only the samples it picked: at p 0.15 that is a sixth of the batch.
    """
    gen = torch.Generator().manual_seed(seed)
    n, device = images.shape[0], images.device
    if not inplace:
        images, labels = images.clone(), labels.clone()

    def picked(p: float) -> list[int]:
        return torch.nonzero(_chance(gen, n, p)).flatten().tolist()

    zoom, scale = picked(spec.zoom_p), _uniform(gen, n, *spec.zoom_range)
    if zoom:
        rows = host_to_device(torch.tensor(zoom), device)
        zoomed, zoomed_labels = _zoom(images.index_select(0, rows),
                                      labels.index_select(0, rows), scale[zoom])
        images.index_copy_(0, rows, zoomed)
        labels.index_copy_(0, rows, zoomed_labels.to(labels.dtype))
    noisy, std = picked(spec.noise_p), _uniform(gen, n, *spec.noise_std_range)
    if noisy:
        shape = (len(noisy),) + tuple(images.shape[1:])
        noise = host_to_device(torch.empty(shape).normal_(generator=gen), device) \
            if noise_generator is None \
            else torch.empty(shape, device=device).normal_(generator=noise_generator)
        for i, sample_noise in zip(noisy, noise.to(images.dtype)):
            images[i].add_(sample_noise, alpha=float(std[i]))
    blurred, sigma = picked(spec.blur_p), _uniform(gen, n, *spec.blur_sigma_range)
    if blurred and device.type != "cpu" and min(images.shape[-2:]) > 3 * max(
            float(sigma[i]) for i in blurred):
        rows = host_to_device(torch.tensor(blurred), device)
        images.index_copy_(0, rows, _gaussian_blur_batched(
            images.index_select(0, rows), [float(sigma[i]) for i in blurred]))
    else:
        for i in blurred:       # one at a time: each gets the kernel width of its own sigma
            images[i] = _gaussian_blur(images[i:i + 1], float(sigma[i]))[0]
    bright, factor = picked(spec.brightness_p), _uniform(gen, n, *spec.brightness_range)
    if bright:
        rows, scale = _picked_rows(bright, factor, images)
        images.index_copy_(0, rows, images.index_select(0, rows) * scale)
    contrast, factor = picked(spec.contrast_p), _uniform(gen, n, *spec.contrast_range)
    if contrast:        # scaled, then clamped to the sample's own range before
        rows, scale = _picked_rows(contrast, factor, images)
        chosen = images.index_select(0, rows)
        low = chosen.amin(dim=(1, 2, 3), keepdim=True)
        high = chosen.amax(dim=(1, 2, 3), keepdim=True)
        images.index_copy_(0, rows, torch.minimum(torch.maximum(chosen * scale, low), high))
    return images, labels


def _picked_rows(picked: list[int], values: torch.Tensor, images: torch.Tensor):
    """(the picked rows as an index on ``images``' device, their ``values`` shaped
    (k, 1, 1, 1) in ``images``' dtype there): a whole transform in a few kernels."""
    rows = host_to_device(torch.tensor(picked), images.device)
    return rows, host_to_device(values[picked], images.device, images.dtype).view(-1, 1, 1, 1)
