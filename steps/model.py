"""The network: the anchors' 2D nnU-Net for Task01, built with MONAI's DynUNet.

Shapes: input ``(N, C_in, H, W)`` float32; output ``(N, C_out, H, W)`` logits in eval mode.
In training with deep supervision, DynUNet returns ``(N, 1 + heads, C_out, H, W)``: the full
resolution output first, then the ½ and ¼ resolution heads upsampled to ``(H, W)``.
H and W must be multiples of :meth:`ModelConfig.size_multiple`.

The anchors' network is ``ModelConfig()``: filters [32, 64, 128, 256, 512, 512], 3×3
kernels, strides [1, 2, 2, 2, 2, 2], affine instance norm, LeakyReLU 0.01, transposed
convolutions, two deep-supervision heads. ``base_filters`` shrinks it for quick CPU runs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

NORMS = ("instance", "batch", "group")
GROUPS = 16            # group norm's groups: every level's filters must be a multiple
MAX_FILTERS = 512      # the anchors' widest level; also the bound on what a checkpoint may ask


@dataclass(frozen=True)
class ModelConfig:
    in_channels: int = 4
    out_channels: int = 4
    base_filters: int = 32
    max_filters: int = MAX_FILTERS
    levels: int = 6
    norm: str = "instance"
    deep_supervision: bool = True
    deep_supervision_heads: int = 2

    @property
    def filters(self) -> list[int]:
        return [min(self.base_filters * 2 ** i, self.max_filters) for i in range(self.levels)]

    @property
    def strides(self) -> list[int]:
        return [1] + [2] * (self.levels - 1)

    def size_multiple(self) -> int:
        """H and W must be divisible by this (2 ** number of downsamplings)."""
        return 2 ** (self.levels - 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown model config key '{unknown[0]}'")
        return cls(**values)


def _norm_name(norm: str):
    if norm == "instance":
        return ("INSTANCE", {"affine": True})
    if norm == "batch":
        return "BATCH"
    if norm == "group":
        return ("GROUP", {"num_groups": GROUPS})
    raise ValueError(f"norm must be one of {NORMS}, got '{norm}'")


def build_model(config: ModelConfig, deep_supervision: bool | None = None):
    """Return the DynUNet for ``config`` (``deep_supervision`` overrides the config's flag)."""
    # Lazy: the compiler reads this module's constants (steps.params) without monai or torch.
    from monai.networks.nets import DynUNet

    supervised = config.deep_supervision if deep_supervision is None else deep_supervision
    return DynUNet(
        spatial_dims=2,
        in_channels=config.in_channels,
        out_channels=config.out_channels,
        kernel_size=[3] * config.levels,
        strides=config.strides,
        upsample_kernel_size=config.strides[1:],
        filters=config.filters,
        norm_name=_norm_name(config.norm),
        act_name=("leakyrelu", {"inplace": True, "negative_slope": 0.01}),
        deep_supervision=supervised,
        deep_supr_num=config.deep_supervision_heads,
        res_block=False,
    )
