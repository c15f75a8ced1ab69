"""6. Orchestration: what ``run --local`` adds around the steps' own run time.

Runs the compiled Workflow of the ``local`` profile (smaller with ``--smoke``) with
``workflows.local.run_workflow`` and its embedded S3 server, then reports
overhead = wall time − sum of the steps' own wall time (``RunResult.overhead_seconds``):
S3 start, artifact uploads and downloads, manifest checks, DAG bookkeeping. A second run
against an S3 server that is already up separates the embedded server's start from the rest.
"""
from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

from benchmarks.common import Row, Settings

if TYPE_CHECKING:
    from workflows.local.results import RunResult

SMOKE_OVERRIDES = ["download.source=synthetic://?cases=5&shape=32x32x12&seed=0",
                   "preprocess.patch_size=32x32", "preprocess.workers=1",
                   "train.max_epochs=1", "train.min_epochs=1", "train.steps_per_epoch=1",
                   "train.batch_size=4", "train.val_batch_size=8", "convert.parity_slices=32",
                   # one training step makes no model the INT8 gate can judge
                   "pipeline.stages=[download,preprocess,train,convert]"]


def _local_run(config, run_dir, env) -> "RunResult":
    from workflows.local.runner import run_workflow
    from workflows.unet import build

    shutil.rmtree(run_dir, ignore_errors=True)
    result = run_workflow(build(config, "workflow").to_dict(), run_dir=run_dir, env=env,
                          output_dir=run_dir / "outputs", bucket=config.storage.bucket,
                          log=lambda _line: None, echo=None)
    if not result.succeeded:
        raise RuntimeError(f"run --local failed: {result.message}")
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def _external_s3_run(config, run_dir, env) -> "RunResult":
    """The same run against an S3 that is already up (as the docker-compose MinIO is)."""
    from workflows.s3server import SeaweedServer

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
    from workflows.config import load_config

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
