"""The container executors (emulator/pods.py): each step in its real image, run as its
pod runs on a cluster.

The engine arguments are checked without an engine. Everything else runs the real CPU image
(``containers/podman/build.sh``) under podman: a wave-1 pod that cannot write its output,
and the whole DAG end to end. Without podman or the image these tests skip with the reason;
CI sets ``UNET_REQUIRE_CONTAINERS=1``, which turns that skip into a failure.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from steps import storage
from train_data import OPEN_GATE
from workflows.config import load_config
from emulator import pods
from emulator.errors import LocalRunError
from emulator.runner import run_workflow
from workflows.unet import build

REPO = Path(__file__).resolve().parents[1]
REQUIRED = os.environ.get("UNET_REQUIRE_CONTAINERS") == "1"
# a bucket of its own: these runs memoize download, and another module's run of the same
# source would take its entry (preprocess reads raw by key from the workflow's bucket)
CFG = load_config(None, None, ["storage.bucket=test-pods"], local=True)
IMAGE = f"{CFG.images.cpu.repository}:{CFG.images.cpu.tag}"


def _image_problem() -> str:
    if shutil.which("podman") is None:
        return "podman is not installed (containers/podman/setup.sh)"
    engine = pods.Engine("podman")
    if engine.labels(IMAGE) is None:
        return f"image {IMAGE} is not built (containers/podman/build.sh)"
    return engine.stale(IMAGE)


@pytest.fixture(scope="module")
def image():
    problem = _image_problem()
    if problem:
        if REQUIRED:
            pytest.fail(f"UNET_REQUIRE_CONTAINERS=1 but {problem}")
        pytest.skip(problem)
    return IMAGE


# ---- without an engine ---------------------------------------------------------------------
def test_create_arguments_follow_the_pod():
    pod = pods.Pod(name="wf-train-1", image="ghcr.io/x/unet-cpu:0.1.0", pull_policy="Never",
                   command=["python", "-m", "steps.train"], args=["--dataset", "/data/d"],
                   env={"AWS_SECRET_ACCESS_KEY": "s3cr3t", "A": "1"},
                   volumes=[pods.Volume("work", "/data", size_bytes=2**30),
                            pods.Volume("dshm", "/dev/shm", "Memory", 2**30),
                            pods.Volume("hugepage", "/hugepages", "HugePages")],
                   inputs={}, outputs=["/data/m"], user="1000:1000", groups=[1000], gpus=2)
    argv = pods._create_args(pod, [("wf-train-1-work", "/data", ""),
                                   ("wf-train-1-in", "/in", ":ro")])
    text = " ".join(argv)
    assert "--user 1000:1000" in text and "--group-add 1000" in text
    assert "--pull never" in text and "--shm-size 1073741824" in text and "--gpus 2" in text
    assert "-v wf-train-1-work:/data -v wf-train-1-in:/in:ro" in text
    assert "/hugepages" not in text
    assert "-e AWS_SECRET_ACCESS_KEY" in text and "s3cr3t" not in text  # values by name
    assert argv[argv.index("--entrypoint"):] == [
        "--entrypoint", "python", "ghcr.io/x/unet-cpu:0.1.0", "-m", "steps.train",
        "--dataset", "/data/d"]
    assert not any(arg.startswith("/") and ":" in arg for arg in argv)  # no host path mounted


def test_security_context_layers_and_the_kubelets_refusal():
    spec = {"securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                                "runAsNonRoot": True}}
    template = {"container": {"securityContext": {"runAsUser": 1001}}}
    assert pods.security(spec, template, "t") == ("1001:1000", [1000])
    assert pods.security({}, {"container": {}}, "t") == (None, [])
    template["container"]["securityContext"]["runAsUser"] = 0
    with pytest.raises(LocalRunError, match="runAsNonRoot"):
        pods.security(spec, template, "t")


def test_only_podman_or_docker():
    with pytest.raises(LocalRunError, match="podman or docker"):
        pods.Engine("/bin/sh")


# ---- in the real image -----------------------------------------------------------------------
def _pipeline(*tasks: str, strip: tuple[str, ...] = ()) -> dict:
    """The local profile's Workflow cut down to ``tasks``; ``strip`` removes the work volume
    from those templates, as the wave-1 YAML had it."""
    doc = build(CFG).to_dict()
    for tmpl in doc["spec"]["templates"]:
        if tmpl["name"] in strip:
            tmpl.pop("volumes")
            tmpl["container"].pop("volumeMounts")
        if "dag" in tmpl:
            tmpl["dag"]["tasks"] = [t for t in tmpl["dag"]["tasks"] if t["name"] in tasks]
    return doc


@pytest.fixture
def run(s3, tmp_path):
    def go(doc: dict):
        return run_workflow(doc, executor="podman", run_dir=tmp_path / "state",
                            env=s3.env(), bucket=CFG.storage.bucket, echo=None, log=lambda _: None,
                            backoff_scale=0.0)
    return go


def test_a_wave1_pod_cannot_write_its_output_in_the_real_image(image, run):
    """The issue's outside check, reproduced by the executor: no volume, uid 1000, /data is
    the image's (download; preprocess too, which reads its input by key and mounts none) or
    runc's for the input mount (train): Permission denied."""
    result = run(_pipeline("download", strip=("download",)))
    node = result.node("download")
    assert node.phase == "Failed" and "exit code 2" in node.message
    assert "error: output directory /data/raw for 'raw': cannot create it (Permission " \
        "denied: /data)" in Path(node.log_path).read_text()
    result = run(_pipeline("download", "preprocess", "train", strip=("preprocess", "train")))
    assert result.node("download").phase == "Succeeded"
    node = result.node("preprocess")
    assert node.phase == "Failed" and "exit code 2" in node.message
    assert "error: output directory /data/dataset for 'dataset': cannot create it (Permission " \
        "denied: /data)" in Path(node.log_path).read_text()
    result = run(_pipeline("download", "preprocess", "train", strip=("train",)))
    assert result.node("preprocess").phase == "Succeeded"
    node = result.node("train")
    assert node.phase == "Failed" and "exit code 2" in node.message
    assert "cannot create it (Permission denied: /data/model)" in \
        Path(node.log_path).read_text()


def test_leftovers_are_removed(image, run):
    result = run(_pipeline("download"))
    assert result.succeeded, result.message
    engine = pods.Engine("podman")
    names = engine("ps", "--all", "--format", "{{.Names}}").stdout.split()
    volumes = engine("volume", "ls", "--format", "{{.Name}}").stdout.split()
    assert not [n for n in names + volumes if n.startswith(result.workflow_name)]


@pytest.mark.slow
def test_the_whole_dag_runs_in_the_real_image(image, s3_env, tmp_path):
    """download -> preprocess -> train (cpu, checkpoints to the run's S3) -> convert ->
    quantize, each in ghcr.io/unet-argo/unet-cpu as uid 1000 with only its work volume,
    artifacts through S3. The local profile's training, so that quantize has a model that
    segments; the hand-offs are under test here, not where the INT8 gate falls (it varies
    with the CPU: tests/test_quantize_gate.py, benchmarks/margins.py), so the gate is one no
    model can miss."""
    s3 = s3_env
    env = {**os.environ, **s3.env()}
    proc = subprocess.run(
        [sys.executable, str(REPO / "workflows" / "unet.py"), "run", "--local",
         "--executor", "podman", "--run-dir", str(tmp_path / "run"),
         "--output-dir", str(tmp_path / "outputs"),
         "-p", "download.source=synthetic://?cases=10&shape=64x64x24&seed=3",  # no cache hit
         *[arg for gate in OPEN_GATE for arg in ("-p", gate)]],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s3.secret_key not in proc.stdout + proc.stderr
    result = json.loads(next((tmp_path / "run" / "runs").glob("*/result.json")).read_text())
    nodes = {n["task"]: n for n in result["nodes"]}
    stages = ("download", "preprocess", "train", "convert", "quantize")
    assert [nodes[t]["phase"] for t in stages] == ["Succeeded"] * 5
    assert not any(node["memoized"] for node in nodes.values())  # every step ran here
    workflow = result["workflow_name"]
    assert "executor podman" in proc.stderr
    client = storage.client()
    checkpoints = storage.list_keys(f"s3://{result['bucket']}/checkpoints/{workflow}/",
                                    client=client)
    assert any(k.endswith("/latest") for k in checkpoints), checkpoints
    for task, artifact in [("download", "raw"), ("preprocess", "dataset"),
                           ("train", "model"), ("convert", "exported")]:
        ref = nodes[task]["artifacts"][artifact]
        assert ref["key"] == f"{workflow}/{nodes[task]['pod_name']}/{artifact}"
    for node in nodes.values():
        log = Path(node["log_path"]).read_text()
        assert s3.secret_key not in log
    import onnxruntime as ort
    onnx_path = tmp_path / "outputs" / "exported" / "unet2d.onnx"
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    logits = session.run(["logits"], {"image": np.zeros((2, 4, 64, 64), np.float32)})[0]
    assert logits.shape == (2, 4, 64, 64)
    quantized = tmp_path / "outputs" / "quantized"
    report = json.loads((quantized / "quantization.json").read_text())
    assert (quantized / "unet2d-int8.onnx").is_file()
    assert report["files"]["openvino"] == "unet2d-int8-openvino.xml"   # the image has it
    assert (quantized / "unet2d-int8-openvino.bin").is_file()
    assert json.loads((tmp_path / "outputs" / "exported" / "parity.json").read_text())["passed"]
