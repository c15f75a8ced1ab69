"""benchmarks.fileserver: the Range server that serves the synthetic Task01 tar, and the
download step fetching a tar from it as a user does (md5 check, resume after a cut link)."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import urllib.request
from pathlib import Path
from urllib.error import HTTPError

import pytest

from benchmarks.fileserver import FileServer, byte_range, validators
from steps import synthetic
from steps.artifacts import require

NAME = "Task01_BrainTumour.tar"


@pytest.fixture(scope="module")
def tar(tmp_path_factory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("served") / NAME
    return path, synthetic.write_msd_tar(path, cases=2, shape=(48, 48, 24), seed=7,
                                         test_cases=1)


def fetch(url: str, **headers: str) -> tuple[int, dict, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers)) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@pytest.mark.parametrize("header, size, expected", [
    (None, 100, None), ("bytes=10-", 100, (10, 99)), ("bytes=10-19", 100, (10, 19)),
    ("bytes=90-200", 100, (90, 99)), ("bytes=-30", 100, (70, 99)), ("bytes=-300", 100, (0, 99)),
    ("bytes=100-", 100, "416"), ("bytes=-0", 100, "416"), ("bytes=20-10", 100, None),
    ("bytes=0-1,5-6", 100, None), ("items=0-5", 100, None), ("bytes=-", 100, None),
])
def test_byte_range(header, size, expected):
    assert byte_range(header, size) == expected


def test_ranges_validators_and_if_range(tar):
    path, _ = tar
    data = path.read_bytes()
    etag, modified = validators(path)
    with FileServer({f"/{NAME}": path}) as server:
        url = server.url(f"/{NAME}")
        status, headers, body = fetch(url)
        assert (status, body, headers["ETag"], headers["Last-Modified"]) == (200, data, etag,
                                                                           modified)
        status, headers, body = fetch(url, Range="bytes=1000-")
        assert (status, body) == (206, data[1000:])
        assert headers["Content-Range"] == f"bytes 1000-{len(data) - 1}/{len(data)}"
        assert fetch(url, Range="bytes=1000-", **{"If-Range": etag})[2] == data[1000:]
        assert fetch(url, Range="bytes=1000-", **{"If-Range": modified})[2] == data[1000:]
        stale = fetch(url, Range="bytes=1000-", **{"If-Range": '"other"'})
        assert stale[:1] + stale[2:] == (200, data)       # a changed file: the whole of it
        status, headers, _ = fetch(url, Range=f"bytes={len(data)}-")
        assert (status, headers["Content-Range"]) == (416, f"bytes */{len(data)}")
        assert fetch(server.url("/other.tar"))[0] == 404
    assert [r.status for r in server.log] == [200, 206, 206, 206, 200, 416, 404]
    assert server.bytes_sent == 2 * len(data) + 3 * (len(data) - 1000)


def test_download_resumes_through_cut_links_and_checks_md5(tar, tmp_path):
    """Two bodies cut a third of the way in: the step resumes each with Range and If-Range,
    and publishes a raw artifact from a tar whose md5 it checked."""
    path, md5 = tar
    size = path.stat().st_size
    with FileServer({f"/{NAME}": path}, cut_after=size // 3, cuts=2) as server:
        raw = tmp_path / "raw"
        done = subprocess.run(
            [sys.executable, "-m", "steps.download", "--source", server.url(f"/{NAME}"),
             "--md5", md5, "--raw", str(raw), "--no-progress"],
            capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    resumed = [r for r in server.log if r.range]
    assert [r.status for r in server.log] == [200, 206, 206]
    assert [r.range for r in resumed] == [f"bytes={size // 3}-", f"bytes={2 * (size // 3)}-"]
    assert server.bytes_sent == size                       # nothing fetched twice
    manifest = require(raw, "raw")
    assert sum(f["path"].endswith(".nii.gz") for f in manifest["files"]) == 5
    assert md5 == hashlib.md5(path.read_bytes()).hexdigest()


def test_download_refuses_the_served_tar_with_another_md5(tar, tmp_path):
    path, md5 = tar
    wrong = "0" * 32
    with FileServer({f"/{NAME}": path}) as server:
        done = subprocess.run(
            [sys.executable, "-m", "steps.download", "--source", server.url(f"/{NAME}"),
             "--md5", wrong, "--raw", str(tmp_path / "raw"), "--no-progress"],
            capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "md5 mismatch" in done.stderr and md5 in done.stderr
    assert not (tmp_path / "raw").exists() or not any((tmp_path / "raw").iterdir())
