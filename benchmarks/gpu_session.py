"""Issue 50's acceptance run (issue 36's before it) on a lent GPU machine in one call, and
its record.

    python -m benchmarks.gpu_session OUT_DIR [--seconds 555] [--smoke]

Each stage is a child process with its own time limit and its output in
``OUT_DIR/session.log``, so that the call ends inside the device's 10-minute limit and what
finished comes back:

1. ``versions``: the card, driver, torch, CUDA and cuDNN versions, the host CPU, the
   network's training FLOPs per image (counted by torch's FlopCounterMode on the meta
   device) and the card's bf16 matrix rate (an 8192-cubed product, measured): the MFU's terms;
2. ``dataset``: the benchmarks' default dataset (5 cases, 192x160 patches), by steps.preprocess;
3. ``cold``: ``steps.train`` by default (batch 64, 8 workers) with a checkpoint store, from
   empty compile caches: its first step cold, and the compile cache it saves to the store;
4. ``retry``: the same command as an Argo retry runs it, a new pod (empty local caches, the
   same store) asking for two epochs more: it resumes and loads the compile cache (its first
   step warm), and its last epoch is ``steps.train``'s own in the steady state;
5. ``eager-cold`` and ``eager``: the same two runs eager (``--cuda-compile false``) with a
   store of their own: the Dice that the retry's must match. The same two runs, since the
   learning rate's schedule spans the epochs a run asks for: one run of three epochs trains
   differently from one epoch and a retry asking for three;
6. ``benchmark``: ``python -m benchmarks gpu`` with the time left, from the cold run's local
   caches: the default and the default before it, batch 128 and fused AdamW
   (``UNET_GPU_VARIANTS`` chooses others; with ``--smoke`` the first two, all the CPU can
   run) in interleaved rounds, end to end and compute only,
   each round written to ``gpu-rounds.json`` as it ends.

``OUT_DIR/gpu-result.json`` then holds every stage's figures, the rows, and the verdict on
each acceptance point (:func:`acceptance`), with the digest of the sources that ran (the one
the CPU image is labelled with: pyproject.toml, .ci/constraints.txt, steps/). ``--smoke``
runs the same stages on the CPU with tiny shapes: it proves the plumbing; a CPU run gives no
verdict.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import gpu
from benchmarks.common import Row, Settings, machine, verdict
from benchmarks.trainstep import NVIDIA_A100_AMP_IMG_S, NVIDIA_CARD
from emulator.pods import source_digest
from steps.model import ModelConfig, build_model

ROOT = Path(__file__).resolve().parents[1]
RETRY_FIRST_STEP_S = 10.0     # issue 36: the first step of a retry, compile cache restored
COLD_FIRST_STEP_S = 20.0      # issue 50: the first step from empty compile caches
DICE_POINTS = 0.5             # issue 50: the default's mean Dice against eager's, in points
SESSION_VARIANTS = "default,contiguous,batch-128,fused-adamw"
RECORD_S = 15                 # kept back for the record at the end
STOP_GRACE_S = 20             # SIGTERM to SIGKILL for a stage past its limit


@dataclass(frozen=True)
class Sizes:
    """What the stages run: the anchors' network at batch 64 on CUDA, or tiny on the CPU."""
    device: str
    batch: int
    workers: int
    steps: int                # per epoch, in the cold and retry runs
    bench_steps: int          # per epoch of each benchmark round
    rounds: int
    settings: Settings

    @classmethod
    def make(cls, smoke: bool, work: Path) -> "Sizes":
        settings = Settings.make(smoke, work)
        if smoke:
            return cls("cpu", settings.gpu_batch, 2, 2, 3, 1, settings)
        return cls("cuda", settings.gpu_batch, gpu.PROFILE_WORKERS, 100, 120, 5, settings)


def versions(path: str, smoke: bool = False) -> None:
    """Write the machine's card, driver and library versions, the training FLOPs per image
    and the card's bf16 matrix rate to ``path`` (a child process: the session itself never
    starts CUDA)."""
    smi = shutil.which("nvidia-smi")
    card = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total",
                           "--format=csv,noheader"], capture_output=True, text=True,
                          timeout=30).stdout.strip() if smi else None
    on_gpu = torch.cuda.is_available()
    settings = Settings.make(smoke, Path(path).parent)
    facts = {"nvidia_smi": card, "torch": torch.__version__, "cuda": torch.version.cuda,
             "cudnn": torch.backends.cudnn.version() if on_gpu else None,
             "card": torch.cuda.get_device_name(0) if on_gpu else None,
             "train_flops_per_image": train_flops_per_image(settings),
             "bf16_matmul_tflops": bf16_matmul_tflops() if on_gpu else None,
             "machine": machine()}
    Path(path).write_text(json.dumps(facts, indent=1) + "\n")


def train_flops_per_image(settings: Settings) -> float:
    """Forward and backward FLOPs of the benchmarks' network per training image (batch 2 at
    the patch size, counted on the meta device: no memory, no arithmetic)."""
    config = ModelConfig(base_filters=settings.base_filters, levels=settings.levels)
    with torch.device("meta"):
        net = build_model(config)
        images = torch.empty(2, config.in_channels, *settings.patch)
        with FlopCounterMode(display=False) as counter:
            net(images).float().sum().backward()
    return counter.get_total_flops() / 2


def bf16_matmul_tflops(n: int = 8192, reps: int = 10) -> float:
    """The card's bf16 matrix rate: ``reps`` n-cubed products of random operands after three
    unmeasured, timed with CUDA events."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def run_stage(log: Path, name: str, limit: float, argv: list[str],
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``argv`` from the repository's root for at most ``limit`` seconds, its output
    appended to ``log``; past the limit its whole process group gets SIGTERM (the steps
    clean up on it), then SIGKILL. Returns the stage's name, exit status and seconds."""
    start = time.monotonic()
    with log.open("a") as out:
        print(f"== {name}: {' '.join(argv)}", file=out, flush=True)
        child = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                 start_new_session=True)
        try:
            status: int | str = child.wait(timeout=max(1.0, limit))
        except subprocess.TimeoutExpired:
            _stop_group(child)
            status = "timeout"
        seconds = round(time.monotonic() - start, 1)
        print(f"== {name}: exit {status} after {seconds} s", file=out, flush=True)
    print(f"gpu_session: {name}: exit {status} after {seconds} s", file=sys.stderr, flush=True)
    return {"stage": name, "exit": status, "seconds": seconds, "limit_s": round(limit)}


def _stop_group(child: subprocess.Popen) -> None:
    """SIGTERM to the stage's process group, up to ``STOP_GRACE_S`` for its leader to end,
    then SIGKILL to whatever of the group is left (a worker that outlived its parent)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            break
        try:
            child.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            continue
    child.wait()


def train_argv(sizes: Sizes, dataset: Path, model: Path, store: Path, epochs: int,
               *flags: str) -> list[str]:
    """``steps.train`` as the cold run and its retry run it: its defaults, the sizes."""
    s = sizes.settings
    return [sys.executable, "-m", "steps.train", "--dataset", str(dataset), "--model",
            str(model), "--device", sizes.device, "--batch-size", str(sizes.batch),
            "--num-workers", str(sizes.workers), "--max-epochs", str(epochs),
            "--steps-per-epoch", str(sizes.steps), "--base-filters", str(s.base_filters),
            "--levels", str(s.levels), "--checkpoint-uri", str(store), *flags]


def caches(work: Path, name: str) -> dict[str, str]:
    """Inductor's and Triton's local caches in their own empty folders (a pod's)."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor-{name}"),
            "TRITON_CACHE_DIR": str(work / f"triton-{name}")}


def session(out: Path, seconds: float, smoke: bool,
            train_flags: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every stage in turn within ``seconds``, then the record (returned and written).
    ``train_flags`` go to the cold, retry and eager runs after the sizes (a candidate
    default, with eager's Dice on the same flags)."""
    begin = time.monotonic()
    work = Path(os.environ.get("GPU_WORK", "/tmp/unet-gpu")) / ("smoke" if smoke else "full")
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    log, sizes = out / "session.log", Sizes.make(smoke, work)
    dataset, store = work / "dataset-default", work / "checkpoints"
    for stale in ("model-cold", "model-retry", "model-eager-cold", "model-eager",
                  "checkpoints", "checkpoints-eager", "inductor-cold", "triton-cold",
                  "inductor-retry", "triton-retry"):
        shutil.rmtree(work / stale, ignore_errors=True)

    def left() -> float:
        return seconds - (time.monotonic() - begin) - RECORD_S

    stages = [run_stage(log, "versions", 60, [sys.executable, "-c",
                        "import sys; from benchmarks.gpu_session import versions; "
                        "versions(sys.argv[1], sys.argv[2] == 'smoke')",
                        str(out / "versions.json"), "smoke" if smoke else "full"])]
    stages.append(run_stage(log, "dataset", 120, [
        sys.executable, "-c", "import sys; from pathlib import Path; "
        "from benchmarks.common import Settings, dataset_dir; "
        "dataset_dir(Settings.make(sys.argv[2] == 'smoke', Path(sys.argv[1])))",
        str(work), "smoke" if smoke else "full"]))
    stages.append(run_stage(log, "cold", min(200, left()), train_argv(
        sizes, dataset, work / "model-cold", store, 1, *train_flags), caches(work, "cold")))
    stages.append(run_stage(log, "retry", min(100, left()), train_argv(
        sizes, dataset, work / "model-retry", store, 3, *train_flags), caches(work, "retry")))
    for run, epochs in (("eager-cold", 1), ("eager", 3)):
        stages.append(run_stage(log, run, min(60, left()), train_argv(
            sizes, dataset, work / f"model-{run}", work / "checkpoints-eager", epochs,
            *train_flags, "--cuda-compile", "false")))
    for run in ("cold", "retry", "eager"):
        if (work / f"model-{run}" / "metrics.json").is_file():
            shutil.copy(work / f"model-{run}" / "metrics.json", out / f"metrics-{run}.json")
    budget = left() - 30
    stages.append(run_stage(log, "benchmark", budget + 25, [
        sys.executable, "-m", "benchmarks", "gpu", "--workdir", str(work), "--out",
        str(out / "gpu-benchmark.json"), *(["--smoke"] if smoke else [])],
        {**caches(work, "cold"), "UNET_GPU_BUDGET_S": str(int(max(budget, 1))),
         "UNET_GPU_ROUNDS": str(sizes.rounds), "UNET_GPU_EPOCH_STEPS": str(sizes.bench_steps),
         "UNET_GPU_ROUNDS_FILE": str(out / "gpu-rounds.json"),
         "UNET_GPU_VARIANTS": os.environ.get("UNET_GPU_VARIANTS", ",".join(
             gpu.SMOKE_VARIANTS) if smoke else SESSION_VARIANTS)}))
    result = {**record(out, stages, sizes), "train_flags": list(train_flags)}
    (out / "gpu-result.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


# ------------------------------------------------------------------------------ the record

def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def benchmark_ab(bench: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's interleaved rounds (variants and profiles); {} if it wrote none."""
    try:
        return bench["benchmarks"]["gpu"]["details"]["ab"]
    except (TypeError, KeyError):
        return {}


def default_rounds(out: Path, ab: dict[str, Any]) -> dict[str, Any] | None:
    """The variants' summaries: the benchmark's own (``ab``), else the last rounds file (a
    benchmark cut short at its limit)."""
    variants = ab.get("variants")
    if variants:
        return variants
    rounds = _read(out / "gpu-rounds.json")
    return rounds["variants"] if rounds else None


def _point(what: str, value: float | None, bound: str, on_gpu: bool,
           fault: str | None = None) -> dict[str, Any]:
    """One acceptance point; ``fault`` (a reason) misses it whatever the value."""
    met = None if value is None or not on_gpu else \
        fault is None and verdict(value, bound) == "meets target"
    return {"what": what, "value": value, "bound": bound, "met": met,
            **({"fault": fault} if fault and on_gpu else {})}


def acceptance(variants: dict | None, retry: dict | None, on_gpu: bool, batch: int = 64,
               cold: dict | None = None, eager: dict | None = None,
               card: str = "") -> dict[str, Any]:
    """Issue 50's acceptance points from the rounds and the runs' metrics: each with its
    value, bound and ``met`` (None where unmeasured, or on the CPU; False for a retry whose
    compile cache was not restored, a broken cache being a miss, and for a cold run that
    found one), and ``all``."""
    default = (variants or {}).get(gpu.DEFAULT) or {}
    end, compute = default.get("end_to_end"), default.get("compute_only")
    cache = (retry or {}).get("compile_cache")
    points = {
        "end_to_end": _point(f"steps.train default, end to end (data included), batch "
                             f"{batch}, median of the interleaved rounds [img/s]", end,
                             f">= {gpu.target_img_s(card):g}", on_gpu),
        "end_to_end_over_compute": _point(
            "the same, over its compute-only median", end / compute if end and compute
            else None, f">= {gpu.TARGET_OF_COMPUTE:g}", on_gpu),
        "cold_first_step": _point(
            "first step from empty compile caches [s]", (cold or {}).get("first_step_s"),
            f"<= {COLD_FIRST_STEP_S:g}", on_gpu,
            None if not cold or cold.get("compile_cache") != "restored" else
            "the cold run restored a compile cache: it was not cold"),
        "retry_first_step": _point(
            "first step of a retry, with the load of the compile cache from the checkpoint "
            "store [s]", retry_first_step(retry) if retry else None,
            f"<= {RETRY_FIRST_STEP_S:g}", on_gpu,
            None if cache == "restored" else f"the retry's compile cache was {cache}, not "
                                              "restored: it compiled afresh"),
        "dice_vs_eager": _point(
            "the retry's last mean Dice against the same runs' eager, |difference| in "
            "points", dice_points(retry, eager), f"<= {DICE_POINTS:g}", on_gpu)}
    mets = [p["met"] for p in points.values()]
    return {**points, "all": None if None in mets else all(mets)}


def dice_points(run: dict | None, reference: dict | None) -> float | None:
    """|last epoch's mean Dice of ``run`` - ``reference``'s| x 100; None if either lacks it."""
    dice = [((m or {}).get("epochs") or [{}])[-1].get("mean_dice") for m in (run, reference)]
    return None if None in dice else abs(dice[0] - dice[1]) * 100


def retry_first_step(metrics: dict) -> float:
    """A run's first step with the load of its compile cache, which comes before it."""
    return metrics["first_step_s"] + metrics.get("compile_cache_load_s", 0.0)


def first_step_rows(cold: dict | None, retry: dict | None, where: str) -> list[Row]:
    """The cold first step and the retry's (its cache's load included) against the
    acceptance's bounds, and the one against the other."""
    rows = []
    if cold and cold.get("first_step_s") and cold.get("compile_cache") in ("saved",
                                                                             "not saved"):
        rows.append(Row("gpu", f"first step from empty compile caches, steps.train default, "
                               f"{where}", "s", cold["first_step_s"], COLD_FIRST_STEP_S,
                        "issue 50's bound", "<= 1"))
    if not retry or retry.get("compile_cache") != "restored" or not retry.get("first_step_s"):
        return rows
    warm = retry_first_step(retry)
    rows.append(Row("gpu", f"first step of a retry (compile cache restored, its load "
                           f"included), steps.train default, {where}", "s", warm,
                    RETRY_FIRST_STEP_S, "issue 36's bound", "<= 1"))
    if cold and cold.get("first_step_s"):
        rows.append(Row("gpu", f"first step of a retry vs cold (empty caches), {where}", "s",
                        warm, cold["first_step_s"], "the cold first step"))
    return rows


def steady_epoch_rows(retry: dict | None, where: str) -> list[Row]:
    """``steps.train``'s own last epoch of the retry (its first step was in the epoch
    before), for information beside the benchmark's rounds."""
    epochs = (retry or {}).get("epochs", [])
    if len(epochs) < 3:
        return []
    return [Row("gpu", f"steps.train's own epoch {epochs[-1]['epoch']} (the retry's last, "
                       f"steady), end to end (data included), {where}", "img/s",
                epochs[-1]["img_per_s"], NVIDIA_A100_AMP_IMG_S,
                f"NVIDIA's published figure ({NVIDIA_CARD})")]


def record(out: Path, stages: list[dict], sizes: Sizes) -> dict[str, Any]:
    """Everything the session measured, the rows and the acceptance, from ``out``'s files."""
    facts = _read(out / "versions.json") or {}
    on_gpu = sizes.device == "cuda" and bool(facts.get("card"))
    where = f"batch {sizes.batch}, {facts.get('card') or sizes.device}"
    cold, retry, eager = (_read(out / f"metrics-{run}.json") for run in ("cold", "retry",
                                                                          "eager"))
    bench = _read(out / "gpu-benchmark.json") or {}
    ab = benchmark_ab(bench)
    variants = default_rounds(out, ab)
    card = facts.get("card") or ""
    rows = [Row(**{k: r[k] for k in ("benchmark", "metric", "unit", "ours", "baseline",
                                     "baseline_name", "target")})
            for r in bench.get("rows", [])] or gpu.rows(variants or {}, where, card)
    rows += first_step_rows(cold, retry, where) + steady_epoch_rows(retry, where) + \
        mfu_rows(variants, facts, where)
    return {"what": "issue 50: python -m benchmarks.gpu_session", "smoke": sizes.device != "cuda",
            "versions": facts, "sources": source_digest(), "stages": stages,
            "cold": _run_summary(cold), "retry": _run_summary(retry),
            "eager": _run_summary(eager), "variants": variants,
            "profiles": ab.get("profiles"), "rows": [r.to_dict() for r in rows],
            "acceptance": acceptance(variants, retry, on_gpu, sizes.batch, cold, eager, card)}


def mfu_rows(variants: dict | None, facts: dict[str, Any], where: str) -> list[Row]:
    """Each measured variant's model FLOP utilization: its end-to-end img/s times the
    counted training FLOPs per image, over the card's measured bf16 matrix rate."""
    flops, peak = facts.get("train_flops_per_image"), facts.get("bf16_matmul_tflops")
    if not flops or not peak:
        return []
    return [Row("gpu", f"MFU of {name}, end to end ({flops / 1e9:.1f} GFLOP per image "
                       f"counted), {where}", "TFLOP/s", v["end_to_end"] * flops / 1e12, peak,
                "the card's bf16 matrix rate (8192-cubed product, measured)")
            for name, v in (variants or {}).items() if v.get("end_to_end")]


def _run_summary(metrics: dict | None) -> dict[str, Any] | None:
    if not metrics:
        return None
    keep = ("epoch", "img_per_s", "seconds", "loss", "mean_dice")
    return {"first_step_s": metrics.get("first_step_s"),
            "compile_cache": metrics.get("compile_cache"),
            "compile_cache_load_s": metrics.get("compile_cache_load_s"),
            "epochs": [{k: e.get(k) for k in keep} for e in metrics.get("epochs", [])]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_session",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for the log and the results")
    parser.add_argument("--seconds", type=float, default=555,
                        help="the whole session's wall time (default 555: a device call's "
                             "10 minutes less the wheels' install and the transfers)")
    parser.add_argument("--smoke", action="store_true",
                        help="on the CPU with tiny shapes: proves the stages, no verdict")
    parser.add_argument("--train-flags", default="",
                        help="steps.train flags for the cold, retry and eager runs (a "
                             "candidate default), e.g. '--optimizer fusedadamw'")
    args = parser.parse_args(argv)
    result = session(args.out, args.seconds, args.smoke, tuple(shlex.split(args.train_flags)))
    for row in result["rows"]:
        print(f"{row['metric']}: {row['ours']:.4g} {row['unit']} (ratio {row['ratio']:.3f}"
              f"{', target ' + row['target'] + ': ' + row['verdict'] if row['target'] else ''})")
    print("acceptance: " + json.dumps(result["acceptance"], indent=1))
    return exit_status(result)


def exit_status(result: dict[str, Any]) -> int:
    """0 only when every acceptance point is met; a smoke run (no verdict by design) when
    every stage ran; else 1, a missed or unmeasured point alike."""
    if result["smoke"]:
        return 0 if all(s["exit"] == 0 for s in result["stages"]) else 1
    return 0 if result["acceptance"]["all"] is True else 1


if __name__ == "__main__":
    sys.exit(main())
