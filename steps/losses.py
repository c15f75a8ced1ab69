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
from monai.losses import DiceCELoss


class DeepSupervisionLoss(torch.nn.Module):
    """``forward(logits, labels)``: logits (N, C, H, W) or (N, 1 + heads, C, H, W); labels (N, H, W)."""

    def __init__(self):
        super().__init__()

        self.dice_ce = DiceCELoss(include_background=False, to_onehot_y=True, softmax=True,
                                  batch=True)

    def head_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.dice_ce(logits.float(), labels[:, None])

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if logits.dim() == 4:
            return self.head_loss(logits, labels)
        heads = logits.shape[1]
        weights = [0.5 ** i for i in range(heads)]
        total = sum(w * self.head_loss(logits[:, i], labels) for i, w in enumerate(weights))
        return total / sum(weights)


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
