"""How far the tests' learned-quality thresholds sit from what the runs reach, and how much
the runs vary (issue 38):

    python -m benchmarks.margins [--seeds 0 1 2] [--out FILE] [--workdir DIR]

For every training seed, on both CPU instruction-set paths (the default, and AVX2 only:
``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``, as an AVX2-only CPU runs), idle
and beside one busy neighbour (a process spinning on one core), it runs two tests' real
pipelines with the steps as the tests run them:

- ``quantize``: ``tests/test_quantize.py``'s model (download, preprocess, train, convert),
  then quantize with a gate it cannot miss: the FP32 Dice, the INT8 drop (mean and worst
  class, in points) and the foreground agreement, onnxruntime's and OpenVINO's, against the
  gate's 0.5 / 1 / 0.99;
- ``local``: the same for the README's ``run --local`` (the local profile: 8 epochs);
- ``train``: ``tests/test_train.py``'s run that must learn (best mean Dice >= 0.7).

Each run also records the sha256 of its trained weights and of its calibration slices, so
that two runs that differ show where, and each class's drop (onnxruntime's, and OpenVINO's
where its CPU plugin compiled the IR). Results: JSON with every run, and per test and
figure the spread (max - min), the margin to the threshold and the bound that would leave
three spreads.

Other configurations of the quantize and local runs (issue 46: a larger synthetic set,
longer training, another calibration) are measured with ``--source`` (the synthetic set),
``--train-args`` and ``--quantize-args`` (flags appended to the step's; a later flag wins).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import machine, neighbours

ROOT = Path(__file__).resolve().parents[1]
ISA = {"default": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
LOOSE_GATE = ("--max-dice-drop", "100", "--max-class-dice-drop", "100", "--min-agreement", "0")
# (source, patch, train flags) as the tests give them
QUANTIZE = ("synthetic://?cases=10&shape=64x64x24&seed=0", "64x64",
            ("--device", "cpu", "--base-filters", "8", "--levels", "4", "--batch-size", "16",
             "--learning-rate", "0.004", "--max-epochs", "6", "--steps-per-epoch", "50",
             "--patience", "0", "--val-batch-size", "32", "--num-workers", "0"))
# The README's `run --local` (the local profile): the quantize test's data and network,
# 8 epochs instead of 6; what a user's first run holds to the default gate.
LOCAL = (QUANTIZE[0], QUANTIZE[1], QUANTIZE[2] + ("--max-epochs", "8"))   # the later flag wins
TRAIN = ("synthetic://?cases=10&shape=64x64x16&seed=3", "64x64",
         ("--device", "cpu", "--base-filters", "8", "--levels", "4", "--num-workers", "0",
          "--val-batch-size", "32", "--batch-size", "16", "--steps-per-epoch", "40",
          "--max-epochs", "8", "--learning-rate", "4e-3", "--patience", "0"))
GATE = {"int8_mean_drop_points": 0.5, "int8_worst_class_drop_points": 1.0, "agreement": 0.99,
        "openvino_mean_drop_points": 0.5, "openvino_worst_class_drop_points": 1.0,
        "openvino_agreement": 0.99}
THRESHOLDS = {"quantize": GATE, "local": GATE, "train": {"best_mean_dice": 0.7}}
CONFIGS = {"quantize": QUANTIZE, "local": LOCAL, "train": TRAIN}


def _step(module: str, *args: str, env: dict[str, str]) -> None:
    done = subprocess.run([sys.executable, "-m", f"steps.{module}", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise RuntimeError(f"steps.{module}: {done.stderr.strip().splitlines()[-1:]}")


def _digest(path: Path) -> str:
    state = torch.load(path, map_location="cpu", weights_only=True)["model_state"]
    sha = hashlib.sha256()
    for name in sorted(state):
        sha.update(name.encode() + state[name].numpy().tobytes())
    return sha.hexdigest()[:16]


def _drops(figures: dict, name: str, prefix: str) -> dict:
    """``name``'s (int8, openvino_int8) gate figures under the summary's names."""
    f = figures[name]
    return {f"{prefix}_mean_drop_points": f["mean_dice_drop_points"],
            f"{prefix}_worst_class_drop_points": max(f["class_dice_drop_points"].values()),
            f"{prefix}_class_drop_points": f["class_dice_drop_points"],
            "agreement" if prefix == "int8" else f"{prefix}_agreement":
                f["agreement_in_foreground"]}


def one_run(test: str, seed: int, isa: str, root: Path, source: str | None = None,
            train_args: tuple[str, ...] = (), quantize_args: tuple[str, ...] = ()) -> dict:
    """The test's pipeline with training seed ``seed`` on the ``isa`` path, under ``root``;
    ``source``, ``train_args`` and ``quantize_args`` change its configuration."""
    default_source, patch, train_flags = CONFIGS[test]
    source = source or default_source
    train_flags = train_flags + tuple(train_args)
    # one thread, not adapted to the load, so that the load moves nothing
    env = {**os.environ, "OMP_NUM_THREADS": "1", "UNET_ADAPT_THREADS": "0", **ISA[isa],
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    _step("download", "--source", source, "--raw", str(root / "raw"), "--no-progress", env=env)
    _step("preprocess", "--raw", str(root / "raw"), "--dataset", str(root / "dataset"),
          "--patch-size", patch, env=env)
    _step("train", "--dataset", str(root / "dataset"), "--model", str(root / "model"),
          *train_flags, "--seed", str(seed), env=env)
    metrics = json.loads((root / "model" / "metrics.json").read_text())
    result = {"best_mean_dice": metrics["best_mean_dice"],
              "weights_sha256": _digest(root / "model" / "best.pt")}
    if test != "train":
        _step("convert", "--model", str(root / "model"), "--dataset", str(root / "dataset"),
              "--exported", str(root / "exported"), env=env)
        _step("quantize", "--exported", str(root / "exported"), "--dataset",
              str(root / "dataset"), "--quantized", str(root / "quantized"), *quantize_args,
              *LOOSE_GATE, env=env)
        report = json.loads((root / "quantized" / "quantization.json").read_text())
        figures = report["figures"]
        result.update({"fp32_mean_dice": figures["fp32"]["mean_dice"],
                       "fp32_class_dice": figures["fp32"]["dice"],
                       **_drops(figures, "int8", "int8"),
                       "openvino_file": report["files"]["openvino"],
                       "calibration_sha256": report["calibration"]["sha256"][:16]})
        if "openvino_int8" in figures:
            result.update(_drops(figures, "openvino_int8", "openvino"))
    return result


def summary(runs: list[dict]) -> dict:
    """Per test and figure: min, max, spread, the margin of the worst run to its threshold
    (positive: inside it), how many spreads fit in that margin, and the bound that would
    leave three spreads."""
    out = {}
    for test, limits in THRESHOLDS.items():
        mine = [r for r in runs if r["test"] == test and "error" not in r]
        for figure, limit in limits.items():
            values = [r[figure] for r in mine if figure in r]
            if not values:
                continue
            lower_is_better = figure.endswith("drop_points")
            worst = max(values) if lower_is_better else min(values)
            margin = (limit - worst) if lower_is_better else (worst - limit)
            spread = max(values) - min(values)
            # the bound a test can hold with a margin of three spreads
            bound = worst + 3 * spread if lower_is_better else worst - 3 * spread
            out[f"{test}: {figure}"] = {"threshold": limit, "min": min(values),
                                        "max": max(values), "spread": spread,
                                        "worst_margin": margin,
                                        "margin_over_spread": margin / spread if spread else None,
                                        "bound_at_three_spreads": bound}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.margins")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--tests", nargs="+", default=list(THRESHOLDS), choices=THRESHOLDS)
    parser.add_argument("--loads", nargs="+", default=["idle", "busy"],
                        choices=["idle", "busy"])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--source", default=None,
                        help="the quantize and local runs' synthetic set instead of the tests'")
    parser.add_argument("--train-args", default="", help="train flags to append, one string")
    parser.add_argument("--quantize-args", default="",
                        help="quantize flags to append, one string")
    args = parser.parse_args(argv)
    changes = {"source": args.source,
               "train_args": tuple(args.train_args.split()),
               "quantize_args": tuple(args.quantize_args.split())}
    info, runs = machine(), []
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="unet-margins-"))
    for test in args.tests:
        for seed in args.seeds:
            for isa in ISA:
                for load in args.loads:
                    root = workdir / f"{test}-{seed}-{isa}-{load}"
                    start = time.perf_counter()
                    run = {"test": test, "seed": seed, "isa": isa, "load": load}
                    with neighbours(1 if load == "busy" else 0):
                        try:
                            run.update(one_run(test, seed, isa, root,
                                           **(changes if test != "train" else {})))
                        except RuntimeError as exc:
                            run["error"] = str(exc)
                    run["seconds"] = time.perf_counter() - start
                    runs.append(run)
                    print(json.dumps(run), file=sys.stderr, flush=True)
    info["load_average_end"] = list(os.getloadavg())
    report = {"command": "python -m benchmarks.margins " + " ".join(argv or sys.argv[1:]),
              "machine": info, "changes": changes, "runs": runs, "summary": summary(runs)}
    text = json.dumps(report, indent=1) + "\n"
    if args.out:
        args.out.write_text(text)
    print(json.dumps(report["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
