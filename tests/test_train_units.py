"""Unit tests of the train step's parts: sampler, augmentation, loss and metric, checkpoints
(local and the real S3 fixture), devices, and the Gaudi path through a labelled stand-in."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from monai.losses import DiceCELoss
import numpy as np
import pytest
import torch

from steps import losses
from steps.checkpoints import LATEST, CheckpointStore
from steps.dataset import Case, check_values
from steps.devices import select_device
from steps.errors import StepError
from steps.losses import DeepSupervisionLoss, dice_per_class
from steps.model import ModelConfig, build_model
from steps.sampler import (Augmentation, SliceSampler, StepDataset, _foreground_voxel,
                           _gaussian_blur, _gaussian_blur_batched, augment, pad_crop_2d,
                           torch_seed)
from steps.train import pass_shape, predict_volume, slices_per_pass

REPO = Path(__file__).resolve().parents[1]
STANDIN = Path(__file__).resolve().parent / "hpu_standin"


def _cases(n: int = 3, shape=(4, 6, 20, 28)) -> list[Case]:
    rng = np.random.default_rng(0)
    cases = []
    for i in range(n):
        label = np.zeros(shape[1:], dtype=np.uint8)
        label[2:4, 5:9, 10:14] = 1 + i % 3
        image = rng.normal(size=shape).astype(np.float16)
        cases.append(Case(f"c{i}", image, label, (1.0, 1.0, 1.0)))
    return cases


# ------------------------------------------------------------------------------ sampler

def test_batches_depend_only_on_seed_step_and_rank():
    sampler = SliceSampler(_cases(), (16, 32), batch=6, seed=5)
    x1, y1 = sampler(11, rank=1)
    x2, y2 = SliceSampler(_cases(), (16, 32), batch=6, seed=5)(11, rank=1)
    assert x1.shape == (6, 4, 16, 32) and y1.shape == (6, 16, 32) and y1.dtype == torch.uint8
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, sampler(11, rank=0)[0])
    assert not torch.equal(x1, sampler(12, rank=1)[0])
    # A DataLoader with workers yields exactly the sampler's batches.
    loader = torch.utils.data.DataLoader(StepDataset(sampler, 10, 3, 1), batch_size=None,
                                         num_workers=2)
    for offset, (xb, yb) in enumerate(loader):
        xs, ys = sampler(10 + offset, 1)
        assert torch.equal(xb, xs) and torch.equal(yb, ys)


def test_foreground_oversampling_centres_patches_on_tumour():
    sampler = SliceSampler(_cases(), (8, 8), batch=400, seed=1, foreground_p=1.0)
    _, labels = sampler(0)
    assert bool((labels.flatten(1) > 0).any(1).all())
    _, labels = SliceSampler(_cases(), (8, 8), batch=400, seed=1, foreground_p=0.0)(0)
    share = float((labels.flatten(1) > 0).any(1).float().mean())
    assert share < 0.3   # tumour occupies 2 of 6 slices and a small window


@pytest.mark.parametrize("size, foreground", [(64, [3, 10, 40]),        # a draw hits
                                               (200_000, [5, 77_777])])  # the fallback
def test_foreground_voxel_is_uniform_over_the_foreground(size, foreground):
    labels = np.zeros(size, np.uint8)
    labels[foreground] = 1
    rng = np.random.default_rng(0)
    picks = np.array([_foreground_voxel(rng, labels) for _ in range(1500)])
    assert set(picks.tolist()) == set(foreground)
    counts = np.bincount(picks)[foreground]
    assert counts.min() > 0.8 * len(picks) / len(foreground)


def test_gaussian_blur_matches_a_conv2d_reference():
    images = torch.randn(2, 3, 12, 9, dtype=torch.float64)
    sigma = 1.3
    radius = 4                                          # ceil(3 sigma)
    taps = torch.exp(-0.5 * (torch.arange(-radius, radius + 1, dtype=torch.float64) / sigma) ** 2)
    kernel = torch.outer(taps, taps) / taps.sum() ** 2
    padded = torch.nn.functional.pad(images, (radius,) * 4, mode="reflect")
    reference = torch.nn.functional.conv2d(padded.flatten(0, 1)[:, None],
                                           kernel[None, None]).view_as(images)
    assert torch.allclose(_gaussian_blur(images, sigma), reference, atol=1e-12)


def test_pad_crop_fills_outside_and_keeps_inside():
    array = torch.arange(12, dtype=torch.float16).reshape(1, 3, 4)
    out = pad_crop_2d(array, -1, 2, (5, 3), torch.tensor([-9.0])[:, None, None],
                      torch.empty(1, 5, 3))
    assert out.shape == (1, 5, 3)
    assert out[0, 0].tolist() == [-9, -9, -9]
    assert out[0, 1].tolist() == [2, 3, -9]


def test_flipped_window_is_the_flip_of_the_window_padding_included():
    array = torch.arange(2 * 5 * 7, dtype=torch.float16).reshape(2, 5, 7)
    fill = torch.tensor([-1.0, -2.0])[:, None, None]
    for top, left in ((0, 0), (-2, 3), (1, -1), (2, 4)):
        plain = pad_crop_2d(array, top, left, (4, 6), fill, torch.empty(2, 4, 6))
        for flips in ([-1], [-2], [-1, -2]):
            flipped = pad_crop_2d(array, top, left, (4, 6), fill, torch.empty(2, 4, 6), flips)
            assert torch.equal(flipped, plain.flip(flips)), (top, left, flips)


def test_augment_is_seeded_and_keeps_labels_valid():
    x, y = SliceSampler(_cases(), (16, 32), batch=64, seed=2)(0)
    a1, b1 = augment(x, y, seed=123)
    a2, b2 = augment(x, y, seed=123)
    assert torch.equal(a1, a2) and torch.equal(b1, b2)
    assert a1.shape == x.shape and b1.shape == y.shape and b1.dtype == y.dtype == torch.uint8
    assert set(b1.unique().tolist()) <= {0, 1, 2, 3}
    assert not torch.equal(a1, x)          # with 64 samples some augmentation fired
    a3, _ = augment(x, y, seed=124)
    assert not torch.equal(a1, a3)


def test_batched_blur_equals_each_image_blurred_alone():
    torch.manual_seed(0)
    images = torch.randn(5, 4, 24, 20)
    sigmas = [0.5, 0.9, 1.2, 1.5, 0.7]
    alone = torch.cat([_gaussian_blur(images[i:i + 1], s) for i, s in enumerate(sigmas)])
    assert torch.allclose(_gaussian_blur_batched(images, sigmas), alone, atol=1e-6)


def test_contrast_clamps_each_sample_to_its_own_range():
    x, y = SliceSampler(_cases(), (16, 32), batch=8, seed=2)(0)
    spec = Augmentation(zoom_p=0, noise_p=0, blur_p=0, brightness_p=0, contrast_p=1,
                        contrast_range=(1.5, 1.5))
    a, _ = augment(x, y, seed=5, spec=spec)
    for before, after in zip(x, a):
        assert torch.equal(after, (before * 1.5).clamp(before.min(), before.max()))


def test_augmentation_spec_switches_each_transform_and_checks_its_ranges():
    x, y = SliceSampler(_cases(), (16, 32), batch=16, seed=2)(0)
    off = Augmentation(zoom_p=0, noise_p=0, blur_p=0, brightness_p=0, contrast_p=0)
    a, b = augment(x, y, seed=5, spec=off)
    assert torch.equal(a, x) and torch.equal(b, y)
    doubled = Augmentation(zoom_p=0, noise_p=0, blur_p=0, contrast_p=0, brightness_p=1,
                           brightness_range=(2.0, 2.0))
    a, b = augment(x, y, seed=5, spec=doubled)
    assert torch.equal(a, 2 * x) and torch.equal(b, y)
    zoomed = Augmentation(noise_p=0, blur_p=0, brightness_p=0, contrast_p=0, zoom_p=1,
                          zoom_range=(0.5, 0.5))
    a, b = augment(x, y, seed=5, spec=zoomed)
    assert a.shape == x.shape and not torch.equal(b, y)
    for bad in ({"noise_p": 1.5}, {"blur_sigma_range": (1.0, 0.5)},
                {"brightness_range": (0.0, 1.0)}, {"zoom_range": (0.7, 1.2)},
                {"noise_std_range": (-0.1, 0.3)}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Augmentation(**bad)


def test_torch_seed_is_a_pure_function_of_the_triple():
    assert torch_seed(1, 2, 3) == torch_seed(1, 2, 3) != torch_seed(1, 2, 4)


# ------------------------------------------------------------------------ loss and metric

def test_dice_rules_for_absent_classes():
    target = torch.zeros(2, 4, 4, dtype=torch.uint8)
    target[0, :2, :2] = 1
    pred = target.clone()
    pred[1, 0, 0] = 3                       # class 3 absent from target, predicted: 0
    scores = dice_per_class(pred, target, 4)
    assert scores.tolist() == [1.0, 1.0, 0.0]   # class 2 absent from both: 1
    half = target.clone()
    half[0, :2, 1] = 0
    assert dice_per_class(half, target, 4)[0] == pytest.approx(2 * 2 / (2 + 4))


@pytest.mark.parametrize("chunk", [1, 7, 1000, 1 << 20])
def test_dice_counted_in_pieces_is_the_whole_volumes(monkeypatch, chunk):
    """Pieces of any size, one ending mid-slice, give the whole volume's Dice exactly; the
    reference is numpy's over the whole volume, the anchors' rules for absent classes."""
    rng = np.random.default_rng(3)
    target = rng.integers(0, 3, (5, 13, 11)).astype(np.uint8)       # class 3 never labelled
    pred = np.where(rng.random(target.shape) < 0.7, target,
                    rng.integers(0, 4, target.shape)).astype(np.uint8)
    reference = []
    for cls in (1, 2, 3):
        p, t = pred == cls, target == cls
        reference.append(float(not p.any()) if not t.any()
                         else 2 * (p & t).sum() / (p.sum() + t.sum()))
    assert 0 < reference[0] < 1 and reference[2] == 0.0        # a predicted absent class: 0
    monkeypatch.setattr(losses, "DICE_CHUNK_VOXELS", chunk)
    got = dice_per_class(torch.from_numpy(pred), torch.from_numpy(target), 4)
    assert got.dtype == torch.float64 and got.tolist() == pytest.approx(reference, abs=1e-15)
    with pytest.raises(ValueError, match="differ in shape"):     # flattened, they would pair
        dice_per_class(torch.from_numpy(pred).transpose(1, 2), torch.from_numpy(target), 4)


def test_dice_allocates_a_piece_at_a_time_whatever_the_volume():
    """No allocation of Dice's grows with the volume: the largest is one piece's mask, a byte a
    voxel (a whole volume's bool sum allocated an int64 copy of it, 19.2 MB here)."""
    truth = torch.zeros(60, 200, 200, dtype=torch.uint8)
    truth[:, 50:150, 40:160] = 1
    truth[:, 80:120, 60:100] = 2
    pred = truth.roll(5, dims=2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        dice_per_class(pred, truth, 4)
    largest = max(event.cpu_memory_usage for event in prof.events())
    assert 0 < largest <= losses.DICE_CHUNK_VOXELS < truth.numel()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_a_single_non_finite_voxel_anywhere_is_refused(bad, dtype):
    """check_values finds one NaN or infinity wherever it sits (a reduction over the volume,
    not a mask of it) and counts it; a finite case passes."""
    rng = np.random.default_rng(7)
    label = np.zeros((9, 17, 13), np.uint8)
    for trial in range(20):
        image = rng.normal(size=(4, *label.shape)).astype(dtype)
        check_values([Case("fine", image, label)], 4)
        image[tuple(int(rng.integers(n)) for n in image.shape)] = bad
        with pytest.raises(StepError, match="'c' image has 1 NaN/Inf voxels"):
            check_values([Case("c", image, label)], 4)


def test_deep_supervision_loss_is_monais_dice_ce_per_head_weighted_and_normalised():
    monai = DiceCELoss(include_background=False, to_onehot_y=True, softmax=True, batch=True)
    loss = DeepSupervisionLoss()
    torch.manual_seed(0)
    for classes, size in ((4, 8), (2, 5), (3, 16)):
        labels = torch.randint(0, classes, (2, size, size))
        heads = torch.randn(2, 3, classes, size, size) * 4
        expected = sum(w * monai(heads[:, i], labels[:, None])
                       for i, w in enumerate([1, 0.5, 0.25])) / 1.75
        assert float(loss(heads, labels)) == pytest.approx(float(expected), rel=1e-6)
        assert float(loss(heads[:, 0], labels)) == \
            pytest.approx(float(monai(heads[:, 0], labels[:, None])), rel=1e-6)
    labels[:, :2] = 0          # a class absent from the target: MONAI's smoothing decides
    assert float(loss(heads, labels)) == pytest.approx(float(sum(
        w * monai(heads[:, i], labels[:, None]) for i, w in enumerate([1, 0.5, 0.25])) / 1.75),
        rel=1e-6)
    perfect = torch.nn.functional.one_hot(labels, 4).permute(0, 3, 1, 2).float() * 50
    assert float(loss(perfect, labels)) < 0.01


# -------------------------------------------------------------------------- checkpoints

def test_local_checkpoints_round_trip_and_prune(tmp_path):
    store = CheckpointStore(str(tmp_path / "ck"))
    assert store.load_latest() is None
    for step in (1, 2, 3):
        store.save({"step": step, "w": torch.full((3,), float(step))}, step)
    state = store.load_latest()
    assert state["step"] == 3 and torch.equal(state["w"], torch.full((3,), 3.0))
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "ckpt-0000000002.pt", "ckpt-0000000003.pt", LATEST]


_FULL_DISK = textwrap.dedent("""
    import resource, signal, sys, torch
    from steps.checkpoints import CheckpointStore
    store = CheckpointStore(sys.argv[1])
    store.save({"step": 1, "w": torch.ones(10)}, 1)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # writes past the limit raise EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    try:
        store.save({"step": 2, "w": torch.zeros(4_000_000)}, 2)
    except OSError as exc:
        print("write failed:", exc.strerror)
""")


@pytest.mark.slow
def test_prune_never_deletes_the_checkpoint_latest_names(tmp_path):
    """A run that starts again from step 1 in a store where a killed run left higher steps:
    the newest by name are the old run's, but ``latest`` names the new one."""
    store = CheckpointStore(str(tmp_path / "ck"))
    for step in (15, 16):
        store.save({"step": step, "w": torch.ones(1) * step}, step)
    store.save({"step": 14, "w": torch.ones(1) * 14}, 14)
    assert store.load_latest()["step"] == 14
    assert store.names() == ["ckpt-0000000014.pt", "ckpt-0000000016.pt", LATEST]


def test_a_failing_write_leaves_latest_on_the_previous_checkpoint(tmp_path):
    """A writer that runs out of space (RLIMIT_FSIZE 1 MB) halfway through a 16 MB file."""
    done = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "write failed" in done.stdout
    store = CheckpointStore(str(tmp_path))
    assert store.latest_name() == "ckpt-0000000001.pt"
    assert store.load_latest()["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000000001.pt", LATEST]


_WRITER = textwrap.dedent("""
    import sys, torch
    from steps.checkpoints import CheckpointStore
    store = CheckpointStore(sys.argv[1])
    big = torch.arange(4_000_000, dtype=torch.float32)
    step = 0
    while True:
        step += 1
        store.save({"step": step, "w": big + step}, step)
        print(step, flush=True)
""")


@pytest.mark.slow
def test_sigkill_during_checkpoint_writes_never_breaks_latest(tmp_path):
    """Kill a process that writes 16 MB checkpoints back to back at varied moments."""
    uri = str(tmp_path / "ck")
    for delay in (0.3, 0.45, 0.6):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, uri], cwd=REPO,
                                stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()              # at least one checkpoint is complete
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        state = CheckpointStore(uri).load_latest()
        assert torch.equal(state["w"], torch.arange(4_000_000, dtype=torch.float32)
                           + state["step"])


@pytest.mark.s3
def test_checkpoints_on_the_s3_fixture(s3, s3_env):
    uri = f"s3://{s3.bucket}/train-tests/ck-{os.getpid()}"
    store = CheckpointStore(uri)
    assert store.load_latest() is None
    for step in (4, 5, 6):
        store.save({"step": step, "w": torch.ones(2) * step, "best_file": None}, step)
    store.write_bytes("best-epoch0001.pt", b"old best")
    store.save({"step": 7, "w": torch.ones(2) * 7, "best_file": None}, 7)
    fresh = CheckpointStore(uri + "/")
    assert fresh.latest_name() == "ckpt-0000000007.pt"
    assert torch.equal(fresh.load_latest()["w"], torch.full((2,), 7.0))
    assert fresh.names() == ["ckpt-0000000006.pt", "ckpt-0000000007.pt", LATEST]


@pytest.mark.s3
@pytest.mark.slow
def test_train_checkpoints_to_s3_and_resumes_from_there(s3, tmp_path):
    from train_data import make_dataset, run_step, step_env
    dataset = make_dataset(tmp_path, cases=5, shape="32x32x12", seed=1, patch="32x32")
    uri = f"s3://{s3.bucket}/train-tests/run-{os.getpid()}"
    common = ["--dataset", str(dataset), "--device", "cpu", "--base-filters", "4",
              "--levels", "4", "--batch-size", "2", "--steps-per-epoch", "2",
              "--num-workers", "0", "--checkpoint-uri", uri, "--patience", "0"]
    env = step_env(**s3.env())
    done = run_step("train", "--model", str(tmp_path / "m1"), "--max-epochs", "1", *common,
                    env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    store = CheckpointStore(uri)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3.env().items():
            mp.setenv(key, value)
        assert store.latest_name() == "ckpt-0000000002.pt"
    done = run_step("train", "--model", str(tmp_path / "m2"), "--max-epochs", "2", *common,
                    env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed from" in done.stderr and "epoch 1, step 2" in done.stderr
    epochs = json.loads((tmp_path / "m2" / "metrics.json").read_text())["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2]


# ------------------------------------------------------------------------------ devices

def test_cpu_device_and_errors(monkeypatch):
    from steps import devices
    info = devices.select_device("cpu")
    assert info.kind == "cpu" and info.backend == "gloo" and info.dtype is None
    assert devices.select_device("auto").kind in ("cpu", "cuda")
    with pytest.raises(StepError, match="fp16 is supported on cuda only"):
        devices.select_device("cpu", precision="fp16")
    with pytest.raises(StepError, match="fusedadamw needs --device hpu"):
        devices.make_optimizer("fusedadamw", [torch.nn.Parameter(torch.ones(1))], 1e-3, 0,
                               info)


def _cuda_info(**changes):
    """A DeviceInfo that says CUDA but holds CPU tensors: the CUDA-only decisions, run here."""
    from steps import devices
    return devices.DeviceInfo(kind="cuda", device=torch.device("cpu"), dtype=None, **changes)


def test_cuda_switches_compile_mode_layout_and_fused_adamw():
    from steps import devices
    from steps.train import forwards
    net = torch.nn.Conv2d(4, 4, 3)
    assert devices.select_device("cpu", channels_last=True).channels_last is False
    for mode in devices.CUDA_COMPILE_MODES:
        train_forward, eval_forward = forwards(net, _cuda_info(), 1, True, mode)
        assert train_forward._orig_mod is net and eval_forward is net   # eager validation
    assert forwards(net, _cuda_info(), 1, False, "default") == (net, net)
    assert devices.compile_for_device(net, devices.select_device("cpu"), True) is net
    with pytest.raises(StepError, match="--cuda-compile-mode must be one of"):
        devices.compile_for_device(net, _cuda_info(), True, "max-autotune")
    info = _cuda_info(channels_last=True)
    model = devices.prepare_model(torch.nn.Conv2d(4, 8, 3), info)
    assert model.weight.is_contiguous(memory_format=torch.channels_last)
    batch = devices.to_device(torch.randn(2, 4, 8, 8), info)
    assert batch.is_contiguous(memory_format=torch.channels_last)
    assert devices.to_device(torch.randn(2, 4, 8, 8), _cuda_info()).is_contiguous()
    fused = devices.make_optimizer("fusedadamw", [torch.nn.Parameter(torch.ones(2))], 1e-3,
                                   1e-4, _cuda_info())
    assert isinstance(fused, torch.optim.AdamW) and fused.defaults["fused"] is True
    plain = devices.make_optimizer("adamw", [torch.nn.Parameter(torch.ones(2))], 1e-3, 1e-4,
                                   _cuda_info())
    assert not plain.defaults["fused"]


def test_cuda_steps_default_to_compiled_cuda_graphs_with_the_layout_optimization():
    from steps.train import build_parser
    args = build_parser().parse_args(["--dataset", "d", "--model", "m"])
    assert (args.cuda_compile, args.cuda_compile_mode, args.cuda_layout_opt,
            args.cuda_channels_last, args.compile_cache) == \
        (True, "reduce-overhead", True, False, True)
    back = build_parser().parse_args(["--dataset", "d", "--model", "m", "--cuda-compile",
                                      "false", "--cuda-channels-last", "true",
                                      "--cuda-compile-mode", "default",
                                      "--cuda-layout-opt", "false"])
    assert (back.cuda_compile, back.cuda_compile_mode, back.cuda_channels_last,
            back.cuda_layout_opt) == (False, "default", True, False)


def test_the_forced_layout_optimization_is_an_option_torch_compiles_with():
    """The options carry the mode's own (torch takes mode= or options=, not both) and the
    forced layout; Inductor accepts them (an unknown key raises) and the compiled U-Net
    block computes what the eager one does, forward and backward (here on the CPU)."""
    from steps import devices
    assert devices.inductor_options("reduce-overhead", True) == \
        {"triton.cudagraphs": True, "force_layout_optimization": True}
    assert devices.inductor_options("default", False) == {"force_layout_optimization": False}
    torch.manual_seed(0)
    # a decoder block's shape: 16 channels in, 8 out (what Inductor's heuristic refuses)
    net = torch.nn.Sequential(torch.nn.Conv2d(16, 8, 3, padding=1),
                              torch.nn.InstanceNorm2d(8, affine=True), torch.nn.LeakyReLU())
    images = torch.randn(2, 16, 16, 16)
    compiled = torch.compile(net, dynamic=False,
                             options=devices.inductor_options("default", True))
    outputs = [module(images) for module in (net, compiled)]
    grads = [torch.autograd.grad(out.square().sum(), net[0].weight)[0] for out in outputs]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-3, atol=1e-3)


def test_device_batches_are_device_batch_of_each_step():
    from steps import devices
    from steps.train import device_batch, device_batches
    info = devices.select_device("cpu")
    sampler = SliceSampler(_cases(), (16, 32), batch=4, seed=3)
    host = [sampler(step) for step in range(7, 10)]
    made = list(device_batches(iter([(x.clone(), y.clone()) for x, y in host]), 7, info,
                               seed=3, rank=0))
    assert len(made) == 3
    for step, (x, y), (images, labels) in zip(range(7, 10), host, made):
        expected = device_batch(x.clone(), y.clone(), info, torch_seed(3, step, 0))
        assert torch.equal(images, expected[0]) and torch.equal(labels, expected[1])
        assert labels.dtype == torch.int64


def test_jemalloc_env_prepends_the_library_when_installed():
    from steps import devices
    env = devices.jemalloc_env({"LD_PRELOAD": "/x.so"})
    path = devices.jemalloc_path()
    if path is None:
        assert env == {"LD_PRELOAD": "/x.so"}
    else:
        assert env["LD_PRELOAD"] == f"{path}:/x.so"
        assert devices.jemalloc_env(env)["LD_PRELOAD"] == env["LD_PRELOAD"]


_STANDIN_SCRIPT = textwrap.dedent("""
    import dataclasses, json, os, sys
    import torch
    from steps import devices
    from steps.losses import DeepSupervisionLoss
    from steps.model import ModelConfig, build_model
    from steps.train import train_step

    mode = sys.argv[1]
    info = devices.select_device("auto", "auto", mode)
    net = build_model(ModelConfig(base_filters=4, levels=4))
    opt = devices.make_optimizer("fusedadamw", net.parameters(), 1e-3, 1e-4, info)
    result = {"kind": info.kind, "backend": devices.load_backend(info),
              "dtype": str(info.dtype), "lazy_env": os.environ["PT_HPU_LAZY_MODE"],
              "optimizer": type(opt).__name__}
    if mode == "lazy":
        # The stand-in cannot hold tensors, so the loop runs on the CPU with HPU-mode hooks.
        host = dataclasses.replace(info, device=torch.device("cpu"), dtype=None)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        scaler = torch.amp.GradScaler("cuda", enabled=False)
        x, y = torch.randn(2, 4, 16, 16), torch.randint(0, 4, (2, 16, 16))
        for _ in range(3):
            train_step(net, DeepSupervisionLoss(), opt, sched, scaler, host, x, y)
    else:
        tiny = torch.nn.Linear(3, 2)
        compiled = devices.compile_for_device(tiny, info)
        result["compiled_ok"] = torch.allclose(compiled(torch.ones(1, 3)), tiny(torch.ones(1, 3)))
    print(json.dumps(result))
""")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lazy", "compile"])
def test_gaudi_path_with_the_labelled_standin(tmp_path, mode):
    """STAND-IN test: a fake habana_frameworks (tests/hpu_standin) records what we call."""
    log = tmp_path / "calls.jsonl"
    env = dict(os.environ, PYTHONPATH=f"{STANDIN}{os.pathsep}{REPO}", HPU_STANDIN_LOG=str(log))
    env.pop("PT_HPU_LAZY_MODE", None)
    done = subprocess.run([sys.executable, "-c", _STANDIN_SCRIPT, mode], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    events = [c["event"] for c in calls]
    assert result["kind"] == "hpu" and result["backend"] == "hccl"
    assert result["dtype"] == "torch.bfloat16" and result["optimizer"] == "FusedAdamW"
    assert "import_hccl" in events
    fused = next(c for c in calls if c["event"] == "FusedAdamW")
    assert fused["eps"] == 1e-8 and fused["weight_decay"] == 1e-4
    imported = next(c for c in calls if c["event"] == "import")
    if mode == "lazy":
        assert imported["lazy_mode"] == "1"
        # mark_step after backward and after optimizer.step, on each of 3 steps (the
        # stand-in's FusedAdamW, like the bridge's, also marks a step inside its own step).
        steps = [c["event"] for c in calls if c["event"] in ("mark_step", "FusedAdamW.step")
                 and "by" not in c]
        assert steps == ["mark_step", "FusedAdamW.step", "mark_step"] * 3
    else:
        assert imported["lazy_mode"] == "0"
        assert result["compiled_ok"] and "hpu_backend_compile" in events
        assert "mark_step" not in events


# ---- the Gaudi path's contract, through the stand-in (issue 18) --------------------------------

def _standin_run(tmp_path, script: str, *args: str, **env_extra: str):
    """Run ``script`` with the stand-in on sys.path (it also registers torch's autoload entry
    point): (exit status, stdout, recorded calls)."""
    log = tmp_path / "calls.jsonl"
    env = dict(os.environ, PYTHONPATH=f"{STANDIN}{os.pathsep}{REPO}", HPU_STANDIN_LOG=str(log))
    for name in ("PT_HPU_LAZY_MODE", "PT_HPU_AUTOLOAD", "TORCH_DEVICE_BACKEND_AUTOLOAD"):
        env.pop(name, None)
    env.update(env_extra)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return done, calls


_SELECT = """
    import sys
    first = sys.argv[1]
    if first == "torch":
        import torch                      # the bridge autoloads here, mode from the env
    from steps import devices
    from steps.errors import StepError
    try:
        info = devices.select_device("auto", "auto", sys.argv[2])
        print("mode", info.hpu_mode, devices.lazy_mode_in_effect())
    except StepError as exc:
        print("error", exc)
"""


@pytest.mark.slow
def test_the_requested_hpu_mode_is_the_mode_in_effect_or_an_error(tmp_path):
    """The Gaudi image sets PT_HPU_LAZY_MODE=0. A step (which imports `steps` before torch)
    must still run lazy mode when asked; code that let torch autoload the bridge first gets
    an error instead of silent eager mode with mark_step doing nothing."""
    done, calls = _standin_run(tmp_path, _SELECT, "steps", "lazy", PT_HPU_LAZY_MODE="0")
    assert done.stdout.split() == ["mode", "lazy", "True"], done.stderr[-2000:]
    assert [c["lazy"] for c in calls if c["event"] == "import"] == [True]
    done, _ = _standin_run(tmp_path, _SELECT, "torch", "lazy", PT_HPU_LAZY_MODE="0")
    assert done.stdout.startswith("error --hpu-mode lazy: the Habana bridge runs eager/compile"),\
        done.stdout + done.stderr[-2000:]
    done, _ = _standin_run(tmp_path, _SELECT, "steps", "compile")
    assert done.stdout.split() == ["mode", "compile", "False"], done.stderr[-2000:]


def test_a_validation_pass_holds_at_most_the_batch_of_patches_in_pixels():
    """Slices larger than the patch go fewer to a forward pass (at least one), smaller ones
    at most ``batch``: a pass's pixels, and so its activations, are set by the flags, not by
    the largest slice the data holds (train's memory grew 1.35x from 30 to 750 full-size
    cases with them). Every slice is still predicted once, in order, as by full batches."""
    assert slices_per_pass(8, (32, 32), (16, 16)) == 8
    assert slices_per_pass(8, (32, 32), (64, 32)) == 4
    assert slices_per_pass(8, (16, 16), (60, 52)) == 1
    assert slices_per_pass(8, None, (240, 240)) == 8
    torch.manual_seed(0)
    net = build_model(ModelConfig(base_filters=4, levels=3), deep_supervision=False).eval()
    passes = []

    def forward(x):
        passes.append(tuple(x.shape))
        return net(x)

    image = np.random.default_rng(0).normal(size=(4, 11, 60, 52)).astype(np.float32)
    cpu = select_device("cpu")
    capped = predict_volume(forward, image, cpu, 8, 4, patch=(32, 16))
    assert passes == [(1, 4, 64, 64)] * 11          # 8 * 32 * 16 // (64 * 64) = 1
    passes.clear()
    whole = predict_volume(forward, image, cpu, 8, 4)
    assert [p[0] for p in passes] == [8, 3]
    assert capped.shape == whole.shape == (11, 60, 52)
    assert (capped == whole).float().mean() > 0.999


def test_validation_passes_take_a_few_shapes_whatever_the_crops():
    """Without a static shape a pass is padded to VAL_GRID: the crops of Task01's brains
    (about 120 to 190 pixels a side) make at most 9 pass shapes, where the network's own
    multiple would make one per crop size (what oneDNN caches kernels for: train's memory
    grew with the shapes validated), and a network of a coarser multiple keeps its own."""
    crops = [(h, w) for h in range(120, 191) for w in range(120, 191)]
    assert len({pass_shape(h, w, 8) for h, w in crops}) == 9
    assert pass_shape(130, 161, 8) == (160, 192)
    assert pass_shape(32, 20, 4) == (32, 32)
    assert pass_shape(65, 130, 64) == (128, 192)
    torch.manual_seed(0)
    net = build_model(ModelConfig(base_filters=4, levels=3), deep_supervision=False).eval()
    image = np.random.default_rng(1).normal(size=(4, 3, 40, 36)).astype(np.float32)
    shapes = []
    pred = predict_volume(lambda x: shapes.append(tuple(x.shape)) or net(x), image,
                          select_device("cpu"), 8, 4)
    assert shapes == [(3, 4, 64, 64)] and pred.shape == (3, 40, 36)


_VALIDATE = """
    from steps import devices            # first, as `python -m steps.train` does
    import dataclasses, json
    import numpy as np, torch
    from steps.dataset import Case
    from steps.model import ModelConfig, build_model
    from steps.train import evaluate, static_shape

    info = devices.select_device("auto", "auto", "compile")
    host = dataclasses.replace(info, device=torch.device("cpu"), dtype=None)  # tensors stay here
    config = ModelConfig(base_filters=4, levels=4)
    net = build_model(config, deep_supervision=False).eval()
    rng = np.random.default_rng(0)
    cases = []
    for i, (depth, h, w) in enumerate([(7, 40, 48), (5, 32, 56), (9, 48, 40)]):
        label = np.zeros((depth, h, w), np.uint8)
        cases.append(Case(f"c{i}", rng.normal(size=(4, depth, h, w)).astype(np.float16), label,
                          (1.0, 1.0, 1.0)))
    forward = devices.compile_for_device(net, host)
    shape = static_shape(cases, config.size_multiple())
    for _ in range(2):   # two validation phases
        evaluate(forward, cases, host, 4, config.size_multiple(), 4, 0, 1, shape)
    print(json.dumps(list(shape)))
"""


@pytest.mark.slow
def test_validation_compiles_once_with_static_shapes(tmp_path):
    """Cases of different H x W and depths that are not multiples of the batch: every
    validation forward pass has one shape, so hpu_backend compiles once, never dynamic."""
    done, calls = _standin_run(tmp_path, _VALIDATE)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [48, 56]
    compiles = [c for c in calls if c["event"] == "hpu_backend_compile"]
    assert len(compiles) == 1, compiles
    assert not compiles[0]["dynamic"] and ["4", "4", "48", "56"] in compiles[0]["shapes"]


_FORWARDS = """
    from steps import devices            # first, as `python -m steps.train` does
    import dataclasses, os, torch, torch.distributed as dist
    from steps.model import ModelConfig, build_model
    from steps.train import device_batch, forwards

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    info = devices.select_device("auto", "auto", "compile")
    host = dataclasses.replace(info, device=torch.device("cpu"), dtype=None)
    net = build_model(ModelConfig(base_filters=4, levels=4))
    train_forward, eval_forward = forwards(net, host, world=2)
    print(type(train_forward).__name__, type(train_forward.module).__name__,
          type(eval_forward).__name__)
    lazy = dataclasses.replace(host, hpu_mode="lazy")
    device_batch(torch.randn(2, 4, 16, 16), torch.zeros(2, 16, 16, dtype=torch.long), lazy, 1)
    dist.destroy_process_group()
"""


@pytest.mark.slow
def test_compiled_before_ddp_and_augmentation_flushed_in_lazy_mode(tmp_path):
    """Habana's order: torch.compile the network, then wrap it in DDP; in lazy mode the
    augmentation ends with mark_step, a graph of its own before the model's."""
    done, calls = _standin_run(tmp_path, _FORWARDS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["DistributedDataParallel", "OptimizedModule",
                                   "OptimizedModule"]
    assert [c["event"] for c in calls].count("mark_step") == 1


TINY_CHECK = ["--steps", "3", "--warmup", "1", "--batch", "2", "--size", "32", "--filters", "4",
              "--levels", "4"]


@pytest.mark.slow
def test_device_check_on_the_cpu_reports_every_run_and_passes(tmp_path):
    """The acceptance check a Gaudi user runs first, here on the CPU: one device and two
    (gloo under torch.distributed.run), each with img/s, compiles, mode and loss parity,
    its threads sized to the CPUs it is given (a pod's UNET_CPUS) and shared by its ranks.
    OMP_NUM_THREADS, which a parent sets as a child's share (and this test process may hold
    from an earlier test's set_threads), would take precedence, so it is not passed on."""
    report, temporary = tmp_path / "report.json", tmp_path / "tmp"
    temporary.mkdir()
    done = subprocess.run([sys.executable, "-m", "steps.device_check", "--device", "cpu",
                           "--devices", "2", "--json", str(report), *TINY_CHECK],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
                               "TMPDIR": str(temporary), "UNET_CPUS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    # the launcher left no folder of its own (torch's compile cache stays, for later runs)
    assert [p.name for p in temporary.iterdir() if not p.name.startswith("torchinductor_")] == []
    result = json.loads(report.read_text())
    assert result["ok"] and [r["devices"] for r in result["runs"]] == [1, 2]
    assert [r["threads"] for r in result["runs"]] == [1, 1]
    for run in result["runs"]:
        assert run["problems"] == [] and run["img_per_s"] > 0
        assert run["parity"] <= 1e-3 and run["compiles_end"] == run["compiles_warmup"]
    assert done.stdout.strip().endswith("device_check: ok (cpu)")


@pytest.mark.slow
def test_device_check_fails_on_losses_outside_the_parity_bound(tmp_path):
    """bf16 autocast against the fp32 reference with a bound no bf16 run can meet: the row
    says why and the check exits 1."""
    done = subprocess.run([sys.executable, "-m", "steps.device_check", "--device", "cpu",
                           "--precision", "bf16", "--parity", "1e-7", *TINY_CHECK],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    assert "first losses differ from fp32 CPU" in done.stdout
    assert done.stdout.strip().endswith("device_check: FAILED (cpu)")


def test_hpu_labels_are_augmented_as_int32_and_widened_for_the_loss(monkeypatch):
    """Gaudi's int64 support is limited (Intel Gaudi docs, "Best Practices for Model Training
    on Gaudi": int64 computations and indexes): the augmentation's index_copy_ sees int32."""
    from steps import train
    from steps.devices import DeviceInfo
    from steps.train import device_batch

    seen = []
    real = train.augment

    def spy(images, labels, *args, **kwargs):
        seen.append(labels.dtype)
        return real(images, labels, *args, **kwargs)

    monkeypatch.setattr(train, "augment", spy)
    images = torch.randn(4, 4, 16, 16)
    labels = torch.randint(0, 4, (4, 16, 16))
    hpu = DeviceInfo(kind="hpu", device=torch.device("cpu"), dtype=None, hpu_mode="compile")
    cpu = DeviceInfo(kind="cpu", device=torch.device("cpu"), dtype=None)
    _, out_hpu = device_batch(images.clone(), labels.clone(), hpu, 3)
    _, out_cpu = device_batch(images.clone(), labels.clone(), cpu, 3)
    assert seen == [torch.int32, torch.int64]
    assert out_hpu.dtype == out_cpu.dtype == torch.int64 and torch.equal(out_hpu, out_cpu)
