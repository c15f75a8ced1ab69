"""A step's output volume fills up while it writes: one line, no manifest, nothing published.

Two ways to run out: a 256 KiB tmpfs (ENOSPC; needs permission to mount) and a file size
limit (RLIMIT_FSIZE gives EFBIG) set in the step's process.
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, assert_one_error_line

pytestmark = [pytest.mark.faults, pytest.mark.slow]


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("disk-full") / "raw"
    done = _step("download", "--source", "synthetic://?cases=6&shape=48x48x16&seed=2",
                 "--raw", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr
    return out


def _step(name: str, *args: str, limit: int | None = None) -> subprocess.CompletedProcess:
    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return subprocess.run([sys.executable, "-m", f"steps.{name}", *args], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=120, preexec_fn=small_files if limit else None)


@pytest.fixture
def tiny_volume(tmp_path):
    mount = tmp_path / "volume"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here ({done.stderr.strip()}); the "
                    "RLIMIT_FSIZE case covers the step's handling")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def _assert_nothing_published(dataset: Path, stderr: str) -> None:
    assert_one_error_line(stderr, str(dataset), "'dataset'", "disk full")
    assert not dataset.exists()   # the folder the step made is gone, with anything staged in it


def test_full_volume(raw, tiny_volume):
    dataset = tiny_volume / "dataset"
    done = _step("preprocess", "--raw", str(raw), "--dataset", str(dataset), "--workers", "2")
    assert done.returncode == 2, done.stderr[-3000:]
    _assert_nothing_published(dataset, done.stderr)
    with open(tiny_volume / "probe", "wb") as probe:   # the space was given back
        probe.write(b"x" * (128 << 10))


def test_file_size_limit(raw, tmp_path):
    dataset = tmp_path / "dataset"
    done = _step("preprocess", "--raw", str(raw), "--dataset", str(dataset), "--workers", "1",
                 limit=100_000)
    assert done.returncode == 2, done.stderr[-3000:]
    _assert_nothing_published(dataset, done.stderr)
