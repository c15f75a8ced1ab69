"""End-to-end tests of ``python -m steps.train`` on tiny synthetic data (CPU).

The dataset comes from the real download (synthetic://) and preprocess steps.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from train_data import REPO, make_dataset, run_step, step_env

pytestmark = pytest.mark.slow  # trains in step subprocesses

# Tiny network for 64x64 slices: 4 levels (size multiple 8), 8 base filters.
TINY = ["--device", "cpu", "--base-filters", "8", "--levels", "4", "--num-workers", "0",
        "--val-batch-size", "32"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("train-data"), cases=10, shape="64x64x16",
                        seed=3, patch="64x64")


def train(dataset: Path, model: Path, *args: str, timeout: float = 600):
    return run_step("train", "--dataset", str(dataset), "--model", str(model), *TINY, *args,
                    timeout=timeout)


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_cpu_run_learns_and_publishes_the_model_artifact(dataset, tmp_path):
    model = tmp_path / "model"
    done = train(dataset, model, "--batch-size", "16", "--steps-per-epoch", "40",
                 "--max-epochs", "8", "--learning-rate", "4e-3", "--patience", "0")
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((model / "metrics.json").read_text())
    assert metrics["best_mean_dice"] >= 0.7, metrics["epochs"][-1]
    assert len(metrics["epochs"]) == 8
    last = metrics["epochs"][-1]
    assert last["loss"] < metrics["epochs"][0]["loss"]
    assert set(last["dice"]) == {"1", "2", "3"}
    assert last["device"] == "cpu" and last["world_size"] == 1 and last["img_per_s"] > 0
    assert 0 < metrics["first_step_s"] < 60 and metrics["compile_cache"] == "off"
    assert f"train: first step {metrics['first_step_s']:.1f} s (compile cache off)" in done.stderr

    best = load(model / "best.pt")
    for key in ("model_state", "model_config", "train_config", "metrics",
                "dataset_manifest_sha256", "patch_size", "channels", "labels",
                "format_version"):
        assert key in best
    assert best["patch_size"] == [64, 64] and best["model_config"]["levels"] == 4
    from steps.artifacts import manifest_digest, require
    assert best["dataset_manifest_sha256"] == manifest_digest(dataset)
    assert best["metrics"]["epoch"]["epoch"] == metrics["best_epoch"]
    require(model, "model")
    outputs = {p.name: p.read_text().strip() for p in (model / "argo-outputs").iterdir()}
    assert float(outputs["mean_dice"]) == pytest.approx(metrics["best_mean_dice"], abs=1e-4)
    assert int(outputs["best_epoch"]) == metrics["best_epoch"]
    assert float(outputs["img_per_s"]) > 0
    page = (model / "report" / "report.html").read_text()
    assert "curves.png" in page and "<pre>" not in page     # opens with a table, no JSON dump
    best_epoch = next(e for e in metrics["epochs"] if e["epoch"] == metrics["best_epoch"])
    assert (f"<tr><th>best mean Dice</th><td>{metrics['best_mean_dice']:.4f} "
            f"(epoch {metrics['best_epoch']})</td></tr>") in page
    assert f"<tr><th>Dice edema</th><td>{best_epoch['dice']['1']:.4f}</td></tr>" in page
    assert (model / "report" / "overlays.png").stat().st_size > 1000

    # The published weights reproduce the recorded Dice (2D inference over whole volumes).
    from steps.dataset import open_cases, read_metadata
    from steps.devices import select_device
    from steps.losses import dice_per_class
    from steps.model import ModelConfig, build_model
    from steps.train import predict_volume
    import numpy as np
    config = ModelConfig.from_dict(best["model_config"])
    net = build_model(config).eval()
    net.load_state_dict(best["model_state"])
    meta = read_metadata(dataset)
    scores = [dice_per_class(predict_volume(net, case.image, select_device("cpu"), 32,
                                            config.size_multiple()),
                             torch.from_numpy(np.array(case.label)), 4)
              for case in open_cases(dataset, meta, meta["folds"][0]["val"])]
    assert float(torch.stack(scores).mean()) == pytest.approx(metrics["best_mean_dice"],
                                                              abs=1e-6)


def test_the_first_epochs_unvalidated_and_a_constant_rate(dataset, tmp_path):
    """NVIDIA's --skip_first_n_eval and a constant rate (the nvidia_2d profile): the first
    epochs have no Dice, the best model comes from a validated one, the report shows a dash
    where there is no Dice, and the rate never moves."""
    model = tmp_path / "model"
    done = train(dataset, model, "--batch-size", "8", "--steps-per-epoch", "3",
                 "--max-epochs", "3", "--skip-first-n-eval", "2", "--lr-schedule", "constant",
                 "--learning-rate", "8e-4", "--patience", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    epochs = json.loads((model / "metrics.json").read_text())["epochs"]
    assert [("mean_dice" in e) for e in epochs] == [False, False, True]
    assert [e["lr"] for e in epochs] == pytest.approx([8e-4] * 3)
    assert load(model / "best.pt")["metrics"]["best_epoch"] == 3   # patience 1 never fired
    assert "epoch 1: loss" in done.stderr and "not validated" in done.stderr
    assert "<td>–</td>" in (model / "report" / "report.html").read_text()


def test_two_process_gloo_ddp_run_publishes_the_same_outputs(dataset, tmp_path):
    """Two gloo ranks publish what one process does, and the launcher leaves no folder of its
    own in the temporary directory."""
    model, temporary = tmp_path / "model", tmp_path / "tmp"
    temporary.mkdir()
    done = run_step("train", "--dataset", str(dataset), "--model", str(model), *TINY,
                    "--devices", "2", "--batch-size", "4", "--steps-per-epoch", "2",
                    "--max-epochs", "1", env=step_env(TMPDIR=str(temporary)))
    assert done.returncode == 0, done.stderr[-3000:]
    # torch's own compile cache (torchinductor_<user>) is there for every later run to reuse
    assert [p.name for p in temporary.iterdir() if not p.name.startswith("torchinductor_")] == []
    metrics = json.loads((model / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["epochs"][0]["world_size"] == 2
    assert metrics["epochs"][0]["batch_size"] == 4
    for name in ("best.pt", "last.pt", "report/report.html", "report/curves.png",
                 "report/overlays.png",
                 "argo-outputs/mean_dice", "MANIFEST.json"):
        assert (model / name).is_file(), name
    assert load(model / "last.pt")["train_config"]["devices"] == 2
    assert done.stderr.count("epoch 1: loss") == 1   # only rank 0 logs


def test_sigkill_mid_epoch_then_resume_gives_bitwise_identical_weights(dataset, tmp_path):
    """The run is killed on 2 threads and resumed where the pod would give it 1: with a fixed
    count (UNET_ADAPT_THREADS=0, as the suite runs) the resume takes the checkpoint's count
    back, since the count orders the float sums (1 and 2 threads differ in the last bits)."""
    args = ["--batch-size", "4", "--steps-per-epoch", "6", "--max-epochs", "2",
            "--checkpoint-minutes", "0.0001", "--patience", "0", "--seed", "7"]
    two = step_env(OMP_NUM_THREADS="2", UNET_ADAPT_THREADS="0")
    straight = tmp_path / "straight"
    done = run_step("train", "--dataset", str(dataset), "--model", str(straight), *TINY,
                    "--checkpoint-uri", str(tmp_path / "ck-a"), *args, env=two)
    assert done.returncode == 0, done.stderr[-3000:]

    ckpts, killed = tmp_path / "ck-b", tmp_path / "killed"
    cmd = [sys.executable, "-m", "steps.train", "--dataset", str(dataset), "--model",
           str(killed), *TINY, "--checkpoint-uri", str(ckpts), *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=two, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            latest = ckpts / "latest"
            if latest.is_file() and int(latest.read_text()[5:15]) >= 8:  # mid epoch 2 of 2
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert not (killed / "MANIFEST.json").exists()
    stopped_at = int((ckpts / "latest").read_text()[5:15])
    assert 8 <= stopped_at < 12

    done = run_step("train", "--dataset", str(dataset), "--model", str(killed), *TINY,
                    "--checkpoint-uri", str(ckpts), "--resume", "auto", *args,
                    env=step_env(OMP_NUM_THREADS="1", UNET_ADAPT_THREADS="0"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"step {stopped_at}" in done.stderr
    assert "train: 2 thread(s), as the checkpoint ran, instead of 1" in done.stderr
    a, b = load(straight / "last.pt")["model_state"], load(killed / "last.pt")["model_state"]
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    metrics = json.loads((killed / "metrics.json").read_text())
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2]
    assert [e["threads"] for e in metrics["epochs"]] == [[2], [2]]
    assert metrics["threads_adaptive"] is False


# ----------------------------------------------------------------------- bad inputs

def _assert_one_line_error(done, needle: str, model: Path) -> None:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert needle in lines[0]
    assert not (model / "MANIFEST.json").exists()


def test_missing_dataset_manifest(tmp_path):
    (tmp_path / "ds").mkdir()
    done = train(tmp_path / "ds", tmp_path / "model")
    _assert_one_line_error(done, "MANIFEST.json is missing", tmp_path / "model")


def test_mismatched_dataset_manifest(dataset, tmp_path):
    import shutil
    copy = tmp_path / "ds"
    shutil.copytree(dataset, copy)
    image = sorted((copy / "cases").glob("*_image.npy"))[0]
    data = bytearray(image.read_bytes())
    data[-1] ^= 0xFF
    image.write_bytes(bytes(data))
    done = train(copy, tmp_path / "model")
    _assert_one_line_error(done, "does not match its sha256", tmp_path / "model")


@pytest.mark.parametrize("args, needle", [
    (["--fold", "7"], "--fold: must be <= 4 (got 7)"),
    (["--devices", "4", "--batch-size", "2"], "--batch-size must be >= devices x nodes"),
    (["--device", "cuda"], "no CUDA GPU found"),
    (["--device", "hpu"], "no Gaudi HPU found"),
    (["--max-epochs", "2", "--skip-first-n-eval", "2"], "--skip-first-n-eval must be < max_epochs"),
])
def test_bad_parameters(dataset, tmp_path, args, needle):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    done = train(dataset, tmp_path / "model", *args)
    _assert_one_line_error(done, needle, tmp_path / "model")


def test_checkpoint_from_another_model_config_is_refused(dataset, tmp_path):
    from steps.checkpoints import CheckpointStore
    from steps.model import ModelConfig
    store = CheckpointStore(str(tmp_path / "ck"))
    other = ModelConfig(base_filters=16, levels=4).to_dict()
    store.save({"model_config": other, "model_state": {}}, step=3)
    done = train(dataset, tmp_path / "model", "--checkpoint-uri", str(tmp_path / "ck"))
    _assert_one_line_error(done, "incompatible: it was trained with base_filters=16",
                           tmp_path / "model")
