"""6. Orchestration: what ``run --local`` adds around the steps' own run time.

Runs the compiled Workflow of the ``local`` profile (smaller with ``--smoke``) with
``emulator.run_workflow`` and its embedded S3 server, then reports
overhead = wall time − sum of the steps' own wall time (``RunResult.overhead_seconds``):
S3 start, artifact uploads and downloads, manifest checks, DAG bookkeeping. A second run
against an S3 server that is already up separates the embedded server's start from the rest.

The real-Argo column: :func:`argo_breakdown` splits a run on Argo's own controller into, per
step, the pod's start (creation to its init container), Argo's input artifacts (the init
container), the step itself (the main container), and its outputs (the wait container after
the main one), from the Workflow's and the pods' status. ``tests/test_cluster.py`` measures
it on the cluster of ``cluster/`` beside the emulator's figures for the same Workflow
(``argo_rows``); Kubernetes' timestamps have 1 s resolution.
"""
from __future__ import annotations

import os
import shutil
from datetime import datetime

from benchmarks.common import Row, Settings
from emulator.results import RunResult
from emulator.runner import run_workflow
from workflows.config import load_config
from workflows.s3server import SeaweedServer
from workflows.unet import build

SMOKE_OVERRIDES = ["download.source=synthetic://?cases=5&shape=32x32x12&seed=0",
                   "preprocess.patch_size=32x32", "preprocess.workers=1",
                   "train.max_epochs=1", "train.min_epochs=1", "train.steps_per_epoch=1",
                   "train.batch_size=4", "train.val_batch_size=8", "convert.parity_slices=32",
                   # one training step makes no model the INT8 gate can judge
                   "pipeline.stages=[download,preprocess,train,convert]"]


def _local_run(config, run_dir, env) -> RunResult:
    shutil.rmtree(run_dir, ignore_errors=True)
    result = run_workflow(build(config, "workflow").to_dict(), run_dir=run_dir, env=env,
                          output_dir=run_dir / "outputs", bucket=config.storage.bucket,
                          log=lambda _line: None, echo=None)
    if not result.succeeded:
        raise RuntimeError(f"run --local failed: {result.message}")
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def _external_s3_run(config, run_dir, env) -> RunResult:
    """The same run against an S3 that is already up (as the docker-compose MinIO is)."""
    s3_dir = run_dir.with_name(run_dir.name + "-s3")
    shutil.rmtree(s3_dir, ignore_errors=True)    # no memoized nodes from an earlier run
    with SeaweedServer(s3_dir, buckets=[config.storage.bucket]) as server:
        return _local_run(config, run_dir, {**env, **server.env()})


def _details(result) -> dict:
    return {"wall_s": result.wall_seconds, "step_s": result.step_seconds,
            "overhead_s": result.overhead_seconds,
            "nodes": [{"task": n.task, "step_s": n.step_seconds, "node_s": n.seconds}
                      for n in result.nodes]}


def run(settings: Settings) -> dict:
    overrides = SMOKE_OVERRIDES if settings.smoke else []
    config = load_config(None, None, overrides, local=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    embedded = _local_run(config, settings.workdir / "orchestration", env)
    rows = [Row("orchestration", "overhead s vs sum of step run time", "s",
                embedded.overhead_seconds, embedded.step_seconds, "steps' own wall time",
                "<= 0.05")]
    details = {"profile": "local", "overrides": overrides, **_details(embedded),
               "note": "step time is each step process's wall time (interpreter and import "
                       "included); the embedded SeaweedFS start and stop count as overhead"}
    if not settings.smoke:   # the smoke run proves the runner; this adds a second whole run
        external = _external_s3_run(config, settings.workdir / "orchestration-ext", env)
        rows.append(Row("orchestration", "the same with an S3 already running (compose MinIO)",
                        "s", external.overhead_seconds, external.step_seconds,
                        "steps' own wall time"))
        details["external_s3"] = _details(external)
    return {"rows": rows, "details": details}


# ---- the real Argo controller (tests/test_cluster.py) ----------------------------------------
def _t(stamp: str | None) -> float | None:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else None


def _terminated(pod: dict, name: str, key: str) -> dict:
    for status in (pod.get("status") or {}).get(key) or []:
        if status["name"] == name:
            return (status.get("state") or {}).get("terminated") or {}
    return {}


def pod_phases(pod: dict) -> dict[str, float]:
    """Seconds of one step pod: start (created to init start), inputs (init), gap (init end
    to main start), step (main), outputs (main end to wait end)."""
    init = _terminated(pod, "init", "initContainerStatuses")
    main = _terminated(pod, "main", "containerStatuses")
    wait = _terminated(pod, "wait", "containerStatuses")
    t = {"created": _t(pod["metadata"]["creationTimestamp"]), "init0": _t(init.get("startedAt")),
         "init1": _t(init.get("finishedAt")), "main0": _t(main.get("startedAt")),
         "main1": _t(main.get("finishedAt")), "wait1": _t(wait.get("finishedAt"))}
    if None in t.values():
        raise ValueError(f"pod {pod['metadata']['name']}: a container did not run to its end")
    return {"start_s": t["init0"] - t["created"], "inputs_s": t["init1"] - t["init0"],
            "gap_s": t["main0"] - t["init1"], "step_s": t["main1"] - t["main0"],
            "outputs_s": t["wait1"] - t["main1"]}


def argo_breakdown(workflow: dict, pods: list[dict]) -> dict:
    """Per step pod and in all: where a run on Argo's controller spends its time."""
    status = workflow["status"]
    names = {n["id"]: n["displayName"] for n in status["nodes"].values()}
    steps = {}
    for pod in pods:
        node = pod["metadata"]["annotations"].get("workflows.argoproj.io/node-id") \
            or pod["metadata"]["name"]
        label = names.get(node, pod["metadata"]["name"])
        steps[label] = pod_phases(pod)
    wall = _t(status["finishedAt"]) - _t(status["startedAt"])
    step_total = sum(s["step_s"] for s in steps.values())
    in_pods = sum(sum(s.values()) for s in steps.values())
    # between_s: no pod of the run alive, the controller noticing an end and making the next
    # pod (the DAG is a chain, so pods never overlap).
    return {"workflow": workflow["metadata"]["name"], "wall_s": wall, "step_s": step_total,
            "overhead_s": wall - step_total, "between_s": wall - in_pods, "pods": steps}


def argo_rows(argo: dict, emulated: "RunResult") -> list[Row]:
    """The orchestration row's real-Argo column beside the emulator's, same Workflow."""
    return [Row("orchestration", "overhead s vs sum of step run time, emulator (run --local)",
                "s", emulated.overhead_seconds, emulated.step_seconds, "steps' own wall time"),
            Row("orchestration", "the same on Argo v4.0.5's controller (cluster/)", "s",
                argo["overhead_s"], argo["step_s"], "steps' own wall time (main containers)")]
