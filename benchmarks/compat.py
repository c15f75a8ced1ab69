"""Does the train and convert path work on this torch? And across torch versions?

    python -m benchmarks.compat [--python PY]... [--workdir DIR] [--out FILE]

For each interpreter (default: this one), on one small synthetic dataset made once:

1. a short CPU training run (``steps.train``, checkpoints to a local store);
2. ``steps.convert``: ``torch.export`` to ``.pt2``, the ONNX export at the configured opset,
   and the parity gate (torch vs onnxruntime vs the reloaded ``.pt2``);
3. for every other interpreter, a resume of training from the first one's checkpoint.

A Gaudi or CUDA image build runs it with its own interpreter, whose torch must not be
replaced (``python -m benchmarks.compat`` inside the image). Nothing is timed for a verdict;
every check passes or fails on what the steps themselves verify.
"""
from __future__ import annotations

import argparse
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import step_dataset

REPO = Path(__file__).resolve().parent.parent
SOURCE = "synthetic://?cases=6&shape=64x64x24&seed=5"


def train_args(dataset: Path, home: Path, epochs: int) -> list[str]:
    """A tiny CPU training run with checkpoints in ``home/ck``."""
    return ["steps.train", "--dataset", str(dataset), "--model", str(home / "model"),
            "--checkpoint-uri", str(home / "ck"), "--device", "cpu", "--base-filters", "8",
            "--levels", "4", "--batch-size", "8", "--val-batch-size", "8",
            "--max-epochs", str(epochs), "--steps-per-epoch", "4", "--num-workers", "0",
            "--precision", "fp32"]


def _run(python: str, args: list[str], log: Path) -> tuple[bool, str]:
    """Run one step; (ok, last stderr line). The whole output goes to ``log``."""
    done = subprocess.run([python, "-m", *args], cwd=REPO, capture_output=True, text=True)
    log.write_text(done.stdout + done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return done.returncode == 0, (lines[-1] if lines else f"exit {done.returncode}")[:300]


def torch_version(python: str) -> str:
    out = subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                         capture_output=True, text=True)
    return out.stdout.strip() or f"not importable: {out.stderr.strip().splitlines()[-1:]}"


def check_one(python: str, tag: str, dataset: Path, work: Path) -> dict:
    """Train, export and convert with ``python``; the result of each stage."""
    home = work / tag
    home.mkdir()
    result = {"python": python, "torch": torch_version(python)}
    started = time.perf_counter()
    ok, last = _run(python, train_args(dataset, home, 1), home / "train.log")
    result["train"] = {"ok": ok, "last": last}
    if ok:
        ok, last = _run(python, ["steps.convert", "--model", str(home / "model"), "--dataset",
                                 str(dataset), "--exported", str(home / "exported")],
                        home / "convert.log")
        result["convert"] = {"ok": ok, "last": last}
        parity = home / "exported" / "parity.json"
        if ok and parity.is_file():
            result["convert"]["parity"] = json.loads(parity.read_text())
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def check_resume(python: str, tag: str, source_tag: str, dataset: Path, work: Path) -> dict:
    """Continue ``source_tag``'s checkpoint for one more epoch with ``python``."""
    home = work / f"{source_tag}-then-{tag}"
    shutil.copytree(work / source_tag / "ck", home / "ck")
    ok, last = _run(python, train_args(dataset, home, 2), home / "train.log")
    resumed = "resumed from" in (home / "train.log").read_text()
    return {"from": source_tag, "with": tag, "ok": ok and resumed, "last": last,
            "resumed": resumed}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compat", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", action="append", default=None,
                        help="an interpreter with the project installed (repeatable; "
                             "default: this one)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    pythons = args.python or [sys.executable]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="unet-compat-"))
    work.mkdir(parents=True, exist_ok=True)
    try:   # one dataset for every interpreter: its bytes do not depend on torch
        dataset = step_dataset(work / "data", SOURCE, "64x64")
    except RuntimeError as exc:
        raise SystemExit(f"compat: could not build the dataset: {exc}") from None
    tags = [f"torch{torch_version(p).split('+')[0]}-{i}" for i, p in enumerate(pythons)]
    runs = [check_one(p, t, dataset, work) for p, t in zip(pythons, tags)]
    trained = [t for t, r in zip(tags, runs) if r["train"]["ok"]]
    resumes = [check_resume(p, t, src, dataset, work)
               for (p, t), src in itertools.product(zip(pythons, tags), trained) if src != t]
    report = {"runs": runs, "resumes": resumes, "workdir": str(work)}
    for run in runs:
        convert = run.get("convert", {})
        problem = "" if convert.get("ok") else convert.get("last") or run["train"]["last"]
        print(f"{run['torch']:>14}  train {'ok' if run['train']['ok'] else 'FAILED'}  "
              f"convert {'ok' if convert.get('ok') else 'FAILED' if convert else '-'}  "
              f"({run['seconds']} s)  {problem}")
    for resume in resumes:
        print(f"  resume {resume['from']} with {resume['with']}: "
              f"{'ok' if resume['ok'] else 'FAILED: ' + resume['last']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    failed = [r for r in runs if not r.get("convert", {}).get("ok")] + \
        [r for r in resumes if not r["ok"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
