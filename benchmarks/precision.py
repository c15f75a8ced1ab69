"""9. CPU training precision: bf16 autocast against fp32, speed and accuracy.

The ``local`` profile's training (the real ``steps.train``, the same synthetic dataset, seed
and steps) runs with ``--precision fp32`` and ``--precision bf16`` in alternating rounds.
Each run reports its own throughput and the mean Dice of its best epoch (``argo-outputs``).
oneDNN runs bf16 natively only on CPUs with AVX-512 BF16 or AMX; elsewhere it emulates it,
so the answer depends on the machine, which the JSON records. bf16 would become the CPU
default only where it wins on both speed and Dice.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import Row, Settings, step_dataset, step_env
from emulator.s3target import environ
from workflows.config import load_config

REPO = Path(__file__).resolve().parent.parent


def _local_train_args() -> list[str]:
    """steps.train flags of the ``local`` profile's train section, precision left out."""

    train = load_config(None, None, [], local=True).train
    flags = {"devices": 1, "batch-size": train.batch_size, "val-batch-size": train.val_batch_size,
             "base-filters": train.base_filters, "levels": train.levels,
             "learning-rate": train.learning_rate, "min-epochs": train.min_epochs,
             "max-epochs": train.max_epochs, "steps-per-epoch": train.steps_per_epoch,
             "patience": train.patience, "num-workers": 0, "seed": train.seed}
    return ["--device", "cpu", *[str(v) for k, v in flags.items() for v in (f"--{k}", v)]]


def _dataset(settings: Settings) -> Path:

    cfg = load_config(None, None, [], local=True)
    if settings.smoke:
        return step_dataset(settings.workdir / "precision", "synthetic://?cases=5&shape="
                            "32x32x16&seed=0", "32x32")
    return step_dataset(settings.workdir / "precision", cfg.download.source,
                        cfg.preprocess.patch_size)


def train_once(settings: Settings, dataset: Path, precision: str, tag: str) -> dict:
    model = settings.workdir / "precision" / f"model-{tag}"
    shutil.rmtree(model, ignore_errors=True)
    args = _local_train_args()
    if settings.smoke:
        args += ["--max-epochs", "1", "--steps-per-epoch", "2", "--base-filters", "4"]
    with environ(step_env()):
        subprocess.run([sys.executable, "-m", "steps.train", "--dataset", str(dataset),
                        "--model", str(model), "--precision", precision, *args],
                       cwd=REPO, check=True, capture_output=True)
    outputs = model / "argo-outputs"
    return {"img_per_s": float((outputs / "img_per_s").read_text()),
            "mean_dice": float((outputs / "mean_dice").read_text())}


def run(settings: Settings) -> dict:
    dataset = _dataset(settings)
    runs = {"fp32": [], "bf16": []}
    for round_ in range(1 if settings.smoke else 2):
        order = ("fp32", "bf16") if round_ % 2 == 0 else ("bf16", "fp32")
        for precision in order:
            runs[precision].append(train_once(settings, dataset, precision,
                                              f"{precision}-{round_}"))
    median = {p: {k: float(np.median([r[k] for r in rs])) for k in ("img_per_s", "mean_dice")}
              for p, rs in runs.items()}
    rows = [Row("cpu precision", "local profile training, bf16 autocast vs fp32", "img/s",
                median["bf16"]["img_per_s"], median["fp32"]["img_per_s"], "fp32"),
            Row("cpu precision", "mean Dice of the best epoch, bf16 vs fp32", "Dice",
                median["bf16"]["mean_dice"], median["fp32"]["mean_dice"], "fp32")]
    wins = all(row.ratio > 1.0 for row in rows)
    for row in rows:
        row.verdict = "bf16 wins both" if wins else "keep fp32"
    return {"rows": rows, "details": {"runs": runs, "medians": median,
                                      "train_flags": _local_train_args(),
                                      "bf16_default_on_cpu": wins}}
