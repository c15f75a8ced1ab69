"""6. Orchestration: what ``run --local`` adds around the steps' own run time.

Runs the compiled Workflow of the ``local`` profile (smaller with ``--smoke``) with
``workflows.local.run_workflow`` and its embedded S3 server, then reports
overhead = wall time − sum of the steps' own wall time (``RunResult.overhead_seconds``):
S3 start, artifact uploads and downloads, manifest checks, DAG bookkeeping.
"""
from __future__ import annotations

import os
import shutil

from benchmarks.common import Row, Settings

SMOKE_OVERRIDES = ["download.source=synthetic://?cases=5&shape=32x32x12&seed=0",
                   "preprocess.patch_size=32x32", "preprocess.workers=1",
                   "train.max_epochs=1", "train.min_epochs=1", "train.steps_per_epoch=1",
                   "train.batch_size=4", "train.val_batch_size=8", "convert.parity_slices=32"]


def run(settings: Settings) -> dict:
    from workflows.config import load_config
    from workflows.local import run_workflow
    from workflows.unet import build

    overrides = SMOKE_OVERRIDES if settings.smoke else []
    config = load_config(None, None, overrides, local=True)
    run_dir = settings.workdir / "orchestration"
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    result = run_workflow(build(config, "workflow").to_dict(), run_dir=run_dir, env=env,
                          output_dir=run_dir / "outputs", bucket=config.storage.bucket,
                          log=lambda _line: None, echo=None)
    if not result.succeeded:
        raise RuntimeError(f"run --local failed: {result.message}")
    shutil.rmtree(run_dir, ignore_errors=True)
    rows = [Row("orchestration", "overhead s vs sum of step run time", "s",
                result.overhead_seconds, result.step_seconds, "steps' own wall time", "<= 0.05")]
    return {"rows": rows, "details": {
        "profile": "local", "overrides": overrides, "wall_s": result.wall_seconds,
        "step_s": result.step_seconds, "overhead_s": result.overhead_seconds,
        "nodes": [{"task": n.task, "step_s": n.step_seconds, "node_s": n.seconds}
                  for n in result.nodes],
        "note": "step time is each step process's wall time (interpreter and import "
                "included); the embedded SeaweedFS start counts as overhead"}}
