"""The `nvidia_2d` profiles hold NVIDIA's nnU-Net 2D recipe for Task01, value by value.

Cited from NVIDIA/DeepLearningExamples at 729963dd47e7c8bd462ad10bfac7a7b0b604e6dd, under
PyTorch/Segmentation/nnUNet/ (read with the search tool, 2026-11-28):

- scripts/train.py: ``skip = 100 if args.gpus == 1 else 150``; the command it builds passes
  ``--deep_supervision --skip_first_n_eval {skip}``, ``--batch_size 64``,
  ``--val_batch_size 64``, ``--norm instance``, ``--epochs {300 if args.gpus == 1 else
  600}``, ``--learning_rate`` (default ``8e-4``), ``--seed`` (default 1), and no
  ``--scheduler``, ``--optimizer`` or ``--weight_decay``.
- utils/args.py: ``--optimizer`` default ``adam``, ``--weight_decay`` default ``0.0001``,
  ``--deep_supr_num`` default 2, ``--scheduler`` off unless given.
- nnunet/nn_unet.py ``configure_optimizers``: ``FusedAdam(self.parameters(),
  lr=self.learning_rate, weight_decay=self.args.weight_decay)`` from apex, whose
  ``adam_w_mode`` defaults to True, decoupled weight decay (AdamW); without ``--scheduler``
  no scheduler, so the rate is constant. Line 193: LeakyReLU with ``negative_slope`` 0.01.
- data_preprocessing/configs.py: ``"01_2d": [192, 160]``.
- ``--patience`` (default 100) is parsed but never used: main.py adds no EarlyStopping
  callback, so NVIDIA's runs do not stop early (the issue's "patience 100" is that unused
  default).
- ``--batch_size`` is per GPU (DDP): 64 slices per device, 512 on 8.

What this profile cannot match: NVIDIA's 2D batch is 4 volumes × 16 consecutive slices per
device (data_loading/dali_loader.py), ours 64 slices drawn at random; their validation Dice is
on volumes center-cropped to 192×160 (preprocessor.py), ours on whole slices.
"""
from __future__ import annotations

import pytest
import torch

from steps import devices, model, train
from workflows.config import load_config

# (our train parameter, NVIDIA's value on 8 devices, on 1 device)
NVIDIA_2D = [
    ("learning_rate", 8e-4, 8e-4),
    ("weight_decay", 1e-4, 1e-4),
    ("max_epochs", 600, 300),
    ("skip_first_n_eval", 150, 100),
    ("val_batch_size", 64, 64),
    ("patch_size", "192x160", "192x160"),
    ("deep_supervision", True, True),
    ("norm", "instance", "instance"),
    ("seed", 1, 1),
    ("lr_schedule", "constant", "constant"),
    ("patience", 0, 0),                  # no early stopping (0: never)
]
PER_DEVICE_BATCH = 64


def effective(profile: str) -> tuple[dict, int]:
    """The profile's train values, patch size included (a preprocess parameter), and its
    device count."""
    cfg = load_config(None, profile)
    values = cfg.train.model_dump()
    values["patch_size"] = cfg.preprocess.patch_size
    return values, values["devices"]


@pytest.mark.parametrize("profile, column, devices_", [("nvidia_2d", 1, 8),
                                                       ("nvidia_2d_1dev", 2, 1)])
def test_the_profile_holds_nvidias_values(profile, column, devices_):
    values, n_devices = effective(profile)
    assert n_devices == devices_
    got = {name: values[name] for name, *_ in NVIDIA_2D}
    assert got == {row[0]: row[column] for row in NVIDIA_2D}
    assert values["batch_size"] == PER_DEVICE_BATCH * n_devices      # ours is global


def test_its_optimizer_is_adam_with_decoupled_weight_decay():
    """apex's FusedAdam in its default adam_w_mode, betas (0.9, 0.999), eps 1e-8, is torch's
    AdamW with those defaults."""
    values, _ = effective("nvidia_2d")
    assert values["optimizer"] == "adamw"
    cpu = devices.DeviceInfo("cpu", torch.device("cpu"), None)
    optimizer = devices.make_optimizer("adamw", [torch.nn.Parameter(torch.zeros(2))],
                                       values["learning_rate"], values["weight_decay"], cpu)
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults["eps"] == 1e-8 and optimizer.defaults["betas"] == (0.9, 0.999)


def test_a_constant_schedule_keeps_the_rate():
    assert {train.lr_factor(s, 100, "constant") for s in (0, 50, 100, 500)} == {1.0}
    assert train.lr_factor(50, 100) == pytest.approx(0.5)


def test_the_network_is_theirs_for_192x160():
    """Their Task01 2D network (nn_unet.py get_unet_params and MONAI's DynUNet defaults):
    6 levels taking 192×160 to a 6×5 bottleneck, filters 32, 64, 128, 256, 512, 512, two
    deep-supervision heads, LeakyReLU 0.01 (steps/model.py's too)."""
    values, _ = effective("nvidia_2d")
    net = model.ModelConfig(base_filters=values["base_filters"], levels=values["levels"],
                            norm=values["norm"], deep_supervision=values["deep_supervision"])
    assert net.filters == [32, 64, 128, 256, 512, 512]
    assert (192 // net.size_multiple(), 160 // net.size_multiple()) == (6, 5)
    assert net.deep_supervision_heads == 2
