"""Four local runs at once against one S3 server: distinct keys, all succeed, nothing lost.

Each run is its own ``run_workflow`` process (the runner points its process's AWS_* at the
run's S3, so runs share a server, not a process) executing the hand-written three-task DAG
of the local-runner tests (produce → consume → produce, directory, tar and explicit-key
artifacts) with its own message. Cheap on 2 cores; the keys and the runner are the point.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from steps import storage
from test_local_runner import chain

pytestmark = [pytest.mark.faults, pytest.mark.s3, pytest.mark.slow]
RUNS = 4
BUCKET = "faults-concurrent"
DRIVER = """
import json, sys
from pathlib import Path
from emulator.runner import run_workflow
workflow, root, message = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]), sys.argv[3]
result = run_workflow(workflow, run_dir=root / "state", output_dir=root / "outputs",
                      bucket=sys.argv[4], parameters={"msg": message}, backoff_scale=0.0,
                      echo=None, log=lambda line: None)
print(json.dumps({"name": result.workflow_name, "phase": result.phase,
                  "pods": {n.task: n.pod_name for n in result.nodes}}))
sys.exit(result.exit_code)
"""


def test_four_runs_at_once_share_one_server_without_collisions(s3, tmp_path):
    spec = tmp_path / "workflow.json"
    spec.write_text(json.dumps(chain()))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3.env(), PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", DRIVER, str(spec), str(tmp_path / f"r{i}"),
                               f"run{i}", BUCKET], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(RUNS)]
    runs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        runs.append(json.loads(out.strip().splitlines()[-1]))
    assert all(run["phase"] == "Succeeded" for run in runs)
    names = [run["name"] for run in runs]
    assert len(set(names)) == RUNS

    client = s3.client()
    everything = set(storage.list_keys(f"s3://{BUCKET}/", client=client))
    per_run = []
    for i, run in enumerate(runs):
        mine = {k for k in everything if k.startswith(f"{run['name']}/")
                or k.startswith(f"models/lr/{run['name']}/")}
        per_run.append(mine)

        def read(key: str) -> bytes:
            return client.get_object(Bucket=BUCKET, Key=key)["Body"].read()

        a, b = run["pods"]["a"], run["pods"]["b"]
        assert read(f"{run['name']}/{a}/text/text.txt") == f"run{i}".encode()
        assert read(f"{run['name']}/{b}/shout/text.txt") == f"RUN{i}".encode()
        assert read(f"models/lr/{run['name']}/text.txt") == f"RUN{i}".encode()
        for prefix in (f"{run['name']}/{a}/text", f"{run['name']}/{b}/shout"):
            fetched = tmp_path / "check" / prefix
            storage.download_dir(f"s3://{BUCKET}/{prefix}", fetched, client=client,
                                 artifact="text", progress=False)   # complete, per manifest
        outputs = Path(tmp_path / f"r{i}" / "outputs" / "text" / "text.txt")
        assert outputs.read_text() == f"again-run{i}"
    assert all(len(keys) == len(per_run[0]) > 0 for keys in per_run)
    assert set().union(*per_run) <= everything
    assert sum(map(len, per_run)) == len(set().union(*per_run))   # no key shared by two runs


def test_runs_that_create_the_same_bucket_at_once_all_succeed(s3):
    """Each run creates a missing artifact bucket; two runs racing must not fail either."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import Barrier

    from emulator.s3target import S3Target

    rounds, width = 5, 6
    for n in range(rounds):
        target = S3Target(s3.endpoint, s3.access_key, s3.secret_key, s3.region,
                          f"faults-race-{n}")
        barrier = Barrier(width)

        def create(_):
            barrier.wait()
            return target.ensure_bucket()

        with ThreadPoolExecutor(width) as pool:
            created = list(pool.map(create, range(width)))
        assert len(created) == width and target.minio().bucket_exists(target.bucket)
