"""11. The GPU path: ``steps.train``'s own loop on a CUDA card, its settings against each
other in interleaved rounds, where the time goes, and the MONAI loop on the same card.

- **Variants** (:data:`VARIANTS`): each a ``steps.train`` command line (the default, the
  previous default, and one lever changed at a time), each in its own process holding the
  real ``Trainer`` of ``steps.train`` with its DataLoader workers, pinned memory, side-stream
  prefetch, device-side augmentation and train step. The processes warm up together (a
  first epoch: workers start, cuDNN tunes, torch.compile compiles; one that is not ready by
  the budget's warm-up share is left out, with that reason), then take turns: each round
  every variant runs one timed epoch (**end to end**, data included) and then the same
  number of steps on one prepared batch (**compute only**), the order rotated every round.
  Medians and every round are reported. The time the GPU waits for input is measured with
  CUDA events: one recorded before the loop asks its loader for the next batch, one as the
  batch arrives; the gap between them is time the GPU sat idle because the host waited.
- **Profile** (:func:`profile_table`): one epoch of the default and of the previous default
  under ``torch.profiler``, the top kernels and operators by GPU time.
- **Train step** (``benchmarks.trainstep.gpu_rows``) and **loader**
  (``benchmarks.loader.device_rows``), when the budget leaves time: ours against the MONAI
  loop at batch 64 and the augmentation alone on the device.

Baseline of the headline rows: NVIDIA's published nnU-Net 2D figure (1238.68 img/s, 1x A100
80G, AMP, batch 64); their targets are issue 50's (5,000 img/s on an H200, 4,000 on an
H100, end to end within 5 % of compute only). Settings from the environment:
``UNET_GPU_BUDGET_S`` (default 420) bounds the whole benchmark's wall time, so it fits a
lent machine's call; ``UNET_GPU_ROUNDS`` and ``UNET_GPU_EPOCH_STEPS`` size the rounds
(:func:`round_sizes`);
``UNET_GPU_ROUNDS_FILE`` names a JSON file rewritten after every round with what is measured
so far, so a call that runs out of time still returns its rounds. With ``--smoke`` the same
code runs on the CPU with tiny shapes and two variants (the rows say so); the events are then
absent.
"""
from __future__ import annotations

import itertools
import json
import math
import multiprocessing
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from benchmarks import loader, trainstep
from benchmarks.common import Row, Settings, dataset_dir, gpu_rows_device, step_env
from benchmarks.trainstep import NVIDIA_A100_AMP_IMG_S, NVIDIA_CARD
from emulator.s3target import environ
from steps import devices, train

PROFILE_WORKERS = 8          # the cuda_1gpu profile's pod has 8 CPUs (config/pipeline.yaml)
DEFAULT, BEFORE = "default", "contiguous"
# issue 50: the default path end to end on one card (issue 36's 2,500 on any other card)
TARGET_IMG_S = {"H200": 5000.0, "H100": 4000.0}
OTHER_CARD_TARGET_IMG_S = 2500.0
TARGET_OF_COMPUTE = 0.95     # issue 50: end to end within 5 % of the compute-only rate
# name: (what it is, its steps.train flags beside the defaults, cuDNN's autotuner on). The
# default is torch.compile mode reduce-overhead (CUDA graphs) with Inductor's layout
# optimization forced (channels_last around every convolution), AdamW; each other variant
# changes one thing. "contiguous" is the default before issue 50, "eager" before issue 36.
# Not here: max-autotune-no-cudagraphs (--cuda-compile-mode), whose Triton autotuning of
# every convolution does not fit a lent machine's call beside the others.
VARIANTS = {
    DEFAULT: ("the default", [], True),
    BEFORE: ("contiguous in the compiled step (the default before)",
             ["--cuda-layout-opt", "false"], True),
    "eager": ("eager", ["--cuda-compile", "false"], True),
    "mode-default": ("torch.compile mode default (no CUDA graphs)",
                     ["--cuda-compile-mode", "default"], True),
    "channels-last": ("channels_last batches and weights",
                      ["--cuda-channels-last", "true"], True),
    "eager-channels-last": ("eager, channels_last layout",
                            ["--cuda-compile", "false", "--cuda-channels-last", "true"], True),
    "fused-adamw": ("fused AdamW", ["--optimizer", "fusedadamw"], True),
    "batch-128": ("batch 128, half the steps", ["--batch-size", "128"], True),
    # the three levers together (2026-11-29 on an H200: 1.14x end to end, but batch 128 at
    # half the steps learned less on the same samples; benchmarks/README.md)
    "cl-fused-128": ("channels_last weights and batches, fused AdamW, batch 128",
                     ["--cuda-channels-last", "true", "--optimizer", "fusedadamw",
                      "--batch-size", "128"], True),
    "cudnn-heuristics": ("cuDNN's heuristics (its autotuner off)", [], False),
    "fp16-eager": ("fp16 with its GradScaler, eager",
                   ["--precision", "fp16", "--cuda-compile", "false"], True),
}
SMOKE_VARIANTS = (DEFAULT, BEFORE)


def target_img_s(card: str) -> float:
    """The default's end-to-end bound on ``card`` (a name as torch gives it)."""
    return next((v for k, v in TARGET_IMG_S.items() if k in card), OTHER_CARD_TARGET_IMG_S)


def chosen_variants(smoke: bool) -> tuple[str, ...]:
    """``UNET_GPU_VARIANTS`` (comma-separated names of :data:`VARIANTS`), else all of them
    (with ``--smoke``: the default and the previous default)."""
    names = tuple(n for n in os.environ.get("UNET_GPU_VARIANTS", "").split(",") if n)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"UNET_GPU_VARIANTS: unknown variant {unknown[0]!r} "
                         f"(known: {', '.join(VARIANTS)})")
    return names or (SMOKE_VARIANTS if smoke else tuple(VARIANTS))


def _trainer_class():
    """``steps.train.Trainer`` with its loader timed (imported late: the parent process of
    the benchmarks never imports torch's CUDA state)."""

    class InputTimedTrainer(train.Trainer):
        waits: list

        def _loader(self, first_step: int, n_steps: int):
            return self._timed(super()._loader(first_step, n_steps))

        def _mark(self):
            if self.info.kind != "cuda":
                return None
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event

        def _timed(self, batches):
            iterator = iter(batches)
            while True:
                before, host = self._mark(), time.perf_counter()
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
                self.waits.append((time.perf_counter() - host, before, self._mark()))
                yield batch

    return InputTimedTrainer


def _trainer(spec: dict):
    """The variant's ``Trainer`` for ``spec`` (dataset, device, flags, steps, epochs...); its
    model folder (checkpoints, compile cache) in the parent's ``spec["scratch"]``."""
    argv = ["--dataset", spec["dataset"], "--model", str(Path(spec["scratch"]) / "model"),
            "--device", spec["device"], "--batch-size", str(spec["batch"]),
            "--num-workers", str(spec["workers"]), "--steps-per-epoch", str(spec["steps"]),
            "--max-epochs", str(spec["epochs"]), "--base-filters", str(spec["filters"]),
            "--levels", str(spec["levels"]), *spec["flags"]]
    args = train.build_parser().parse_args(argv)
    trainer = _trainer_class()(train.preflight(args), 0, 1, 0)
    trainer.waits = []
    if trainer.info.kind == "cuda":
        torch.backends.cudnn.benchmark = spec["cudnn_benchmark"]
    return trainer


def timed_epoch(trainer) -> dict:
    """One epoch of ``Trainer.run_epoch`` (end to end): img/s and the input waits."""
    progress = trainer.progress
    progress.epoch_loss, progress.epoch_steps = 0.0, 0
    trainer.waits = []
    epoch = trainer.run_epoch()
    progress.epoch += 1
    devices.synchronize(trainer.info)
    gpu = [b.elapsed_time(a) / 1e3 for _, b, a in trainer.waits if b is not None]
    host = sum(w for w, _, _ in trainer.waits)
    return {"img_per_s": epoch["img_per_s"], "seconds": epoch["seconds"],
            "loss": epoch["loss"], "host_wait_share": host / epoch["seconds"],
            "gpu_wait_share": sum(gpu) / epoch["seconds"] if gpu else None}


def compute_only(trainer, steps: int) -> dict:
    """``steps`` train steps of the variant on one prepared device batch: img/s."""
    info = trainer.info
    images, labels = train.device_batch(*trainer.sampler(0), info, 0)
    step = lambda: train.train_step(trainer.train_forward, trainer.loss_fn,  # noqa: E731
                                    trainer.optimizer, trainer.scheduler, trainer.scaler,
                                    info, images, labels)
    for _ in range(3):
        step()
    devices.synchronize(info)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    devices.synchronize(info)
    seconds = time.perf_counter() - start
    return {"img_per_s": steps * trainer.local_batch / seconds, "seconds": seconds}


def profile_table(trainer, steps: int = 15, rows: int = 30) -> str:
    """``steps`` steps of the loop (batches from the loader, end to end) under
    torch.profiler: the top ``rows`` kernels and operators by their own device time, and the
    wall time beside the device's busy time."""
    info = trainer.info
    activities = [torch.profiler.ProfilerActivity.CPU]
    if info.kind == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    devices.synchronize(info)
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for images, labels in itertools.islice(trainer.batches, steps):
            train.train_step(trainer.train_forward, trainer.loss_fn, trainer.optimizer,
                             trainer.scheduler, trainer.scaler, info, images, labels)
        devices.synchronize(info)
    wall = time.perf_counter() - start
    trainer.progress.step += steps
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e6 \
        if info.kind == "cuda" else float("nan")
    head = (f"{steps} steps: {wall:.3f} s wall under the profiler; device busy {busy:.3f} s "
            "(sum of kernel self times)\n")
    sort = "self_cuda_time_total" if info.kind == "cuda" else "self_cpu_time_total"
    return head + events.table(sort_by=sort, row_limit=rows, max_name_column_width=60)


def _variant_process(conn, spec: dict) -> None:
    """A variant's process: build and warm its trainer, then answer the parent's requests
    ("epoch", "compute", "profile", "stop") until told to stop."""
    try:
        started = time.perf_counter()
        trainer = _trainer(spec)
        warm = timed_epoch(trainer)
        conn.send(("ready", {"warmup_s": time.perf_counter() - started,
                             "first_step_s": trainer.first_step_s,
                             "warmup_epoch_img_per_s": warm["img_per_s"]}))
        while True:
            request = conn.recv()
            if request == "stop":
                break
            result = (timed_epoch(trainer) if request == "epoch" else
                      compute_only(trainer, spec["steps"]) if request == "compute" else
                      profile_table(trainer))
            conn.send(("ok", result))
        trainer.batches = None
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which goes on
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"))


class Variant:
    """The parent's handle on one variant process."""

    def __init__(self, name: str, spec: dict, env: dict[str, str], scratch: Path):
        """Starts the variant's process, its model in ``scratch``: a folder it makes afresh
        and :meth:`stop` removes once the process has ended."""
        self.name, self.error, self.scratch = name, None, scratch
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        with environ(env):
            # not a daemon: its DataLoader starts worker processes of its own
            self.process = context.Process(target=_variant_process,
                                           args=(child, {**spec, "scratch": str(scratch)}))
            self.process.start()
        child.close()
        self.ready = None

    def wait_ready(self, deadline: float) -> bool:
        try:
            if self.conn.poll(max(0.0, deadline - time.monotonic())):
                status, value = self.conn.recv()
                if status == "ready":
                    self.ready = value
                    return True
                self.error = value
            else:
                self.error = "not ready within the warm-up budget"
        except EOFError:
            self.error = f"the process ended (exit {self.process.exitcode})"
        print(f"gpu: variant {self.name} left out: {self.error}", file=sys.stderr, flush=True)
        self.stop()
        return False

    def ask(self, request: str):
        try:
            self.conn.send(request)
            status, value = self.conn.recv()
        except (EOFError, OSError) as exc:
            status, value = "error", f"the process ended ({type(exc).__name__})"
        if status != "ok":
            raise RuntimeError(f"variant {self.name}: {value}")
        return value

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send("stop")
            except OSError:
                pass
            self.process.join(20)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        shutil.rmtree(self.scratch, ignore_errors=True)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    if value and not (value.isdigit() and int(value) > 0):
        raise ValueError(f"{name}={value!r}: expected a positive whole number")
    return int(value) if value else default


def round_sizes(settings: Settings) -> tuple[int, int]:
    """(rounds, steps per epoch at the settings' batch): ``UNET_GPU_ROUNDS`` and
    ``UNET_GPU_EPOCH_STEPS``, by default 3 and 60 (with ``--smoke`` 1 and 4)."""
    return (_env_int("UNET_GPU_ROUNDS", 1 if settings.smoke else 3),
            _env_int("UNET_GPU_EPOCH_STEPS", 4 if settings.smoke else 60))


def _spec(settings: Settings, device: str, dataset: Path, flags: list[str],
          cudnn_benchmark: bool, rounds: int) -> dict:
    """What a variant process builds: its flags after the common ones (a later flag wins),
    and as many steps per epoch as give every variant the same samples per epoch."""
    batch = int(flags[flags.index("--batch-size") + 1]) if "--batch-size" in flags \
        else settings.gpu_batch
    samples = round_sizes(settings)[1] * settings.gpu_batch
    return {"dataset": str(dataset), "device": device, "batch": batch,
            "steps": max(1, samples // batch), "epochs": rounds + 3,
            "workers": 2 if settings.smoke else PROFILE_WORKERS,
            "filters": settings.base_filters, "levels": settings.levels, "flags": flags,
            "cudnn_benchmark": cudnn_benchmark}


def variants_ab(settings: Settings, device: str, budget_s: float, rounds: int = 3) -> dict:
    """Every variant warmed up together, then ``rounds`` interleaved rounds of (end to end
    epoch, compute only), and the profiles; what did not fit ``budget_s`` is left out."""
    begin = time.monotonic()
    names = chosen_variants(settings.smoke)
    dataset = dataset_dir(settings, "default")
    env = {**step_env(), "TORCHINDUCTOR_COMPILE_THREADS": "4"}
    handles = [Variant(name, _spec(settings, device, dataset, *VARIANTS[name][1:], rounds),
                       env, settings.workdir / "gpu-variants" / name) for name in names]
    try:
        warm_deadline = begin + 0.55 * budget_s
        ready = [v for v in handles if v.wait_ready(warm_deadline)]
        by_round: dict[str, dict[str, list]] = {v.name: {"end_to_end": [], "compute_only": [],
                                                         "epochs": []} for v in ready}
        rounds_file = os.environ.get("UNET_GPU_ROUNDS_FILE")
        per_round_s = None
        for r in range(rounds if ready else 0):
            round_start = time.monotonic()
            if per_round_s and round_start + per_round_s > begin + 0.9 * budget_s:
                break
            for v in ready[r % len(ready):] + ready[:r % len(ready)]:
                if v.error:
                    continue
                try:
                    epoch = v.ask("epoch")
                    by_round[v.name]["epochs"].append(epoch)
                    by_round[v.name]["end_to_end"].append(epoch["img_per_s"])
                    by_round[v.name]["compute_only"].append(v.ask("compute")["img_per_s"])
                except RuntimeError as exc:
                    v.error = str(exc)
            per_round_s = time.monotonic() - round_start
            print(f"gpu: round {r + 1}: " + json.dumps(
                {n: [d["end_to_end"][-1:], d["compute_only"][-1:]] for n, d in by_round.items()}),
                file=sys.stderr, flush=True)
            if rounds_file:
                Path(rounds_file).write_text(json.dumps(
                    {"rounds_done": r + 1, "variants": _summaries(handles, by_round)},
                    indent=1) + "\n")
        profiles = {}
        for v in ready:
            if not v.error and time.monotonic() < begin + 0.95 * budget_s:
                try:
                    profiles[v.name] = v.ask("profile")
                except RuntimeError as exc:
                    v.error = str(exc)
    finally:
        for v in handles:
            v.stop()
    return {"variants": _summaries(handles, by_round), "profiles": profiles,
            "rounds": rounds, "seconds": time.monotonic() - begin}


def _summaries(handles: list[Variant], by_round: dict[str, dict[str, list]]) -> dict:
    """Per variant: what it is, the medians of its rounds (None before a whole round), every
    round, its warm-up and its error."""
    results = {}
    for v in handles:
        runs = by_round.get(v.name, {"end_to_end": [], "compute_only": [], "epochs": []})
        done = bool(runs["end_to_end"]) and bool(runs["compute_only"])
        results[v.name] = {
            "what": VARIANTS[v.name][0], "flags": VARIANTS[v.name][1],
            "cudnn_benchmark": VARIANTS[v.name][2],
            "end_to_end": float(np.median(runs["end_to_end"])) if done else None,
            "compute_only": float(np.median(runs["compute_only"])) if done else None,
            "rounds": runs, "warmup": v.ready, "error": v.error}
    return results


def rows(variants: dict, where: str, card: str = "") -> list[Row]:
    """The comparison rows of :func:`variants_ab`'s (or a rounds file's) ``variants``: the
    default end to end against NVIDIA's figure and against its own compute-only rate (the
    targets for ``card``), and the default against each other variant."""
    absent = {"end_to_end": None, "compute_only": None}
    default, before = variants.get(DEFAULT, absent), variants.get(BEFORE, absent)
    out = []
    if default["end_to_end"]:
        bound = math.ceil(target_img_s(card) / NVIDIA_A100_AMP_IMG_S * 1e4) / 1e4
        out += [Row("gpu", f"steps.train default, end to end (data included), img/s, {where}",
                    "img/s", default["end_to_end"], NVIDIA_A100_AMP_IMG_S,
                    f"NVIDIA's published figure ({NVIDIA_CARD})", f">= {bound}"),
                Row("gpu", f"steps.train default, end to end / compute only, {where}",
                    "ratio", default["end_to_end"], default["compute_only"],
                    "the same trainer's compute-only rate", f">= {TARGET_OF_COMPUTE}")]
    for name, result in variants.items():
        if name != DEFAULT and result["end_to_end"] and default["end_to_end"]:
            out.append(Row("gpu", f"default vs {result['what']}, end to end, {where}",
                           "img/s", default["end_to_end"], result["end_to_end"],
                           result["what"]))
    if before["compute_only"] and default["compute_only"]:
        out.append(Row("gpu", f"default vs {before['what']}, compute only, {where}", "img/s",
                       default["compute_only"], before["compute_only"], before["what"]))
    return out


def run(settings: Settings) -> dict:
    chosen = gpu_rows_device(settings)
    if chosen is None:
        return {"rows": [], "details": {"why": "no GPU on this machine"}}
    device, name = chosen
    budget = float(os.environ.get("UNET_GPU_BUDGET_S", "420"))
    begin = time.monotonic()
    where = f"batch {settings.gpu_batch}, {name}"
    ab = variants_ab(settings, device, budget, rounds=round_sizes(settings)[0])
    for variant, result in ab["variants"].items():
        summary = {k: result[k] for k in ("end_to_end", "compute_only", "warmup", "error")}
        print(f"gpu: {variant}: {json.dumps(summary)}", file=sys.stderr, flush=True)
    details = {"device": name, "batch": settings.gpu_batch, "ab": ab}
    found = rows(ab["variants"], where, name)
    for part in (trainstep.gpu_rows, loader.device_rows):
        if time.monotonic() - begin > 0.85 * budget:
            details[part.__module__.rsplit(".", 1)[-1]] = "left out: the budget was spent"
            continue
        part_rows, part_details = part(settings, device, name)
        found += part_rows
        details[part.__module__.rsplit(".", 1)[-1]] = part_details
    return {"rows": found, "details": details}
