"""The download step: every source kind, md5, resume, safe extraction, validation, CLI errors."""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from steps import bykey, download, synthetic
from steps.artifacts import require
from steps.errors import StepError

REPO = Path(__file__).resolve().parents[1]
SHAPE = (32, 32, 16)
TASK = synthetic.TASK


# ----------------------------------------------------------------------------- helpers

@pytest.fixture(scope="module")
def msd_tar(tmp_path_factory) -> Path:
    """A small synthetic MSD tar (2 training + 1 test case, with macOS ._ files)."""
    path = tmp_path_factory.mktemp("tar") / "Task01_BrainTumour.tar"
    synthetic.write_msd_tar(path, cases=2, shape=SHAPE, seed=4, test_cases=1)
    return path


def md5_of(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m steps.download ARGS --no-progress`` in a subprocess (stderr: errors only)."""
    flags = [*args, "--no-progress"] if "--help" not in args else list(args)
    return subprocess.run([sys.executable, "-m", "steps.download", *flags], cwd=REPO,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=120)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


def assert_nothing_published(raw: Path) -> None:
    assert not raw.exists() or list(raw.iterdir()) == []


def assert_raw_ok(raw: Path, train: int = 2, test: int = 1) -> dict:
    manifest = require(raw, "raw")
    paths = [entry["path"] for entry in manifest["files"]]
    assert f"{TASK}/dataset.json" in paths
    assert sum(p.startswith(f"{TASK}/imagesTr/") for p in paths) == train
    assert sum(p.startswith(f"{TASK}/labelsTr/") for p in paths) == train
    assert sum(p.startswith(f"{TASK}/imagesTs/") for p in paths) == test
    assert not [p for p in paths if Path(p).name.startswith("._")]
    return manifest


def make_tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"x",
           linkname: str = "") -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    if kind == tarfile.REGTYPE:
        info.size = len(data)
        return info, data
    return info, None


# ----------------------------------------------------------------------------- http server

class _Files(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, files: dict[str, bytes]):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files = files
        self.log: list[tuple[str | None, int]] = []   # (Range header, body bytes sent)
        self.cut_after: int | None = None              # first GET stops after this many bytes
        self.fail_first = 0                            # first GETs answered with 503
        self.ignore_range = False                      # answer Range requests with 200
        self.on_request = lambda: None                 # called as each GET arrives

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # keep test output quiet
        pass

    def do_GET(self):
        server: _Files = self.server  # type: ignore[assignment]
        server.on_request()
        data = server.files.get(self.path)
        if server.fail_first:
            server.fail_first -= 1
            return self._empty(503)
        if data is None:
            return self._empty(404)
        header = None if server.ignore_range else self.headers.get("Range")
        start = int(re.fullmatch(r"bytes=(\d+)-", header).group(1)) if header else 0
        if start >= len(data) and header:
            return self._empty(416, {"Content-Range": f"bytes */{len(data)}"})
        body = data[start:]
        limit = len(body)
        if server.cut_after is not None:
            limit, server.cut_after = min(limit, server.cut_after), None
            self.close_connection = True
        server.log.append((header, limit))  # before answering: the client may finish first
        self.send_response(206 if header else 200)
        if header:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[:limit])
        self.wfile.flush()

    def _empty(self, status: int, headers: dict | None = None) -> None:
        self.server.log.append((self.headers.get("Range"), 0))  # type: ignore[attr-defined]
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def http_server(msd_tar):
    server = _Files({"/data/Task01_BrainTumour.tar": msd_tar.read_bytes(),
                     "/data/msd.tar": msd_tar.read_bytes()})
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


# ----------------------------------------------------------------------------- sources

def test_synthetic_source(tmp_path):
    raw = tmp_path / "raw"
    download.main(["--source", "synthetic://?cases=2&shape=32x32x16&seed=3&test=1",
                   "--raw", str(raw), "--no-progress"])
    manifest = assert_raw_ok(raw)
    assert manifest["producer"]["parameters"]["source"].startswith("synthetic://")
    meta = json.loads((raw / TASK / "dataset.json").read_text())
    assert meta["numTraining"] == 2


def test_file_tar_source_drops_macos_files(tmp_path, msd_tar):
    with tarfile.open(msd_tar) as tar:
        assert any(Path(n).name.startswith("._") for n in tar.getnames())
    raw = tmp_path / "raw"
    download.main(["--source", f"file://{msd_tar}", "--raw", str(raw), "--md5", md5_of(msd_tar),
                   "--no-progress"])
    assert_raw_ok(raw)
    assert not list(raw.rglob("._*"))
    assert not (tmp_path / ".raw.download").exists()


def test_tar_rooted_at_the_task_directory(tmp_path):
    task = synthetic.write_msd_task(tmp_path / "src", cases=1, shape=SHAPE, seed=2)
    archive = tmp_path / "flat.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(task, arcname=".")
    download.main(["--source", f"file://{archive}", "--raw", str(tmp_path / "raw"),
                   "--no-progress"])
    assert_raw_ok(tmp_path / "raw", train=1, test=0)


def test_file_tar_gz_source(tmp_path, msd_tar):
    gz = tmp_path / "copy.tar.gz"
    with tarfile.open(msd_tar) as src, tarfile.open(gz, "w:gz") as dst:
        for info in src.getmembers():
            dst.addfile(info, src.extractfile(info) if info.isfile() else None)
    download.main(["--source", f"file://{gz}", "--raw", str(tmp_path / "raw"), "--no-progress"])
    assert_raw_ok(tmp_path / "raw")


@pytest.mark.parametrize("parent", [False, True])
def test_file_directory_source(tmp_path, parent):
    task = synthetic.write_msd_task(tmp_path / "src", cases=2, shape=SHAPE, seed=1, test_cases=1)
    (task / "imagesTr" / "._BRATS_001.nii.gz").write_bytes(b"junk")
    raw = tmp_path / "raw"
    source = task.parent if parent else task
    download.main(["--source", f"file://{source}", "--raw", str(raw), "--no-progress"])
    assert_raw_ok(raw)
    assert (raw / TASK / "imagesTr" / "BRATS_001.nii.gz").read_bytes() == \
        (task / "imagesTr" / "BRATS_001.nii.gz").read_bytes()


def test_http_source_with_published_name_uses_given_md5(tmp_path, http_server, msd_tar):
    raw = tmp_path / "raw"
    download.main(["--source", f"{http_server.url}/data/msd.tar", "--raw", str(raw),
                   "--md5", md5_of(msd_tar), "--no-progress"])
    assert_raw_ok(raw)
    assert http_server.log == [(None, msd_tar.stat().st_size)]
    assert not (tmp_path / ".raw.download").exists()


def test_http_resume_after_dropped_connection(tmp_path, http_server, msd_tar):
    size = msd_tar.stat().st_size
    http_server.cut_after = size // 3
    raw = tmp_path / "raw"
    download.main(["--source", f"{http_server.url}/data/msd.tar", "--raw", str(raw),
                   "--no-progress"])
    assert_raw_ok(raw)
    assert http_server.log == [(None, size // 3), (f"bytes={size // 3}-", size - size // 3)]
    assert sum(sent for _, sent in http_server.log) == size


def _files_under(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_http_tar_is_extracted_as_it_arrives_with_no_copy_on_disk(tmp_path, http_server,
                                                                  msd_tar):
    """Without --cache-dir the step holds no copy of the tar: when the cut body is resumed,
    what it has on disk is extracted members (fewer bytes than were sent), no .part or cache
    folder; and the md5 it checks is the whole file's, across both responses."""
    size = msd_tar.stat().st_size
    http_server.cut_after = size // 2
    seen: list[dict[str, int]] = []
    http_server.on_request = lambda: seen.append(_files_under(tmp_path))
    raw = tmp_path / "raw"
    download.main(["--source", f"{http_server.url}/data/msd.tar", "--raw", str(raw),
                   "--md5", md5_of(msd_tar), "--no-progress"])
    assert_raw_ok(raw)
    assert [sent for _, sent in http_server.log] == [size // 2, size - size // 2]
    assert seen[0] == {}
    on_resume = seen[1]
    assert any(name.endswith(".nii.gz") for name in on_resume), on_resume
    assert not [n for n in on_resume if n.endswith((".part", ".tar")) or ".download" in n]
    assert sum(on_resume.values()) < size // 2


def test_http_stream_with_another_md5_publishes_nothing(tmp_path, http_server, msd_tar):
    with pytest.raises(StepError, match=f"md5 mismatch for msd.tar: expected {'0' * 32}, got "
                                        f"{md5_of(msd_tar)}"):
        download.main(["--source", f"{http_server.url}/data/msd.tar", "--raw",
                       str(tmp_path / "raw"), "--md5", "0" * 32, "--no-progress"])
    assert list(tmp_path.iterdir()) == []


def test_http_stream_sent_again_from_zero_is_extracted_again(tmp_path, http_server, msd_tar):
    """A server that answers the resume with the whole file: what was extracted from the
    first half is dropped and the tar extracted again from its start; md5 over the second
    body only."""
    size = msd_tar.stat().st_size
    http_server.cut_after, http_server.ignore_range = size // 2, True
    raw = tmp_path / "raw"
    download.main(["--source", f"{http_server.url}/data/msd.tar", "--raw", str(raw),
                   "--md5", md5_of(msd_tar), "--no-progress"])
    assert_raw_ok(raw)
    assert http_server.log == [(None, size // 2), (None, size)]


def _part_file(cache: Path, uri: str, data: bytes) -> Path:
    cache.mkdir(exist_ok=True)
    part = cache / (download.cache_name(download.parse_source(uri)) + ".part")
    part.write_bytes(data)
    return part


def test_http_resume_from_part_file_of_earlier_run(tmp_path, http_server, msd_tar):
    data = msd_tar.read_bytes()
    uri = f"{http_server.url}/data/msd.tar"
    cache = tmp_path / "cache"
    part = _part_file(cache, uri, data[:1000])
    raw = tmp_path / "raw"
    download.main(["--source", uri, "--raw", str(raw), "--cache-dir", str(cache),
                   "--no-progress"])
    assert_raw_ok(raw)
    assert http_server.log == [("bytes=1000-", len(data) - 1000)]
    # An explicit cache is kept, and its finished file is reused without a request.
    assert not part.exists() and part.with_suffix("").read_bytes() == data
    download.main(["--source", uri, "--raw", str(tmp_path / "again"), "--cache-dir", str(cache),
                   "--no-progress"])
    assert len(http_server.log) == 1


def test_http_server_ignoring_range_restarts_cleanly(tmp_path, http_server, msd_tar):
    data = msd_tar.read_bytes()
    http_server.ignore_range = True
    dest = tmp_path / "x.tar"
    dest.with_name("x.tar.part").write_bytes(b"stale bytes that must not survive")
    download.http_download(f"{http_server.url}/data/msd.tar", dest, progress=False)
    assert dest.read_bytes() == data


def test_a_part_file_longer_than_the_body_is_not_kept_past_it(tmp_path, http_server, msd_tar):
    """A .part whose validator cannot be trusted starts over from byte 0: none of its old
    bytes survive, even past the end of the new body."""
    data = msd_tar.read_bytes()
    dest = tmp_path / "x.tar"
    dest.with_name("x.tar.part").write_bytes(b"s" * (len(data) + 5000))
    dest.with_name("x.tar.part.validator").write_text("not a validator")
    download.http_download(f"{http_server.url}/data/msd.tar", dest, progress=False)
    assert dest.read_bytes() == data


def test_http_complete_part_file_is_accepted(tmp_path, http_server, msd_tar):
    data = msd_tar.read_bytes()
    dest = tmp_path / "x.tar"
    dest.with_name("x.tar.part").write_bytes(data)
    download.http_download(f"{http_server.url}/data/msd.tar", dest, progress=False)
    assert dest.read_bytes() == data
    assert http_server.log == [(f"bytes={len(data)}-", 0)]  # one 416, nothing re-sent


def test_http_transient_errors_are_retried(tmp_path, http_server, msd_tar):
    http_server.fail_first = 2
    dest = tmp_path / "x.tar"
    download.http_download(f"{http_server.url}/data/msd.tar", dest, backoff_s=0.01,
                           progress=False)
    assert dest.read_bytes() == msd_tar.read_bytes()
    assert [sent for _, sent in http_server.log] == [0, 0, msd_tar.stat().st_size]


def test_http_gives_up_after_retries(tmp_path, http_server):
    http_server.fail_first = 10
    with pytest.raises(StepError, match="failed after 3 attempts .*: HTTP 503"):
        download.http_download(f"{http_server.url}/data/msd.tar", tmp_path / "x.tar",
                               retries=2, backoff_s=0.01, progress=False)
    assert len(http_server.log) == 3


@pytest.mark.s3
def test_s3_source(tmp_path, s3, s3_env, msd_tar):
    from steps import storage
    uri = f"s3://{s3.bucket}/datasets/{tmp_path.name}/msd.tar"
    storage.upload_file(msd_tar, uri)
    raw = tmp_path / "raw"
    download.main(["--source", uri, "--raw", str(raw), "--md5", md5_of(msd_tar),
                   "--no-progress"])
    assert_raw_ok(raw)
    assert not (tmp_path / ".raw.download").exists()


@pytest.mark.s3
def test_s3_missing_key_cli_one_line(tmp_path, s3):
    uri = f"s3://{s3.bucket}/datasets/absent/Task01_BrainTumour.tar"
    proc = run_cli("--source", uri, "--raw", str(tmp_path / "raw"), env=s3.env())
    assert_one_line_error(proc, s3.bucket)
    assert s3.secret_key not in proc.stderr
    assert_nothing_published(tmp_path / "raw")


# ----------------------------------------------------------------------------- raw saved by key

def _raw_uri(s3, tmp_path: Path) -> str:
    """The key Argo gives download's output (workflows.templates.artifact_key)."""
    return f"s3://{s3.bucket}/{tmp_path.name}/download-pod/raw"


def _objects(uri: str) -> dict[str, str]:
    """Path under the prefix ``uri`` -> sha256 of the object."""
    from steps import storage
    bucket, key = storage.parse_uri(uri)
    client = storage.client_for(uri)
    return {full[len(key) + 1:]: hashlib.sha256(client.get_object(
                Bucket=bucket, Key=full)["Body"].read()).hexdigest()
            for full in storage.list_keys(uri)}


@pytest.mark.s3
def test_an_http_tar_is_saved_by_key_as_it_is_extracted(tmp_path, http_server, msd_tar,
                                                        s3_env):
    """With --raw-uri every case file goes to S3 at its path in the artifact, and leaves
    --raw once the task is validated; --raw keeps dataset.json for the executor, and the
    manifest lists the whole: each file either there or under the prefix, never both, each
    with its sha256. The summary line says the bytes saved."""
    raw, uri = tmp_path / "raw", _raw_uri(s3_env, tmp_path)
    proc = run_cli("--source", f"{http_server.url}/data/msd.tar", "--raw", str(raw),
                   "--raw-uri", uri, "--md5", md5_of(msd_tar), env=s3_env.env())
    assert proc.returncode == 0, proc.stderr
    manifest = {e["path"]: e for e in json.loads((raw / "MANIFEST.json").read_text())["files"]}
    local = {p.relative_to(raw).as_posix() for p in raw.rglob("*") if p.is_file()}
    assert local == {"MANIFEST.json", f"{TASK}/dataset.json"}
    saved = _objects(uri)
    assert sorted(saved) == sorted(set(manifest) - local) and len(saved) == 5
    assert all(saved[rel] == manifest[rel]["sha256"] for rel in saved)
    with tarfile.open(msd_tar) as tar:
        assert tar.extractfile(f"{TASK}/imagesTr/BRATS_001.nii.gz").read() == \
            s3_env.client().get_object(Bucket=s3_env.bucket, Key=f"{uri.split('/', 3)[3]}/"
                                       f"{TASK}/imagesTr/BRATS_001.nii.gz")["Body"].read()
    said = bykey.saved_bytes(proc.stderr.splitlines()[-1])
    assert said == {"raw": sum(manifest[rel]["size"] for rel in saved)}
    # and the size it gives is the whole artifact's: the manifest's files and the manifest
    whole = sum(e["size"] for e in manifest.values()) + (raw / "MANIFEST.json").stat().st_size
    left = sum(p.stat().st_size for p in raw.rglob("*") if p.is_file())
    assert f"{whole / 2**20:.1f}" != f"{left / 2**20:.1f}"
    assert f" -> {raw} ({whole / 2**20:.1f} MiB, " in proc.stderr.splitlines()[-1]


@pytest.mark.s3
def test_a_tar_saved_by_key_with_another_md5_leaves_nothing_in_s3(tmp_path, http_server,
                                                                  s3_env):
    raw, uri = tmp_path / "raw", _raw_uri(s3_env, tmp_path)
    with pytest.raises(StepError, match="md5 mismatch"):
        download.main(["--source", f"{http_server.url}/data/msd.tar", "--raw", str(raw),
                       "--raw-uri", uri, "--md5", "0" * 32, "--no-progress"])
    assert_nothing_published(raw)
    assert _objects(uri) == {}


@pytest.mark.s3
def test_a_body_sent_again_is_saved_again_once(tmp_path, http_server, msd_tar, s3_env):
    """A server that answers the resume with the whole file: the first half's objects are
    deleted and each file is saved and listed once, from the second body."""
    size = msd_tar.stat().st_size
    http_server.cut_after, http_server.ignore_range = size // 2, True
    raw, uri = tmp_path / "raw", _raw_uri(s3_env, tmp_path)
    download.main(["--source", f"{http_server.url}/data/msd.tar", "--raw", str(raw),
                   "--raw-uri", uri, "--md5", md5_of(msd_tar), "--no-progress"])
    paths = [e["path"] for e in json.loads((raw / "MANIFEST.json").read_text())["files"]]
    assert len(paths) == len(set(paths)) == 6
    assert sorted(_objects(uri)) == sorted(set(paths) - {f"{TASK}/dataset.json"})
    assert http_server.log == [(None, size // 2), (None, size)]


@pytest.mark.s3
def test_a_tar_of_another_layout_is_left_to_the_executor(tmp_path, s3_env):
    """Files under Task01_BrainTumour/ are saved as they come; when the task turns out to be
    another folder of the tar, they are deleted from S3 and --raw holds the whole task."""
    task = synthetic.write_msd_task(tmp_path / "src", cases=1, shape=SHAPE, seed=2)
    archive = tmp_path / "other.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(task / "imagesTr", arcname=f"{TASK}/imagesTr")
        tar.add(task, arcname="Task01_Copy")
    raw, uri = tmp_path / "raw", _raw_uri(s3_env, tmp_path)
    download.main(["--source", f"file://{archive}", "--raw", str(raw), "--raw-uri", uri,
                   "--no-progress"])
    assert_raw_ok(raw, train=1, test=0)
    assert _objects(uri) == {}


def test_a_synthetic_source_with_raw_uri_never_calls_s3(tmp_path):
    """Only an extracted tar is saved by key: a generated task is left whole to the
    executor, and the step makes no S3 call (here none could succeed)."""
    raw = tmp_path / "raw"
    proc = run_cli("--source", "synthetic://?cases=1&shape=32x32x16&seed=3&test=0",
                   "--raw", str(raw), "--raw-uri", "s3://bucket/wf/pod/raw",
                   env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "k",
                        "AWS_SECRET_ACCESS_KEY": "s", "UNET_S3_MAX_ATTEMPTS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert_raw_ok(raw, train=1, test=0)


def test_a_file_member_named_twice_is_refused(tmp_path):
    archive = make_tar(tmp_path / "twice.tar", [
        member(f"{TASK}/imagesTr/a.nii.gz", data=b"first"),
        member(f"./{TASK}/imagesTr/a.nii.gz", data=b"second")])
    with pytest.raises(StepError, match=f"member './{TASK}/imagesTr/a.nii.gz' appears twice"):
        download.extract_tar(archive, tmp_path / "out", progress=False)


# ----------------------------------------------------------------------------- md5

def test_md5_mismatch_publishes_nothing_and_drops_the_download(tmp_path, http_server):
    """The published name selects MONAI's md5, which a synthetic tar cannot match."""
    raw = tmp_path / "raw"
    cache = tmp_path / "cache"
    with pytest.raises(StepError) as info:
        download.main(["--source", f"{http_server.url}/data/Task01_BrainTumour.tar",
                       "--raw", str(raw), "--cache-dir", str(cache), "--no-progress"])
    assert download.PUBLISHED_MD5["Task01_BrainTumour.tar"] in str(info.value)
    assert_nothing_published(raw)
    assert list(cache.iterdir()) == []


def test_md5_mismatch_cli_one_line(tmp_path, msd_tar):
    wrong = "0" * 32
    proc = run_cli("--source", f"file://{msd_tar}", "--raw", str(tmp_path / "raw"),
                   "--md5", wrong)
    line = assert_one_line_error(proc, "md5 mismatch", wrong, md5_of(msd_tar))
    assert "Task01_BrainTumour.tar" in line
    assert_nothing_published(tmp_path / "raw")
    assert msd_tar.exists()  # a local source file is never deleted


def test_md5_auto_and_empty(msd_tar, tmp_path):
    published = download.parse_source("s3://msd-for-monai/Task01_BrainTumour.tar")
    other = download.parse_source("https://example.org/data/other.tar")
    synthetic_source = download.parse_source("synthetic://?cases=1")
    assert download.resolve_md5("auto", published) == "240a19d752f0d9e9101544901065d872"
    assert download.resolve_md5("", published) is None
    assert download.resolve_md5("auto", other) is None
    assert download.resolve_md5("AB" * 16, other) == "ab" * 16
    assert download.resolve_md5("auto", synthetic_source) is None
    with pytest.raises(StepError, match="--md5"):
        download.resolve_md5("ab" * 16, synthetic_source)
    with pytest.raises(StepError, match="32 hexadecimal"):
        download.resolve_md5("xyz", other)


# ----------------------------------------------------------------------------- extraction

UNSAFE = {
    "dotdot": ([member("Task01_BrainTumour/../../evil.txt")], "'..'"),
    "absolute": ([member("/tmp/evil.txt")], "absolute path"),
    "symlink": ([member("Task01_BrainTumour/link", tarfile.SYMTYPE, linkname="/etc/passwd")],
                "symbolic link"),
    "hardlink": ([member("Task01_BrainTumour/a.txt"),
                  member("Task01_BrainTumour/b.txt", tarfile.LNKTYPE,
                         linkname="Task01_BrainTumour/a.txt")], "hard link"),
    "chardev": ([member("Task01_BrainTumour/null", tarfile.CHRTYPE)], "device"),
    "fifo": ([member("Task01_BrainTumour/pipe", tarfile.FIFOTYPE)], "device or fifo"),
}


@pytest.mark.parametrize("case", sorted(UNSAFE))
def test_unsafe_members_are_refused(tmp_path, case):
    members, reason = UNSAFE[case]
    archive = make_tar(tmp_path / "bad.tar", members)
    with pytest.raises(StepError) as info:
        download.extract_tar(archive, tmp_path / "out", progress=False)
    message = str(info.value)
    assert reason in message and members[-1][0].name in message
    assert not (tmp_path / "evil.txt").exists() and not Path("/tmp/evil.txt").exists()


def test_unsafe_member_cli_one_line(tmp_path):
    archive = make_tar(tmp_path / "bad.tar", UNSAFE["symlink"][0])
    proc = run_cli("--source", f"file://{archive}", "--raw", str(tmp_path / "raw"))
    assert_one_line_error(proc, "Task01_BrainTumour/link", "symbolic link")
    assert_nothing_published(tmp_path / "raw")


def test_dot_slash_members_and_macos_files(tmp_path):
    archive = make_tar(tmp_path / "ok.tar", [
        member("./Task01_BrainTumour/keep.txt", data=b"keep"),
        member("./Task01_BrainTumour/._keep.txt", data=b"junk"),
        member("__MACOSX/Task01_BrainTumour/._x", data=b"junk")])
    assert download.extract_tar(archive, tmp_path / "out", progress=False) == 1
    assert [p.relative_to(tmp_path / "out").as_posix()
            for p in (tmp_path / "out").rglob("*") if p.is_file()] == [f"{TASK}/keep.txt"]


def test_corrupt_tar_cli_one_line(tmp_path, msd_tar):
    broken = tmp_path / "broken.tar"
    broken.write_bytes(msd_tar.read_bytes()[:20000])
    proc = run_cli("--source", f"file://{broken}", "--raw", str(tmp_path / "raw"))
    assert_one_line_error(proc, "broken.tar", "not a readable tar")
    assert_nothing_published(tmp_path / "raw")


# ----------------------------------------------------------------------------- validation

def test_missing_listed_file_cli_one_line(tmp_path):
    task = synthetic.write_msd_task(tmp_path / "src", cases=3, shape=SHAPE, seed=1)
    (task / "labelsTr" / "BRATS_002.nii.gz").unlink()
    (task / "labelsTr" / "BRATS_003.nii.gz").unlink()
    proc = run_cli("--source", f"file://{task}", "--raw", str(tmp_path / "raw"))
    line = assert_one_line_error(proc, f"{TASK}/labelsTr/BRATS_002.nii.gz", "missing")
    assert "BRATS_003" not in line
    assert_nothing_published(tmp_path / "raw")


def test_bad_dataset_json_cli_one_line(tmp_path):
    task = synthetic.write_msd_task(tmp_path / "src", cases=1, shape=SHAPE, seed=1)
    (task / "dataset.json").write_text('{"name": "BRATS", "training": [')
    proc = run_cli("--source", f"file://{task}", "--raw", str(tmp_path / "raw"))
    assert_one_line_error(proc, "dataset.json", "not valid JSON")
    assert_nothing_published(tmp_path / "raw")


@pytest.mark.parametrize("edit,needle", [
    (lambda m: m.pop("modality"), "modality: Field required"),
    (lambda m: m.update(labels={}), "labels: needs 2 to 256 entries, has 0"),
    (lambda m: m.update(numTraining=5), "numTraining is 5"),
    (lambda m: m["training"][0].update(image="../../etc/passwd"), "not a path inside"),
])
def test_dataset_json_contents_are_checked(tmp_path, edit, needle):
    task = synthetic.write_msd_task(tmp_path, cases=1, shape=SHAPE, seed=1)
    meta = json.loads((task / "dataset.json").read_text())
    edit(meta)
    (task / "dataset.json").write_text(json.dumps(meta))
    with pytest.raises(StepError, match=re.escape(needle)):
        download.validate_task(task)


# ----------------------------------------------------------------------------- CLI contract

@pytest.mark.parametrize("source,needle", [
    ("ftp://example.org/x.tar", "unsupported scheme 'ftp'"),
    ("/data/Task01_BrainTumour.tar", "a plain path is not accepted"),
    ("s3://bucket-only", "s3://bucket/key"),
    ("synthetic://?cases=two", "cases='two' is not an integer"),
    ("synthetic://?shape=10x10", "shape='10x10' is not HxWxD"),
    ("synthetic://?colour=red", "unknown parameter 'colour'"),
    ("synthetic://?shape=4x4x4", "smaller than the minimum"),
])
def test_bad_source_uri(source, needle, tmp_path):
    with pytest.raises(StepError, match=re.escape(needle)):
        download.main(["--source", source, "--raw", str(tmp_path / "raw")])
    assert_nothing_published(tmp_path / "raw")


def test_bad_source_cli_one_line(tmp_path):
    proc = run_cli("--source", "ftp://example.org/x.tar", "--raw", str(tmp_path / "raw"))
    assert_one_line_error(proc, "ftp://example.org/x.tar", "unsupported scheme")
    proc = run_cli("--source", "synthetic://?cases=0", "--raw", str(tmp_path / "raw"))
    assert_one_line_error(proc, "cases=0 must be at least 1")
    proc = run_cli("--source", "synthetic://?cases=1", "--raw", str(tmp_path / "raw"),
                   "--md5", "nothex")
    assert_one_line_error(proc, "--md5 'nothex'")
    assert_nothing_published(tmp_path / "raw")


def test_missing_file_source_cli_one_line(tmp_path):
    proc = run_cli("--source", f"file://{tmp_path}/nope.tar", "--raw", str(tmp_path / "raw"))
    assert_one_line_error(proc, "nope.tar", "does not exist")


def test_http_not_found_cli_one_line(tmp_path, http_server):
    proc = run_cli("--source", f"{http_server.url}/data/absent.tar?X-Amz-Signature=s3cr3t",
                   "--raw", str(tmp_path / "raw"))
    line = assert_one_line_error(proc, "HTTP 404", "absent.tar")
    assert "s3cr3t" not in proc.stderr
    assert line.count("X-Amz-Signature=***") == 1
    assert len(http_server.log) == 1  # a permanent error is not retried


def test_output_not_empty_cli_one_line(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "old.txt").write_text("x")
    proc = run_cli("--source", "synthetic://?cases=1&shape=32x32x16", "--raw", str(raw))
    assert_one_line_error(proc, str(raw), "not empty")
    assert (raw / "old.txt").exists()


def test_success_cli_prints_one_summary_line(tmp_path):
    proc = run_cli("--source", "synthetic://?cases=2&shape=32x32x16&seed=1", "--raw",
                   str(tmp_path / "raw"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "2 training + 0 test cases" in lines[0]
    assert_raw_ok(tmp_path / "raw", train=2, test=0)


def test_help_explains_every_flag():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for flag in ("--source", "--raw", "--md5", "--cache-dir", "--no-progress", "synthetic://",
                 "file://", "s3://", "https://"):
        assert flag in proc.stdout
