"""Loss and metric of the anchors: Dice + cross-entropy with deep supervision; per-class Dice.

Loss: soft Dice (no background, softmax, one-hot target, ``batch=True``) + cross-entropy,
MONAI's ``DiceCELoss``. With deep supervision the heads are weighted 1, 0.5, 0.25, … and the
weights are normalised to sum to 1, so the loss stays on the scale of a single head.

Deep-supervision targets: MONAI's DynUNet returns the lower-resolution heads already
upsampled to the full (H, W) in training, as ``(N, 1 + heads, C, H, W)``. We compare every
head with the full-resolution label. This is what NVIDIA's nnUNet does with that same DynUNet
(its label interpolation to each head's size is an identity at full size), so it needs no
second label pyramid; the alternative, nearest-neighbour downsampled labels against
downsampled heads, would need the heads before DynUNet's upsampling, which it does not expose.

Metric (the anchors'): per volume, per class 1..C-1, Dice of the argmax prediction; a class
absent from both target and prediction scores 1, absent from the target only 0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SMOOTH = 1e-5   # MONAI DiceLoss's smooth_nr and smooth_dr defaults


class DeepSupervisionLoss(torch.nn.Module):
    """``forward(logits, labels)``: logits (N, C, H, W) or (N, 1 + heads, C, H, W), labels
    (N, H, W) int64 → the weighted mean over heads of Dice + CE, a scalar float32.

    Per head it is MONAI's ``DiceCELoss(include_background=False, to_onehot_y=True,
    softmax=True, batch=True)`` (``tests/test_train_units.py`` holds it to MONAI's to 1e-6),
    written with tensor operations alone and for every head at once: torch.compile makes it
    one graph of a few fused kernels (MONAI's builds its reduction axes with ``.tolist()``, a
    graph break per head) and eager runs a third of the kernels.
    """

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if logits.dim() == 4:
            logits = logits[:, None]
        heads, classes = logits.shape[1], logits.shape[2]
        log_p = torch.log_softmax(logits.float(), dim=2)                  # (N, K, C, H, W)
        index = labels[:, None, None].expand(-1, heads, 1, -1, -1)         # (N, K, 1, H, W)
        cross_entropy = -log_p.gather(2, index).mean(dim=(0, 2, 3, 4))     # (K,)
        target = F.one_hot(labels, classes).permute(0, 3, 1, 2)[:, None, 1:].to(log_p.dtype)
        p = log_p[:, :, 1:].exp()                                          # no background
        overlap = (p * target).sum(dim=(0, 3, 4))                          # (K, C - 1)
        total = p.sum(dim=(0, 3, 4)) + target.sum(dim=(0, 3, 4))
        dice = 1 - (2 * overlap + SMOOTH) / (total + SMOOTH)
        weights = 0.5 ** torch.arange(heads, device=logits.device, dtype=log_p.dtype)
        return ((dice.mean(dim=1) + cross_entropy) * weights).sum() / weights.sum()


# Voxels per piece of a volume that dice_per_class counts at a time. Its masks are this size,
# and count_nonzero makes no int64 copy of them (a bool tensor's sum does): whole-volume masks
# took a volume's int64 copy, so train's validation peaked 40-75 MiB higher at each volume's
# Dice, with the volume's size, and its peak followed the largest volume it met (issue 47).
DICE_CHUNK_VOXELS = 1 << 18


def dice_per_class(prediction: torch.Tensor, target: torch.Tensor,
                   n_classes: int) -> torch.Tensor:
    """Dice of classes 1..n_classes-1 for one volume; prediction, target (D, H, W) int.

    Returns (n_classes - 1,) float64 with the anchors' rules for absent classes. The voxels
    are counted :data:`DICE_CHUNK_VOXELS` at a time, so the memory it takes is bounded.
    """
    if prediction.shape != target.shape:
        raise ValueError(f"prediction {list(prediction.shape)} and target {list(target.shape)} "
                         "differ in shape")
    predicted, labelled = prediction.reshape(-1), target.reshape(-1)
    counts = torch.zeros(3, n_classes - 1, dtype=torch.int64)    # overlap, predicted, true
    for start in range(0, predicted.numel(), DICE_CHUNK_VOXELS):
        piece = slice(start, start + DICE_CHUNK_VOXELS)
        for cls in range(1, n_classes):
            pred, true = predicted[piece] == cls, labelled[piece] == cls
            counts[:, cls - 1] += torch.stack([torch.count_nonzero(pred & true),
                                               torch.count_nonzero(pred),
                                               torch.count_nonzero(true)])
    overlap, pred_sum, true_sum = counts.double()
    absent = (pred_sum == 0).double()            # absent from both: 1, predicted only: 0
    return torch.where(true_sum == 0, absent, 2.0 * overlap / (pred_sum + true_sum).clamp(min=1))
