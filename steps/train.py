"""Train step: the anchors' 2D nnU-Net on HPUs, GPUs or CPU; resumable; writes ``model``.

    python -m steps.train --dataset DIR --model DIR [--device auto] [--devices N] ...

Reads the ``dataset`` artifact (steps.dataset), trains MONAI's DynUNet (steps.model) with
Dice + CE and deep supervision (steps.losses) on stateless 2D batches augmented on the device
(steps.sampler), validates per volume every epoch, checkpoints to ``--checkpoint-uri``
(steps.checkpoints) and publishes the ``model`` artifact:

    best.pt, last.pt     {"model_state", "model_config", "train_config", "metrics",
                          "dataset_manifest_sha256", "patch_size", "channels", "labels",
                          "format_version"}; torch.load(weights_only=True) loads them
    metrics.json         one record per epoch (loss, Dice per class and mean, img/s, ...)
    report/ (report.html, curves.png, overlays.png)
    argo-outputs/{mean_dice,best_epoch,img_per_s}   plain text, for Argo output parameters

``--devices N`` with N > 1 re-launches this module under ``torch.distributed.run`` (or is
launched by it: RANK / WORLD_SIZE in the environment). ``--nodes M`` > 1 is a multi-node
job whose every node runs torch.distributed.run itself; WORLD_SIZE is then M x N. Only rank 0
logs and writes.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from steps import compile_cache, devices, limits, params, schemas, uris
from steps.artifacts import check_disjoint, manifest_digest, publish, write_outputs
from steps.checkpoints import (CheckpointStore, best_name, check_finite, check_state,
                               serialize)
from steps.dataset import check_values, fold_names, open_cases, read_metadata
from steps.errors import StepError, run_main
from steps.losses import DeepSupervisionLoss, dice_per_class
from steps.model import ModelConfig, build_model
from steps.report import write_report
from steps.sampler import SliceSampler, StepDataset, augment, torch_seed

STEP = "train"
MODEL_FORMAT_VERSION = 1
N_OVERLAYS = 3
_CHECKED_ENV = "STEPS_TRAIN_INPUTS_CHECKED"   # set by relaunch: the parent hashed the dataset
RELAUNCH_STOP_S = 60  # how long the ranks get to stop (torchrun's own wait is 30 s, then SIGKILL)
# torch.distributed.run's main, with its way of ending on a signal (a SignalException raised
# through main, printed as a traceback) turned into the usual exit status 128 + signal; the
# ranks print the step's own "stopped by" line.
_LAUNCHER = """import sys
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main
try:
    main()
except SignalException as stop:
    sys.exit(128 + int(stop.sigval))
"""


# ------------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    """The artifact flags and every parameter of ``steps.params.TRAIN``, then the wiring."""
    p = params.step_parser(STEP, __doc__)
    p.add_argument("--nodes", type=int, default=1,
                   help="nodes of a multi-node job, each started by torch.distributed.run "
                        "(a PyTorchJob); WORLD_SIZE must be nodes x devices (default: 1)")
    p.add_argument("--checkpoint-uri", default="",
                   help="s3://bucket/prefix or a local directory for checkpoints; empty = none")
    return p


def check_args(args: argparse.Namespace) -> None:
    """What argparse cannot check alone: the node count, relations, and the URIs."""
    if args.nodes < 1:
        raise StepError(f"--nodes must be >= 1, got {args.nodes}")
    for name, problem in params.train_relations(args, args.nodes):
        raise StepError(f"--{name.replace('_', '-')} {problem}")
    params.check_uris(args, params.TRAIN)
    store = uris.parse(args.checkpoint_uri, "--checkpoint-uri", uris.CHECKPOINT_KINDS).path \
        if args.checkpoint_uri else None
    # --resume-from is only read (an earlier run's checkpoints): an input, which neither the
    # model nor this run's checkpoints (written, and pruned) may equal, hold or sit inside.
    resume = uris.parse(args.resume_from, "--resume-from", uris.CHECKPOINT_KINDS).path \
        if args.resume_from else None
    check_disjoint({"--model": args.model, "--checkpoint-uri": store},
                   {"--dataset": args.dataset, "--resume-from": resume})


def check_batch_memory(args: argparse.Namespace, meta: dict[str, Any]) -> None:
    """A host batch (float32 image and uint8 label patches, twice for the batch prepared
    ahead) must fit in memory before anything is allocated."""
    height, width = meta["patch_size"]
    per_slice = height * width * (4 * len(meta["channels"]) + 1)
    for flag, batch in (("--batch-size", args.batch_size),
                        ("--val-batch-size", args.val_batch_size)):
        limits.check_memory(2 * batch * per_slice,
                            f"{flag} {batch} of {height}x{width} patches")


# ------------------------------------------------------------------------ preflight

@dataclass
class Plan:
    """Everything decided before training: checked inputs, model config, resume source."""
    args: argparse.Namespace
    kind: str
    meta: dict[str, Any]
    train_names: list[str]
    val_names: list[str]
    model_config: Any
    resume_uri: str | None = None
    resume_state: dict[str, Any] | None = field(default=None, repr=False)


def model_config_for(args: argparse.Namespace, meta: dict[str, Any]):

    config = ModelConfig(in_channels=len(meta["channels"]), out_channels=len(meta["labels"]),
                         base_filters=args.base_filters, levels=args.levels, norm=args.norm,
                         deep_supervision=args.deep_supervision)
    multiple = config.size_multiple()
    height, width = meta["patch_size"]
    if height % multiple or width % multiple:
        raise StepError(f"patch_size {meta['patch_size']} of the dataset is not a multiple of "
                        f"{multiple} (2**(--levels - 1) with --levels {args.levels})")
    # A norm layer needs two values per channel to normalise (torch refuses one): the
    # deepest level sees (H/multiple) x (W/multiple), times the slices per device for batch.
    values = (height // multiple) * (width // multiple)
    if args.norm == "batch":
        values *= args.batch_size // (args.devices * args.nodes)
    if values < 2:
        raise StepError(f"--levels {args.levels}: the deepest level of a {height}x{width} "
                        f"patch is {height // multiple}x{width // multiple}, one value per "
                        f"channel for --norm {args.norm}; use fewer levels or a larger "
                        "patch_size")
    return config


def _resume_source(args: argparse.Namespace):
    """(uri, checkpoint) to start from: own latest (resume auto), else --resume-from."""
    if args.checkpoint_uri and args.resume == "auto":
        state = CheckpointStore(args.checkpoint_uri).load_latest()
        if state is not None:
            return args.checkpoint_uri, state
    if args.resume_from:
        state = CheckpointStore(args.resume_from).load_latest()
        if state is None:
            raise StepError(f"--resume-from {args.resume_from}: no checkpoint found there")
        return args.resume_from, state
    return None, None


def check_resumable(state: dict[str, Any], config, args: argparse.Namespace,
                    uri: str) -> None:
    """A checkpoint this run can continue: its schema, the same network with weights of
    the right shapes, and the same fold (another fold's training cases are validation
    cases here)."""

    where = f"checkpoint at {uri}"
    schemas.validate(schemas.HasNetwork, state, where)   # another network is named as such
    check_compatible(state, config, uri)
    schemas.validate(schemas.TrainCheckpoint, state, where)
    fold = state["train_config"].get("fold", 0)
    if fold != args.fold:
        raise StepError(f"--fold {args.fold}: the checkpoint at {uri} trained on fold {fold}; "
                        "resuming it would validate on its training cases")
    check_state(build_model(config).state_dict(), state["model_state"],
                f"checkpoint at {uri}: model_state")


def check_compatible(state: dict[str, Any], config, uri: str) -> None:
    saved = state.get("model_config")
    if saved != config.to_dict():
        diff = sorted(k for k in config.to_dict() if (saved or {}).get(k) != config.to_dict()[k])
        key = diff[0] if diff else "model_config"
        raise StepError(f"checkpoint at {uri} is incompatible: it was trained with {key}="
                        f"{(saved or {}).get(key)!r}, this run has {key}="
                        f"{config.to_dict().get(key)!r}")


def preflight(args: argparse.Namespace) -> Plan:
    """Every check that can fail on bad input, before any device or process is started."""
    check_args(args)
    kind = devices.resolve_kind(args.device, args.hpu_mode)
    if kind != "cpu" and devices.available_count(kind) < args.devices:
        raise StepError(f"--devices {args.devices}: only {devices.available_count(kind)} "
                        f"{kind} device(s) present")
    devices.autocast_dtype(kind, args.precision)
    if args.optimizer == "fusedadamw":
        devices.check_fused_optimizer(kind)
    rank, world, _ = dist_env()
    meta = read_metadata(args.dataset, check_hashes=rank == 0 and
                         os.environ.get(_CHECKED_ENV) != "1")
    train_names, val_names = fold_names(meta, args.fold)
    if not train_names or not val_names:
        raise StepError(f"--fold {args.fold}: the dataset's fold has {len(train_names)} "
                        f"training and {len(val_names)} validation cases; training needs "
                        f"both (at least 2 cases, the dataset has {len(meta['cases'])})")
    check_batch_memory(args, meta)
    cases = open_cases(args.dataset, meta, train_names + val_names)
    if rank == 0 and os.environ.get(_CHECKED_ENV) != "1":
        check_values(cases, len(meta["labels"]))
    model_dir = Path(args.model)
    if model_dir.exists() and (not model_dir.is_dir() or any(model_dir.iterdir())):
        raise StepError(f"--model {model_dir} must be an empty or absent directory")
    config = model_config_for(args, meta)
    uri, state = _resume_source(args)
    if state is not None:
        check_resumable(state, config, args, uri)
    return Plan(args, kind, meta, train_names, val_names, config, uri, state)


# ----------------------------------------------------------------------- DDP launch

def dist_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torch.distributed.run's environment."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


def relaunch(argv: Sequence[str], nproc: int) -> int:
    """Run this step again under torch.distributed.run with ``nproc`` processes, each
    with an equal share of this step's threads (``OMP_NUM_THREADS``), so that together
    they use the CPUs the pod has (``limits.threads``), not the node's cores.

    Stopped (SIGTERM, Ctrl-C) or failing here, this process passes SIGTERM on to the launcher,
    which passes it to every rank (torch.distributed.elastic's agent: ``SignalException`` ->
    ``_shutdown``), and waits for them: the ranks clean up as a stopped step does, and no rank
    outlives the step (a plain kill of the launcher would orphan them).

    The launcher's folder for the ranks' error files is one this call removes: left to itself
    it makes a ``torchelastic_*`` folder in the temporary directory and never removes it
    (torch 2.13 ``distributed/elastic/multiprocessing/api.py``, ``DefaultLogsSpecs``)."""
    env = dict(os.environ)
    env[_CHECKED_ENV] = "1"
    env["OMP_NUM_THREADS"] = str(max(1, limits.threads() // nproc))
    with tempfile.TemporaryDirectory(prefix="unet-train-ranks-") as logs:
        launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, "--standalone",
                                     f"--nproc_per_node={nproc}", f"--log-dir={logs}",
                                     "-m", "steps.train", *argv], env=env)
        try:
            return launcher.wait()
        except BaseException:
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(timeout=RELAUNCH_STOP_S)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()
            raise


def loader_workers(requested: int) -> int:
    """DataLoader workers of this rank: ``--num-workers``, at most the rank's share of the
    step's CPUs less the one its training process uses (``limits.cpu_count`` over
    ``LOCAL_WORLD_SIZE``): more workers than CPUs only take turns on them."""
    share = limits.cpu_count() // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(0, min(requested, share - 1))


# --------------------------------------------------------------------------- RNG state

def rng_state(info: devices.DeviceInfo) -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
             "python_version": random.getstate()[0], "python_gauss": random.getstate()[2],
             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    if info.kind == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], info: devices.DeviceInfo) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if info.kind == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------- validation

# A validation pass's (H, W) is rounded up to this grid (or the network's size multiple, when
# coarser) where shapes may vary: the kernels and buffers cached per input shape (oneDNN's
# primitives on a CPU, cuDNN's plans) then follow a few shapes, not every crop the data holds.
# Measured on the 2-core AMD EPYC (levels 4, 120 volumes of 120-190 pixels a side, one thread):
# at a grid of 8, 64 shapes, anonymous memory +55 MiB over the run, 42.7 s; at 32, 9 shapes,
# +10 MiB, 48.8 s (the padding's pixels); at 64, 4 shapes, +4 MiB, 61.8 s.
VAL_GRID = 32


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pass_shape(height: int, width: int, multiple: int) -> tuple[int, int]:
    """The (H, W) a validation slice of ``height`` x ``width`` is padded to without a static
    shape: rounded up to :data:`VAL_GRID`, or to ``multiple`` where that is coarser."""
    grid = max(VAL_GRID, multiple)
    return _round_up(height, grid), _round_up(width, grid)


def _pad_to(x: torch.Tensor, rows: int, shape: tuple[int, int],
            fill: torch.Tensor) -> torch.Tensor:
    """(n, C, h, w) → (rows, C, *shape) at the bottom/right, the new area filled with
    ``fill`` (C,); ``x`` itself when there is nothing to add."""
    if (rows, *shape) == (x.shape[0], *x.shape[2:]):
        return x
    out = fill.view(1, -1, 1, 1).expand(rows, x.shape[1], *shape).clone()
    out[:x.shape[0], :, :x.shape[2], :x.shape[3]] = x
    return out


def static_shape(cases, multiple: int) -> tuple[int, int]:
    """The largest (H, W) over ``cases``, rounded up to ``multiple``: one shape for every
    validation forward pass on a graph-compiling device."""
    return (_round_up(max(case.image.shape[2] for case in cases), multiple),
            _round_up(max(case.image.shape[3] for case in cases), multiple))


def slices_per_pass(batch: int, patch: tuple[int, int] | None,
                    target: tuple[int, int]) -> int:
    """Slices of ``target`` (H, W) in one validation forward pass: ``batch`` patches' worth
    of pixels (what check_batch_memory sized), at least one and at most ``batch``. A pass's
    activations grow with its pixels, so train's memory is set by its flags, not by the
    largest slice a dataset happens to hold; ``patch`` None: ``batch`` slices."""
    if patch is None:
        return batch
    return max(1, min(batch, batch * patch[0] * patch[1] // (target[0] * target[1])))


@torch.no_grad()
def predict_volume(forward, image: np.ndarray, info: devices.DeviceInfo, batch: int,
                   multiple: int, shape: tuple[int, int] | None = None,
                   patch: tuple[int, int] | None = None) -> torch.Tensor:
    """2D inference over every slice: image (C, D, H, W) → argmax labels (D, H, W) on CPU.

    With ``shape`` every forward pass is (batch, C, *shape): slices padded to it and the last
    batch filled up with background, as Habana's reference pads its validation (a new input
    shape is a new graph compile on an HPU); without, slices are padded to a coarse grid
    (:func:`pass_shape`), and a pass holds at most ``batch`` slices of ``patch`` (H, W) in
    pixels (:func:`slices_per_pass`).
    """
    channels, depth, height, width = image.shape
    fill = torch.from_numpy(np.asarray(image[:, 0:1], dtype=np.float32)
                            .reshape(channels, -1).min(axis=1))
    target = shape or pass_shape(height, width, multiple)
    if shape is None:
        batch = slices_per_pass(batch, patch, target)
    preds = []
    for start in range(0, depth, batch):
        x = torch.from_numpy(np.ascontiguousarray(
            np.asarray(image[:, start:start + batch], dtype=np.float32).transpose(1, 0, 2, 3)))
        n = x.shape[0]
        x = _pad_to(x, batch if shape else n, target, fill)
        with info.autocast():
            logits = forward(devices.to_device(x, info))
        preds.append(logits[:n, :, :height, :width].argmax(dim=1).to("cpu", torch.uint8))
        devices.mark_step(info)
    return torch.cat(preds)


def evaluate(forward, cases, info, batch: int, multiple: int, n_classes: int,
             rank: int, world: int, shape: tuple[int, int] | None = None,
             patch: tuple[int, int] | None = None) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Mean per-class Dice over the validation volumes (shared out over ranks).

    Returns (n_classes - 1,) float64 Dice and, on rank 0, a few overlay samples.
    """

    totals = torch.zeros(n_classes, dtype=torch.float64)  # per-class sums, then count
    samples = []
    for index in range(rank, len(cases), world):
        case = cases[index]
        pred = predict_volume(forward, case.image, info, batch, multiple, shape, patch)
        truth = torch.from_numpy(np.array(case.label))
        totals[:-1] += dice_per_class(pred, truth, n_classes)
        totals[-1] += 1
        if rank == 0 and len(samples) < N_OVERLAYS:
            # the slice with most foreground, counted a slice at a time (no volume-sized
            # int64 temporaries: see losses.DICE_CHUNK_VOXELS)
            counts = [int(torch.count_nonzero(axial)) for axial in truth]
            z = counts.index(max(counts))
            samples.append({"case": case.name, "slice": z,
                            "image": np.asarray(case.image[0, z], dtype=np.float32),
                            "truth": truth[z].numpy().copy(),
                            "prediction": pred[z].numpy().copy()})
        del pred, truth           # this volume's buffers, before the next one's size
        limits.release_freed_memory()
    if world > 1:
        reduced = totals.to(info.device if info.backend != "gloo" else "cpu")
        dist.all_reduce(reduced)
        totals = reduced.cpu()
    return totals[:-1] / totals[-1].clamp(min=1), samples


# ------------------------------------------------------------------------- training

def lr_factor(step: int, total: int, schedule: str = "cosine") -> float:
    """The learning rate's factor at ``step``: cosine decay from 1 to 0 over ``total`` steps,
    or 1 throughout (``constant``)."""
    if schedule == "constant":
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * min(step, total) / max(total, 1)))


def forwards(net: torch.nn.Module, info: devices.DeviceInfo, world: int,
             compile_cuda: bool = False, cuda_mode: str = "default", layout_opt: bool = False):
    """(train, eval) callables: the network compiled first and then wrapped in DDP, as
    Habana's reference orders them. Validation uses the compiled network unwrapped on an
    HPU (one static validation shape) and the plain network on CUDA, where every volume's
    own size would be a new compilation."""
    compiled = devices.compile_for_device(net, info, compile_cuda, cuda_mode, layout_opt)
    train_forward = devices.wrap_ddp(compiled, info) if world > 1 else compiled
    return train_forward, (net if info.kind == "cuda" else compiled)


def device_batch(images: torch.Tensor, labels: torch.Tensor, info: devices.DeviceInfo,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A host batch (images (N, C, H, W) float32, labels (N, H, W) uint8) on the device,
    augmented there; in lazy mode the augmentation is flushed as a graph of its own, so the
    model's graph stays one shape step after step. The labels are widened on the device:
    to int32 on an HPU for the augmentation (Gaudi's int64 support is limited, its
    best-practice guide says), and to int64 for the loss."""

    on_device = devices.host_to_device(labels, info.device,
                                       torch.int32 if info.kind == "hpu" else torch.long)
    images, labels = augment(devices.to_device(images, info), on_device, seed,
                             devices.device_generator(info, seed), inplace=True)
    devices.mark_step(info)
    return images, labels.long()


def device_batches(batches, first_step: int, info: devices.DeviceInfo, seed: int,
                   rank: int):
    """:func:`device_batch` of each host batch, for steps ``first_step`` onwards.

    On CUDA the next batch's copy and augmentation are queued on a side stream before the
    current batch is handed over, so they run while the current step computes; the training
    stream waits on that batch's event alone, and the batch's memory is recorded as in use
    there (``Tensor.record_stream``) so the side stream cannot reuse it too early."""
    steps = itertools.count(first_step)
    if info.kind != "cuda":
        for step, (images, labels) in zip(steps, batches):
            yield device_batch(images, labels, info, torch_seed(seed, step, rank))
        return
    side, main = torch.cuda.Stream(info.device), torch.cuda.current_stream(info.device)
    ahead = None
    for step, (images, labels) in zip(steps, batches):
        with torch.cuda.stream(side):
            made = device_batch(images, labels, info, torch_seed(seed, step, rank))
            made = (made, side.record_event())
        if ahead is not None:
            yield _hand_over(ahead, main)
        ahead = made
    if ahead is not None:
        yield _hand_over(ahead, main)


def _hand_over(made, stream):
    """The side stream's ``(tensors, event)`` made usable on ``stream``."""
    tensors, event = made
    stream.wait_event(event)
    for tensor in tensors:
        tensor.record_stream(stream)
    return tensors


def train_step(forward, loss_fn, optimizer, scheduler, scaler, info: devices.DeviceInfo,
               images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One optimizer step on a device batch: images (N, C, H, W), labels (N, H, W)."""
    optimizer.zero_grad(set_to_none=True)
    with info.autocast():
        logits = forward(images)
    loss = loss_fn(logits.float(), labels)
    scaler.scale(loss).backward()
    devices.mark_step(info)
    scaler.step(optimizer)
    scaler.update()
    devices.mark_step(info)
    scheduler.step()
    return loss.detach()


def cpu_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


@dataclass
class Progress:
    """Training position and history: what a checkpoint needs besides module states."""
    epoch: int = 0                # completed epochs
    step: int = 0                 # completed global steps
    epoch_loss: float = 0.0       # loss sum over this epoch's completed steps
    epoch_steps: int = 0
    best_dice: float = -1.0
    best_epoch: int = 0
    stale_epochs: int = 0
    history: list = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def model_payload(plan: Plan, state: dict[str, torch.Tensor],
                  metrics: dict[str, Any]) -> dict[str, Any]:
    """The ``best.pt`` / ``last.pt`` dict: plain types only."""
    meta = plan.meta
    return {"model_state": state, "model_config": plan.model_config.to_dict(),
            "train_config": train_config(plan.args), "metrics": metrics,
            "dataset_manifest_sha256": manifest_digest(plan.args.dataset),
            "patch_size": [int(s) for s in meta["patch_size"]],
            "channels": list(meta["channels"]), "labels": dict(meta["labels"]),
            "format_version": MODEL_FORMAT_VERSION}


def train_config(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("dataset", "model")}


class Trainer:
    """Holds the device, model, optimizer and checkpoint store of one process."""

    def __init__(self, plan: Plan, rank: int, world: int, local_rank: int):

        args = self.args = plan.args
        self.plan, self.rank, self.world = plan, rank, world
        self.info = devices.select_device(plan.kind, args.precision, args.hpu_mode, local_rank,
                                          args.cuda_channels_last)
        if world > 1:
            devices.init_distributed(self.info)
        devices.configure_backends(self.info)
        torch.manual_seed(args.seed)   # identical initial weights on every rank
        self.n_classes = len(plan.meta["labels"])
        self.multiple = plan.model_config.size_multiple()
        train_cases = open_cases(args.dataset, plan.meta, plan.train_names)
        self.val_cases = open_cases(args.dataset, plan.meta, plan.val_names)
        self.local_batch = args.batch_size // world
        self.sampler = SliceSampler(train_cases, tuple(plan.meta["patch_size"]),
                                    self.local_batch, args.seed)
        self.steps_per_epoch = args.steps_per_epoch or max(
            1, self.sampler.n_slices // (self.local_batch * world))
        self.total_steps = self.steps_per_epoch * args.max_epochs

        self.net = devices.prepare_model(build_model(plan.model_config), self.info)
        self.train_forward, self.eval_forward = forwards(self.net, self.info, world,
                                                         args.cuda_compile,
                                                         args.cuda_compile_mode,
                                                         args.cuda_layout_opt)
        self.val_shape = static_shape(self.val_cases, plan.model_config.size_multiple()) \
            if self.info.kind == "hpu" else None
        self.loss_fn = DeepSupervisionLoss()
        if self.info.kind == "cuda":   # its softmax, one-hot and sums over 3 heads fuse
            self.loss_fn = devices.compile_for_device(self.loss_fn, self.info,
                                                      args.cuda_compile)
        self.optimizer = devices.make_optimizer(args.optimizer, self.net.parameters(),
                                                args.learning_rate, args.weight_decay,
                                                self.info)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, self.total_steps, args.lr_schedule))
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.info.needs_grad_scaler())
        self.store = CheckpointStore(args.checkpoint_uri) if args.checkpoint_uri else None
        self.compile_cache = compile_cache.CompileCache(
            self.store, self.info, {**plan.model_config.to_dict(), "batch": self.local_batch,
                                    "patch": list(plan.meta["patch_size"]),
                                    "mode": args.cuda_compile_mode,
                                    "layout_opt": args.cuda_layout_opt}) \
            if self.store is not None and args.compile_cache and self.compiles() else None
        self.first_step_s = None      # this process's first step, compilation included
        self.progress = Progress()
        self.batches = None           # the run's batch iterator, made at its first epoch
        self.best_state = None
        if plan.resume_state is not None:
            self._restore(plan.resume_state, plan.resume_uri)

    # -- checkpoints ----------------------------------------------------------------------
    def _checkpoint_state(self) -> dict[str, Any]:
        best = self.progress.best_epoch
        return {"model_config": self.plan.model_config.to_dict(),
                "model_state": cpu_state(self.net),
                "optimizer_state": self.optimizer.state_dict(),
                "scheduler_state": self.scheduler.state_dict(),
                "scaler_state": self.scaler.state_dict(),
                "progress": self.progress.to_dict(), "rng": rng_state(self.info),
                "best_file": best_name(best) if best else None,
                "threads": torch.get_num_threads(),
                "train_config": train_config(self.args), "format_version": 1}

    def save_checkpoint(self) -> None:
        if self.store is not None and self.rank == 0:
            self.store.save(self._checkpoint_state(), self.progress.step)

    def _restore(self, state: dict[str, Any], uri: str) -> None:
        """Continue from a checkpoint that passed check_resumable; what its schema cannot
        see (optimizer and RNG internals) fails here as one line."""
        self.net.load_state_dict(state["model_state"])
        try:
            self.optimizer.load_state_dict(state["optimizer_state"])
            self.scheduler.load_state_dict(state["scheduler_state"])
            if state.get("scaler_state"):
                self.scaler.load_state_dict(state["scaler_state"])
            set_rng_state(state["rng"], self.info)
        except (KeyError, ValueError, TypeError, RuntimeError) as exc:
            raise StepError(f"checkpoint at {uri} cannot be restored "
                            f"({type(exc).__name__}: {exc})") from None
        known = Progress().to_dict()
        self.progress = Progress(**{k: v for k, v in state["progress"].items() if k in known})
        self._restore_threads(state.get("threads"))
        if state.get("best_file"):
            where = f"checkpoint {state['best_file']} at {uri}"
            best = CheckpointStore(uri).load(state["best_file"])
            schemas.validate(schemas.BestWeights, best, where)
            check_state(self.net.state_dict(), best["model_state"], where)
            self.best_state = best["model_state"]
            if self.store is not None and self.rank == 0 and uri != self.args.checkpoint_uri:
                # This run's checkpoints name the best file until an epoch beats it: it must
                # be in this run's store, which a later resume reads alone.
                self.store.write_bytes(state["best_file"], serialize(
                    {"model_state": best["model_state"], "epoch": best["epoch"]}))
        if self.rank == 0:
            print(f"resumed from {uri} at epoch {self.progress.epoch}, step "
                  f"{self.progress.step}", file=sys.stderr)

    def _restore_threads(self, saved: int | None) -> None:
        """A CPU run with a fixed thread count (``UNET_ADAPT_THREADS=0``) goes on with the
        count it was checkpointed with, whatever this pod has: the count orders the float
        sums, so this is what keeps a resumed run bitwise the uninterrupted one. An adaptive
        run follows the free CPUs instead (docs/design.md, CPU share beside other work)."""
        if self.info.kind != "cpu" or limits.adapting() or saved in (None, torch.get_num_threads()):
            return
        if self.rank == 0:
            print(f"train: {saved} thread(s), as the checkpoint ran, instead of "
                  f"{torch.get_num_threads()} ({limits.ADAPT_ENV}=0 keeps a run's count)",
                  file=sys.stderr)
        limits.set_threads(saved)

    def compiles(self) -> bool:
        """Whether the training step runs through Inductor (torch.compile on CUDA)."""
        return self.info.kind == "cuda" and self.args.cuda_compile

    # -- loop -----------------------------------------------------------------------------
    def _loader(self, first_step: int, n_steps: int):
        """Batches of steps ``first_step`` onwards: one loader for the rest of the run, so
        its workers start once and keep building batches while validation runs."""

        dataset = StepDataset(self.sampler, first_step, n_steps, self.rank)
        workers = loader_workers(self.args.num_workers)
        if workers < self.args.num_workers and self.rank == 0:
            print(f"train: {workers} DataLoader worker(s) instead of --num-workers "
                  f"{self.args.num_workers}: the step has {limits.cpu_count()} CPU(s) for "
                  f"{os.environ.get('LOCAL_WORLD_SIZE', 1)} rank(s)", file=sys.stderr)
        return torch.utils.data.DataLoader(dataset, batch_size=None, shuffle=False,
                                           num_workers=workers,
                                           pin_memory=self.info.kind == "cuda")

    def run_epoch(self) -> dict[str, Any]:
        """Train to the end of the current epoch (from mid-epoch after a resume)."""

        args, info, p = self.args, self.info, self.progress
        done = p.step - p.epoch * self.steps_per_epoch
        remaining = self.steps_per_epoch - done
        bar = tqdm(total=self.steps_per_epoch, initial=done, file=sys.stderr,
                   desc=f"epoch {p.epoch + 1}/{args.max_epochs}", unit="step",
                   disable=self.rank != 0, dynamic_ncols=True, mininterval=1.0)
        start = last_ckpt = time.monotonic()
        images_done = 0
        loss_sum = torch.zeros((), device=info.device)
        if self.batches is None:
            if self.compile_cache is not None:
                self.compile_cache.load()
            self.batches = device_batches(self._loader(p.step, self.total_steps - p.step),
                                          p.step, info, args.seed, self.rank)
        threads = {torch.get_num_threads()}
        for images, labels in itertools.islice(self.batches, remaining):
            if self.first_step_s is None:
                first = time.monotonic()
            loss = train_step(self.train_forward, self.loss_fn, self.optimizer, self.scheduler,
                              self.scaler, info, images, labels)
            if info.kind == "cpu":
                limits.retune_threads()
                threads.add(torch.get_num_threads())
            if self.first_step_s is None:
                self._first_step_done(first)
            loss_sum += loss
            p.step += 1
            p.epoch_steps += 1
            images_done += self.local_batch * self.world
            bar.update(1)
            bar.set_postfix_str(f"{images_done / (time.monotonic() - start):.1f} img/s", refresh=False)
            if args.checkpoint_minutes and p.step < (p.epoch + 1) * self.steps_per_epoch and \
                    time.monotonic() - last_ckpt >= 60 * args.checkpoint_minutes:
                p.epoch_loss += float(loss_sum)
                loss_sum.zero_()
                self.save_checkpoint()
                last_ckpt = time.monotonic()
        devices.synchronize(info)
        seconds = time.monotonic() - start
        bar.close()
        p.epoch_loss += float(loss_sum)
        if self.world > 1:
            total = torch.tensor([p.epoch_loss], dtype=torch.float64,
                                 device=info.device if info.backend != "gloo" else "cpu")
            dist.all_reduce(total)
            p.epoch_loss = float(total) / self.world
        return {"loss": p.epoch_loss / max(p.epoch_steps, 1),
                "img_per_s": images_done / max(seconds, 1e-9), "seconds": seconds,
                "threads": sorted(threads)}

    def _first_step_done(self, started: float) -> None:
        """Time the first step (compilation and cuDNN's tuning included) and keep the
        compile cache it filled."""
        devices.synchronize(self.info)
        self.first_step_s = time.monotonic() - started
        cache = self.compile_cache
        if cache is not None and self.rank == 0 and not cache.restored:
            cache.save()
        if self.rank == 0:
            print(f"train: first step {self.first_step_s:.1f} s (compile cache "
                  f"{self.compile_cache_state()})", file=sys.stderr)
            if self.compiles():
                phases = ", ".join(f"{k} {v} s"
                                   for k, v in compile_cache.phase_seconds().items())
                print(f"train: compilation: {phases}", file=sys.stderr)

    def compile_cache_state(self) -> str:
        """What this process did with the compile cache: off, restored, saved, not saved."""
        cache = self.compile_cache
        return "off" if cache is None else "restored" if cache.restored else \
            "saved" if cache.saved else "not saved"

    def validate(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        self.net.eval()
        dice, samples = evaluate(self.eval_forward, self.val_cases, self.info,
                                 self.args.val_batch_size, self.multiple, self.n_classes,
                                 self.rank, self.world, self.val_shape,
                                 tuple(self.plan.meta["patch_size"]))
        self.net.train()
        classes = [str(c) for c in range(1, self.n_classes)]
        return ({"dice": {c: float(d) for c, d in zip(classes, dice)},
                 "mean_dice": float(dice.mean())}, samples)

    def fit(self) -> list[dict[str, Any]]:
        """Epochs until max_epochs or early stopping; returns the validation overlay samples."""
        args, p = self.args, self.progress
        samples: list[dict[str, Any]] = []
        validated = False
        self.net.train()
        while p.epoch < args.max_epochs and not self._should_stop():
            train = self.run_epoch()
            scores = {}
            if p.epoch >= args.skip_first_n_eval:
                scores, samples = self.validate()
                validated = True
            p.epoch += 1
            record = {"epoch": p.epoch, "step": p.step, **train, **scores,
                      "lr": self.optimizer.param_groups[0]["lr"], "device": self.info.kind,
                      "precision": self.info.precision, "world_size": self.world,
                      "batch_size": self.local_batch * self.world}
            p.history.append(record)
            if scores:
                self._update_best(record)
            p.epoch_loss, p.epoch_steps = 0.0, 0
            self.save_checkpoint()
            if self.rank == 0:
                dice = f"mean Dice {record['mean_dice']:.4f}" if scores else "not validated"
                print(f"epoch {p.epoch}: loss {record['loss']:.4f} {dice} "
                      f"{record['img_per_s']:.1f} img/s", file=sys.stderr)
        self.batches = None   # stops the loader's workers (early stopping leaves batches)
        if not validated:   # resumed after the last epoch: validate once for the overlays
            _, samples = self.validate()
        return samples

    def _update_best(self, record: dict[str, Any]) -> None:
        p = self.progress
        if record["mean_dice"] > p.best_dice:
            p.best_dice, p.best_epoch, p.stale_epochs = record["mean_dice"], p.epoch, 0
            self.best_state = cpu_state(self.net)
            if self.store is not None and self.rank == 0:
                self.store.write_bytes(best_name(p.epoch), serialize(
                    {"model_state": self.best_state, "epoch": p.epoch}))
        else:
            p.stale_epochs += 1

    def _should_stop(self) -> bool:
        p, args = self.progress, self.args
        return (args.patience > 0 and p.epoch >= args.min_epochs
                and p.stale_epochs >= args.patience)


def write_model(plan: Plan, trainer: Trainer, samples: list[dict[str, Any]]) -> None:
    """Publish the ``model`` artifact (rank 0)."""

    p = trainer.progress
    history = p.history
    best = next(r for r in history if r["epoch"] == p.best_epoch)
    last = history[-1]
    labels = {k: v for k, v in plan.meta["labels"].items() if k != "0"}
    last_state = cpu_state(trainer.net)
    for name, state in (("best.pt", trainer.best_state), ("last.pt", last_state)):
        check_finite(state, f"--model {plan.args.model}: {name}")
    metrics = {"epochs": history, "best_epoch": p.best_epoch, "best_mean_dice": p.best_dice,
               "best_dice": best["dice"], "device": trainer.info.kind,
               "precision": trainer.info.precision, "world_size": trainer.world,
               "steps_per_epoch": trainer.steps_per_epoch, "fold": plan.args.fold,
               "first_step_s": trainer.first_step_s,
               "threads_adaptive": limits.adapting(),
               "compile_cache": trainer.compile_cache_state(),
               "compile_cache_load_s": trainer.compile_cache.load_s
               if trainer.compile_cache is not None else 0.0}
    with publish(plan.args.model, "model", STEP, train_config(plan.args)) as out:
        torch.save(model_payload(plan, trainer.best_state, {**metrics, "epoch": best}),
                   out / "best.pt")
        torch.save(model_payload(plan, last_state, {**metrics, "epoch": last}),
                   out / "last.pt")
        schemas.write_json(out / "metrics.json", metrics)
        write_report(out / params.REPORT_FOLDER, metrics, labels, samples)
        write_outputs(out, STEP, {"mean_dice": f"{p.best_dice:.4f}",
                                  "best_epoch": str(p.best_epoch),
                                  "img_per_s": f"{last['img_per_s']:.1f}"})


def train(plan: Plan) -> int:
    rank, world, local_rank = dist_env()
    trainer = Trainer(plan, rank, world, local_rank)
    try:
        samples = trainer.fit()
        if rank == 0:
            write_model(plan, trainer, samples)
    finally:
        if world > 1:
            if dist.is_initialized():
                dist.destroy_process_group()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    limits.set_threads()
    rank, world, _ = dist_env()
    if world > 1 and args.devices * args.nodes != world:
        raise StepError(f"--devices {args.devices} x --nodes {args.nodes} does not match "
                        f"WORLD_SIZE {world} of torch.distributed.run")
    if args.nodes > 1 and world == 1:
        raise StepError(f"--nodes {args.nodes}: every node must be started by "
                        "torch.distributed.run (a PyTorchJob), none was")
    plan = preflight(args)
    if args.devices > 1 and world == 1:
        plan.resume_state = None   # the workers load it themselves
        return relaunch(argv, args.devices)
    return train(plan)


if __name__ == "__main__":
    sys.exit(run_main(main))
