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


def dice_per_class(prediction: torch.Tensor, target: torch.Tensor,
                   n_classes: int) -> torch.Tensor:
    """Dice of classes 1..n_classes-1 for one volume; prediction, target (D, H, W) int.

    Returns (n_classes - 1,) float64 with the anchors' rules for absent classes.
    """
    scores = []
    for cls in range(1, n_classes):
        pred, true = prediction == cls, target == cls
        if not true.any():
            scores.append(1.0 if not pred.any() else 0.0)
            continue
        overlap = (pred & true).sum().item()
        scores.append(2.0 * overlap / (pred.sum().item() + true.sum().item()))
    return torch.tensor(scores, dtype=torch.float64)
