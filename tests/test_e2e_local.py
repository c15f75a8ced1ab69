"""End to end: ``python workflows/unet.py run --local`` runs the real DAG.

The compiled Workflow is executed by the local runner against the real S3 server of the ``s3``
fixture (``AWS_ENDPOINT_URL`` set, as with the docker-compose MinIO). The first run fans out
over two folds (``pipeline.folds``: each fold trained, converted and evaluated, then the
folds' ensemble released and their evaluations pooled); a second run with the same data
inputs, one train on one fold, must take download and preprocess from the memoization cache.
(Killing one fold's train and resuming it on retry is in tests/faults/test_killed_run.py; a
missed INT8 gate failing the workflow with the FP32 model released is in tests/test_cluster.py,
on the real controller and on this emulator side by side.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from steps import bykey, storage

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# Four training steps make no model the INT8 gate can judge: quantize runs in the DAG in
# tests/test_pods.py (in the real image) and on its own in tests/test_quantize.py. Evaluate's
# figures are checked in tests/test_evaluate.py; here, that it runs in the DAG.
TINY = ["-p", "train.max_epochs=1", "-p", "train.steps_per_epoch=4",
        "-p", "pipeline.stages=[download,preprocess,train,convert,evaluate]"]
FOLDS = (0, 1)    # the fan-out's mechanics; all five are the local_5fold profile's
PER_FOLD = ("train", "convert", "evaluate")


def run_local(tmp: Path, s3, *overrides: str, tiny: bool = True, code: int = 0) -> dict:
    env = {**os.environ, **s3.env()}
    proc = subprocess.run(
        [sys.executable, str(REPO / "workflows" / "unet.py"), "run", "--local",
         "--run-dir", str(tmp / "run"), "--output-dir", str(tmp / "outputs"),
         *(TINY if tiny else []), *overrides],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == code, proc.stderr[-3000:]
    assert s3.secret_key not in proc.stdout + proc.stderr
    records = sorted((tmp / "run" / "runs").glob("*/result.json"), key=os.path.getmtime)
    return json.loads(records[-1].read_text())


def nodes_by_task(result: dict) -> dict:
    return {node["task"]: node for node in result["nodes"]}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, s3):
    tmp = tmp_path_factory.mktemp("e2e")
    return tmp, run_local(tmp, s3, "-p", f"pipeline.folds=[{','.join(map(str, FOLDS))}]")


def fold_tasks(step: str) -> list[str]:
    return [f"{step}-fold-{k}" for k in FOLDS]


def test_every_node_succeeds_with_artifacts_under_argo_keys(first_run, s3_env, tmp_path):
    tmp, result = first_run
    nodes = nodes_by_task(result)
    assert result["phase"] == "Succeeded"
    tasks = ["download", "preprocess", *[f"{s}-fold-{k}" for k in FOLDS for s in PER_FOLD],
             "ensemble", "pool"]
    assert sorted(nodes) == sorted(tasks)
    assert [nodes[t]["phase"] for t in tasks] == ["Succeeded"] * len(tasks)
    workflow = result["workflow_name"]
    client = storage.client()
    for task, artifact in [("download", "raw"), ("preprocess", "dataset"),
                           *[(t, "model") for t in fold_tasks("train")],
                           *[(t, "exported") for t in fold_tasks("convert") + ["ensemble"]],
                           *[(t, "evaluation") for t in fold_tasks("evaluate")],
                           ("pool", "pooled")]:
        ref = nodes[task]["artifacts"][artifact]
        assert ref["key"] == f"{workflow}/{nodes[task]['pod_name']}/{artifact}"
        local = tmp_path / task / artifact
        storage.download_dir(f"s3://{ref['bucket']}/{ref['key']}", local, client=client)
        kind = "pooled-evaluation" if artifact == "pooled" else artifact
        assert json.loads((local / "MANIFEST.json").read_text())["artifact"] == kind


def test_preprocess_saved_its_dataset_by_key_as_it_ran(first_run, s3_env):
    """Run as Argo runs it, with ``--dataset-uri`` at its output's key: its last line counts
    exactly the bytes of the cases under that key; the executor saved the rest."""
    _, result = first_run
    node = nodes_by_task(result)["preprocess"]
    ref = node["artifacts"]["dataset"]
    objects = storage.list_objects(f"s3://{ref['bucket']}/{ref['key']}")
    cases = sum(size for key, (size, _) in objects.items() if "/cases/" in key)
    log = Path(node["log_path"]).read_text(errors="replace")
    assert cases > 0 and bykey.saved_bytes(log) == {"dataset": cases}


def test_each_fold_trains_on_its_own_split_and_checkpoints_apart(first_run, s3_env):
    """Each fold's model held its own fold out (the ensemble's card lists what each member's
    training recorded), and each fold's checkpoints are under its own prefix."""
    tmp, result = first_run
    card = json.loads((tmp / "outputs" / "exported" / "model-card.json").read_text())
    assert [m["training"]["config"]["fold"] for m in card["ensemble"]["members"]] == list(FOLDS)
    for k in FOLDS:
        store = f"s3://{result['bucket']}/checkpoints/{result['workflow_name']}/fold-{k}/"
        assert any(key.endswith(".pt") for key in storage.list_keys(store)), store


def test_the_ensemble_of_the_folds_is_released_with_parity_and_runs(first_run, s3_env,
                                                                   tmp_path):
    tmp, result = first_run
    workflow = result["workflow_name"]
    released = f"s3://{result['bucket']}/models/unet2d-brats/{workflow}"
    keys = storage.list_keys(released)
    assert any(key.endswith("unet2d.onnx") for key in keys), keys
    parity = json.loads((tmp / "outputs" / "exported" / "parity.json").read_text())
    assert parity["passed"] is True and parity["max_abs_softmax_diff"] <= 1e-4
    card = json.loads((tmp / "outputs" / "exported" / "model-card.json").read_text())
    assert card["folds"] == list(FOLDS)
    pooled = json.loads((tmp / "outputs" / "exported" / "cross-validation.json").read_text())
    assert card["cross_validation"]["mean"] == pooled["mean"]      # the pool's table, released
    assert {k: card["cross_validation"]["postprocessing"][k] for k in pooled["postprocessing"]} \
        == pooled["postprocessing"]
    for task in fold_tasks("convert"):
        assert float(nodes_by_task(result)[task]["parameters"]["max-abs-diff"]) <= 1e-3

    import onnxruntime as ort
    onnx_path = tmp_path / "unet2d.onnx"
    storage.download_file(f"{released}/unet2d.onnx", onnx_path, progress=False)
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    logits = session.run(["logits"], {"image": np.zeros((2, 4, 64, 64), np.float32)})[0]
    assert logits.shape == (2, 4, 64, 64) and np.isfinite(logits).all()


def test_each_fold_is_evaluated_on_its_held_out_cases_and_the_pool_joins_them(
        first_run, s3_env, tmp_path):
    """Each fold's exported model on its held-out cases, whole; the pool's table covers every
    fold's cases, and its three regions' Dice are the workflow's outputs, as in pooled.json."""
    tmp, result = first_run
    nodes = nodes_by_task(result)
    data = nodes["preprocess"]["artifacts"]["dataset"]
    storage.download_file(f"s3://{data['bucket']}/{data['key']}/dataset.json",
                          tmp_path / "dataset.json", progress=False)
    dataset = json.loads((tmp_path / "dataset.json").read_text())
    for k, task in zip(FOLDS, fold_tasks("evaluate")):
        ref = nodes[task]["artifacts"]["evaluation"]
        storage.download_dir(f"s3://{ref['bucket']}/{ref['key']}", tmp_path / task,
                             client=storage.client())
        evaluation = json.loads((tmp_path / task / "evaluation.json").read_text())
        assert sorted(evaluation["cases"]) == sorted(dataset["folds"][k]["val"])
        assert evaluation["fold"] == k and evaluation["inference"]["mirroring"] is True
    ref = nodes["pool"]["artifacts"]["pooled"]
    storage.download_dir(f"s3://{ref['bucket']}/{ref['key']}", tmp_path / "pooled",
                         client=storage.client())
    pooled = json.loads((tmp_path / "pooled" / "pooled.json").read_text())
    assert pooled["folds"] == list(FOLDS)
    assert sorted(pooled["cases"]) == sorted(c for k in FOLDS for c in dataset["folds"][k]["val"])
    for region in ("WT", "TC", "ET"):   # the workflow's outputs (globalName)
        value = float(nodes["pool"]["parameters"][f"dice-{region.lower()}"])
        assert 0 <= value <= 1 and value == round(pooled["mean"]["dice"][region], 4)
    assert (tmp_path / "pooled" / "pooled.html").read_text().startswith("<!doctype")
    assert (tmp / "outputs" / "exported" / "cross-validation.html").read_text() == \
        (tmp_path / "pooled" / "pooled.html").read_text()


def test_second_run_takes_data_steps_from_the_memoization_cache(first_run, s3, s3_env):
    tmp, first = first_run
    second = run_local(tmp, s3, "-p", "train.steps_per_epoch=2")
    before, after = nodes_by_task(first), nodes_by_task(second)
    assert second["workflow_name"] != first["workflow_name"]
    for task, artifact in [("download", "raw"), ("preprocess", "dataset")]:
        assert after[task]["memoized"] is True
        assert after[task]["artifacts"][artifact]["key"] == before[task]["artifacts"][artifact]["key"]
    assert after["train"]["memoized"] is False
    assert [after[t]["phase"] for t in ("train", "convert", "evaluate")] == ["Succeeded"] * 3
    released = f"s3://{second['bucket']}/models/unet2d-brats/{second['workflow_name']}"
    assert any(key.endswith("unet2d.onnx") for key in storage.list_keys(released))
