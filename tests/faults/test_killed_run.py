"""One real ``run --local`` DAG, fanned out over two folds, whose fold-1 train process is
SIGKILLed mid-epoch, then retried: that fold's train alone runs again, from its checkpoint.

The same run is scanned for its credentials: compiled YAML, logs, run record and every stored
object. Its trained weights are compared with an uninterrupted bare ``steps.train`` run on
the same ``dataset`` artifact (CPU, fixed seed: bitwise equal).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO
from steps import storage
from workflows.config import load_config
from emulator.runner import run_workflow
from workflows.unet import build, render

pytestmark = [pytest.mark.faults, pytest.mark.slow]

BUCKET = "faults-killed-run"
STEPS_PER_EPOCH = 8             # the kill window is the 6 steps inside epoch 2
OVERRIDES = [
    "download.source=synthetic://?cases=6&shape=48x48x16&seed=5",
    "preprocess.workers=1", "preprocess.patch_size=48x48",
    "train.base_filters=4", "train.levels=4", "train.batch_size=4", "train.val_batch_size=16",
    "train.min_epochs=2", "train.max_epochs=2", f"train.steps_per_epoch={STEPS_PER_EPOCH}",
    "train.patience=0", "train.seed=7", "train.checkpoint_minutes=0.0001",
    f"storage.bucket={BUCKET}", "retry.limit=1",
    "resources.extra_env={OMP_NUM_THREADS: '1'}",   # the bare run below uses the same
    "pipeline.stages=[download,preprocess,train,convert,evaluate]",  # no INT8 gate: 16 steps
    "pipeline.folds=[0,1]",
]
KILLED = 1                      # the fold whose train is killed
TRAIN = f"train-fold-{KILLED}"


def _train_pids(run_dir: Path) -> list[int]:
    """The steps.train processes of this run's fold KILLED (found by their command line)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"steps.train" in cmd and any(str(run_dir).encode() in part for part in cmd) \
                and cmd[cmd.index(b"--fold") + 1] == str(KILLED).encode():
            pids.append(int(entry.name))
    return pids


def _latest_step(client) -> int | None:
    found = client.list_objects_v2(Bucket=BUCKET, Prefix="checkpoints/").get("Contents", [])
    latest = [o["Key"] for o in found if o["Key"].endswith(f"/fold-{KILLED}/latest")]
    if not latest:
        return None
    text = client.get_object(Bucket=BUCKET, Key=latest[0])["Body"].read().decode()
    return int(re.search(r"ckpt-(\d{10})", text).group(1))


def _kill_mid_second_epoch(s3, run_dir: Path, done: threading.Event) -> int:
    """SIGKILL the train process once a checkpoint inside epoch 2 exists; return its step.

    One client for all polls: a new boto3 client per poll made polls slower than train steps.
    """
    client = s3.client()
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and not done.is_set():
        step = _latest_step(client)
        pids = _train_pids(run_dir)
        if step is not None and STEPS_PER_EPOCH < step < 2 * STEPS_PER_EPOCH - 1 and pids:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            return _latest_step(client)   # a checkpoint may have landed since the poll
        time.sleep(0.05)
    raise AssertionError("the train step ended (or never reached epoch 2) before the kill")


@pytest.fixture(scope="module")
def killed_run(s3, tmp_path_factory):
    root = tmp_path_factory.mktemp("killed-run")
    cfg = load_config(None, "local", OVERRIDES, local=True)
    workflow = build(cfg, "workflow").to_dict()
    s3.client().create_bucket(Bucket=BUCKET)   # a bucket of its own: no other test's keys
    lines: list[str] = []
    box: dict = {}
    finished = threading.Event()

    def go():
        try:
            box["result"] = run_workflow(workflow, run_dir=root / "state",
                                         output_dir=root / "outputs", env=s3.env(),
                                         bucket=BUCKET, backoff_scale=0.0, echo=None,
                                         log=lines.append)
        finally:
            finished.set()

    runner = threading.Thread(target=go)
    runner.start()
    try:
        killed_at = _kill_mid_second_epoch(s3, root / "state", finished)
    finally:
        runner.join(timeout=600)
    assert "result" in box, "the runner raised; see the test log"
    return {"result": box["result"], "killed_at": killed_at, "root": root, "cfg": cfg,
            "workflow": workflow, "lines": lines}


def _bare_train_args(workflow: dict) -> list[str]:
    """The train template's args with the DAG's parameter values filled in."""
    templates = {t["name"]: t for t in workflow["spec"]["templates"]}
    wf_params = {p["name"]: p.get("value", "") for p in workflow["spec"]["arguments"]["parameters"]}
    task = next(t for tmpl in templates.values() for t in (tmpl.get("dag") or {}).get("tasks", [])
                if t["name"] == TRAIN)
    inputs = {p["name"]: re.sub(r"\{\{workflow\.parameters\.([\w-]+)\}\}",
                                lambda m: wf_params[m.group(1)], p["value"])
              for p in task["arguments"]["parameters"]}
    return [re.sub(r"\{\{inputs\.parameters\.([\w-]+)\}\}", lambda m: inputs[m.group(1)], a)
            for a in templates["train"]["container"]["args"]]


def _state(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_killed_train_resumes_and_matches_an_uninterrupted_run(killed_run, s3, tmp_path):
    result, killed_at = killed_run["result"], killed_run["killed_at"]
    assert result.succeeded, result.message
    train = result.node(TRAIN)
    assert train.attempts == 2 and train.phase == "Succeeded"
    # that fold's train alone ran again; the other fold, the pool and the ensemble once each
    assert {n.task: n.attempts for n in result.nodes if n.task != TRAIN} == {
        n.task: 1 for n in result.nodes if n.task != TRAIN}
    assert {"train-fold-0", "evaluate-fold-1", "pool", "ensemble"} <= {
        n.task for n in result.nodes if n.phase == "Succeeded"}
    log = Path(train.log_path).read_text()
    resumed = int(re.search(r"step (\d+)", log.split("resum", 1)[1]).group(1))
    assert killed_at - STEPS_PER_EPOCH <= resumed <= killed_at  # lost at most one epoch
    model = tmp_path / "dag-model"
    storage.download_dir(train.artifacts["model"].uri, model, client=s3.client(),
                         artifact="model", progress=False)
    epochs = json.loads((model / "metrics.json").read_text())["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2]

    # The bare step, uninterrupted, on the same dataset artifact with the same arguments.
    dataset = tmp_path / "dataset"
    storage.download_dir(result.node("preprocess").artifacts["dataset"].uri, dataset,
                         client=s3.client(), artifact="dataset", progress=False)
    args = _bare_train_args(killed_run["workflow"])
    swap = {"{{inputs.artifacts.dataset.path}}": str(dataset),
            "{{outputs.artifacts.model.path}}": str(tmp_path / "bare")}
    args = [swap.get(a, a) for a in args]
    args[args.index("--checkpoint-uri") + 1] = str(tmp_path / "bare-ckpt")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    done = subprocess.run([sys.executable, "-m", "steps.train", *args], cwd=REPO,
                          env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = _state(tmp_path / "bare" / "last.pt"), _state(model / "last.pt")
    assert a["model_state"].keys() == b["model_state"].keys()
    assert all(torch.equal(a["model_state"][k], b["model_state"][k]) for k in a["model_state"])


def _all_objects(s3) -> dict[str, bytes]:
    client = s3.client()
    keys = storage.list_keys(f"s3://{BUCKET}/", client=client)
    return {key: client.get_object(Bucket=BUCKET, Key=key)["Body"].read() for key in keys}


def test_credentials_appear_in_no_yaml_log_or_artifact(killed_run, s3):
    secrets = {"secret key": s3.secret_key.encode(), "access key": s3.access_key.encode()}
    root = killed_run["root"]
    places: dict[str, bytes] = {
        "compiled workflow": render(killed_run["cfg"], "workflow").encode(),
        "compiled template": render(killed_run["cfg"], "template").encode(),
        "runner log": "\n".join(killed_run["lines"]).encode(),
    }
    for path in root.rglob("*"):
        if path.is_file():  # pod logs, result.json, step files, copied outputs
            places[str(path.relative_to(root))] = path.read_bytes()
    places.update({f"s3://{BUCKET}/{k}": v for k, v in _all_objects(s3).items()})
    assert any(p.endswith("main.log") for p in places) and any(".onnx" in p for p in places)
    assert any("checkpoints/" in p for p in places)
    leaks = [(what, where) for where, data in places.items()
             for what, value in secrets.items() if value in _without_share_links(data, what)]
    print(f"scanned {len(places)} files and objects for the run's credentials")
    assert leaks == []
    # The secret key is nowhere, not even in the share link; the link does carry the key id.
    links = [u for u in _SHARE_LINK.findall(places["runner log"])]
    assert links and all(secrets["secret key"] not in u for u in links)


# A SigV4 presigned URL names the access key id (X-Amz-Credential=<id>/...) by design; it is
# the run's share link, printed and recorded on purpose. Everything else must not.
_SHARE_LINK = re.compile(rb"https?://[^\s\"']*X-Amz-Credential=[^\s\"']*")


def _without_share_links(data: bytes, what: str) -> bytes:
    return _SHARE_LINK.sub(b"<share link>", data) if what == "access key" else data
