"""The one module that touches S3. boto3 is the data plane.

Configuration follows boto3's environment conventions: ``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL`` (absent = AWS itself), ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_REGION``. Three knobs of our own, all optional:

- ``UNET_S3_MAX_ATTEMPTS`` (default 4): attempts per request, with botocore's standard
  exponential backoff between them; small so that an unreachable endpoint fails in seconds.
  A download stream that breaks is reopened from where it stopped as often.
- ``UNET_S3_PART_MB`` (default 64) and ``UNET_S3_CONCURRENCY`` (default 4): multipart part
  size and the number of parallel transfers shared by all the files of a directory. Measured
  with ``python -m benchmarks handoff`` on 2 cores: 64 MiB × 4 moved a dataset artifact in
  0.78× the time of 16 MiB × 8 (a dataset case is ~34 MB, so each file goes in one request).

Every failure that the user can fix leaves as one :class:`StorageError` line that names the
endpoint and the bucket and never the secret. Artifact directories go up with
``MANIFEST.json`` last and come down verified against it (``steps.artifacts.require``).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator

import boto3
import botocore.exceptions as bexc
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore import UNSIGNED
from botocore.config import Config
from botocore.utils import determine_content_length
from s3transfer.subscribers import BaseSubscriber
from tqdm import tqdm

from steps import limits, schemas, uris
from steps.artifacts import MANIFEST, list_files, require
from steps.errors import StepError

MiB = 1 << 20
# The S3 literals every other module takes from here (the config's defaults, the emulator,
# the lint's secret scan).
DEFAULT_BUCKET = "unet-artifacts"   # artifacts, checkpoints/<workflow>/, models/<model>/
DEFAULT_REGION = "us-east-1"
ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")   # the first one set wins
KEY_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
CREDENTIAL_VARS = KEY_VARS + ("AWS_SESSION_TOKEN",)
CONNECTION_VARS = ENDPOINT_VARS + CREDENTIAL_VARS + ("AWS_REGION", "AWS_DEFAULT_REGION",
                                                     "AWS_PROFILE", "AWS_DEFAULT_PROFILE")
DEFAULT_PART_MB = 64
DEFAULT_CONCURRENCY = 4
# Public buckets that hold MSD on AWS; read unsigned from AWS whatever endpoint is configured.
PUBLIC_BUCKETS = {"msd-for-monai": "us-west-2", "msd-for-monai-eu": "eu-west-2"}
_STREAM_CHUNK = 1 * MiB
_AUTH_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403",
               "InvalidToken", "ExpiredToken", "AuthorizationHeaderMalformed", "Forbidden"}
_MISSING_KEY_CODES = {"NoSuchKey", "404", "NotFound"}
_UNREACHABLE = (bexc.EndpointConnectionError, bexc.ConnectTimeoutError,
                bexc.ReadTimeoutError, bexc.ConnectionClosedError, bexc.ProxyConnectionError)

_SESSION: boto3.session.Session | None = None
_SESSION_LOCK = threading.RLock()     # botocore sessions are not thread-safe
# Clients by everything they were made from: making one costs ~50 ms (botocore loads and
# parses the S3 service model), and a local run asks for one per transfer.
_CLIENTS: dict[tuple, object] = {}
_CLIENT_CACHE_SIZE = 16
# A forked child (a DataLoader or pool worker) must not share its parent's open connections.
os.register_at_fork(after_in_child=_CLIENTS.clear)

Progress = Callable[[int], None]


class StorageError(StepError):
    """An S3 fault the user can fix: one line naming the endpoint and bucket, no secret."""


# ---- configuration ------------------------------------------------------------------------
def _env_int(name: str, default: int) -> int:
    value = limits.env_int(name, minimum=1)
    return default if value is None else value


def max_attempts() -> int:
    return _env_int("UNET_S3_MAX_ATTEMPTS", 4)


def transfer_config(part_size: int | None = None, concurrency: int | None = None,
                    threshold: int | None = None) -> TransferConfig:
    """Multipart above ``threshold`` bytes (default: the part size), parts in parallel."""
    part = part_size or _env_int("UNET_S3_PART_MB", DEFAULT_PART_MB) * MiB
    threads = concurrency or _env_int("UNET_S3_CONCURRENCY", DEFAULT_CONCURRENCY)
    return TransferConfig(multipart_threshold=threshold or part, multipart_chunksize=part,
                          max_concurrency=threads, use_threads=True)


def configured_endpoint() -> str | None:
    """The endpoint from the environment, or None for AWS itself."""
    for name in ENDPOINT_VARS:
        value = os.environ.get(name, "").strip()
        if value:
            uris.refuse_credentials(value, name, "set AWS_ACCESS_KEY_ID and "
                                                 "AWS_SECRET_ACCESS_KEY instead")
            return value
    return None


def configured_region() -> str:
    return (os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            or DEFAULT_REGION)


def parse_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key/prefix`` → ``("bucket", "key/prefix")``; the key may be empty."""
    parsed = uris.parse(uri, "S3 URI", ("s3",))
    return parsed.bucket, parsed.key


def _prefix(key: str) -> str:
    """An artifact prefix as a key prefix: 'a/b' and 'a/b/' → 'a/b/'; '' stays ''."""
    key = key.strip("/")
    return key + "/" if key else ""


def session_client(**kwargs):
    """``boto3.client("s3", **kwargs)`` from this process's one session, whose clients share
    the parsed S3 service model (parsing it takes ~0.25 s; a client after that ~30 ms)."""
    global _SESSION
    with _SESSION_LOCK:
        if _SESSION is None:
            _SESSION = boto3.session.Session()
        return _SESSION.client("s3", **kwargs)


def client(anonymous: bool = False, endpoint_url: str | None = None,
           region: str | None = None, pool: int | None = None):
    """A boto3 S3 client with retries and backoff, path-style addressing on custom endpoints.

    ``anonymous`` signs nothing (public buckets). With no ``endpoint_url``, an anonymous
    client goes to AWS itself, ignoring ``AWS_ENDPOINT_URL``; a signed one uses the configured
    endpoint. Credentials come from the environment when both keys are set there, otherwise
    from boto3's usual chain (profiles, web identity on Kubernetes, instance metadata).
    """
    endpoint = endpoint_url or (None if anonymous else configured_endpoint())
    region = region or configured_region()
    options = dict(
        retries={"mode": "standard", "total_max_attempts": max_attempts()},
        connect_timeout=5, read_timeout=60, tcp_keepalive=True,
        max_pool_connections=pool or
        2 * _env_int("UNET_S3_CONCURRENCY", DEFAULT_CONCURRENCY) + 4,
        s3={"addressing_style": "path" if endpoint else "auto"},
    )
    if endpoint is None and "ignore_configured_endpoint_urls" in Config.OPTION_DEFAULTS:
        options["ignore_configured_endpoint_urls"] = True
    # Newer botocore adds CRC checksums by default; many S3-compatible servers reject them.
    for name in ("request_checksum_calculation", "response_checksum_validation"):
        if name in Config.OPTION_DEFAULTS:
            options[name] = "when_required"
    if anonymous:
        options["signature_version"] = UNSIGNED
    kwargs = dict(region_name=region, endpoint_url=endpoint, config=Config(**options))
    if not anonymous:
        check_credentials()
    key_id = os.environ.get("AWS_ACCESS_KEY_ID")
    secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
    token = os.environ.get("AWS_SESSION_TOKEN")
    if not anonymous and not (key_id and secret):
        # A fresh session resolves the credential chain now, not from an earlier cache.
        return harden(boto3.session.Session().client("s3", **kwargs))
    cache_key = (anonymous, endpoint, region, repr(sorted(options.items())),
                 *(() if anonymous else (key_id, secret, token)))
    with _SESSION_LOCK:
        s3 = _CLIENTS.get(cache_key)
        if s3 is None:
            credentials = {} if anonymous else dict(
                aws_access_key_id=key_id, aws_secret_access_key=secret,
                aws_session_token=token)
            s3 = harden(session_client(**credentials, **kwargs))
            if len(_CLIENTS) >= _CLIENT_CACHE_SIZE:
                _CLIENTS.clear()
            _CLIENTS[cache_key] = s3
    return s3


def _drop_empty_expect(params, **kwargs) -> None:
    """No ``Expect: 100-continue`` on an empty body: SeaweedFS answers such a PUT and then
    leaves a stray response on the kept-alive connection, which stalls a later request on
    it for the whole read timeout."""
    body = params.get("body")
    if body is not None and determine_content_length(body) == 0:
        params["headers"].pop("Expect", None)


def harden(s3):
    """Apply this module's protocol fixes to any boto3 S3 client; return it."""
    # On the same event as botocore's add_expect_header, so that it runs after it.
    s3.meta.events.register("before-call.s3", _drop_empty_expect,
                            unique_id="unet-drop-empty-expect")
    return s3


def client_for(uri: str, anonymous: bool | None = None):
    """The client for ``uri``: unsigned AWS for the known public buckets, else configured."""
    bucket, _ = parse_uri(uri)
    public_region = PUBLIC_BUCKETS.get(bucket)
    if anonymous is None:
        anonymous = public_region is not None
    if anonymous and public_region:
        return client(anonymous=True, region=public_region)
    return client(anonymous=anonymous)


# ---- errors -------------------------------------------------------------------------------
def _root_cause(exc: BaseException) -> BaseException:
    """The botocore error under s3transfer/boto3 wrappers (they chain it as the context)."""
    seen, depth = exc, 0
    while seen is not None and depth < 10:
        depth += 1
        if isinstance(seen, (bexc.ClientError, bexc.BotoCoreError)) and \
                not isinstance(seen, S3UploadFailedError):
            return seen
        last = getattr(seen, "last_exception", None)
        seen = last or seen.__cause__ or seen.__context__
    return exc


SECRET_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
_BREAKS = re.compile(r"[\s\x00-\x1f\x7f]+")


def _scrub(text: str) -> str:
    """``text`` with every secret of the environment replaced by ``***``: whole, as Python
    escapes it, and each piece of it between whitespace or control characters (a library
    may quote a value split at a CRLF); then as one line."""
    for name in SECRET_VARS:
        secret = os.environ.get(name)
        if not secret:
            continue
        forms = {secret, secret.encode("unicode_escape").decode(), repr(secret)[1:-1]}
        forms.update(piece for piece in _BREAKS.split(secret) if len(piece) >= 8)
        for form in sorted(forms, key=len, reverse=True):
            text = text.replace(form, "***")
    return " ".join(text.split())


def check_credentials() -> None:
    """Credentials of the environment that a request header can carry: no control
    characters and no surrounding spaces (their values are never printed)."""
    for name in CREDENTIAL_VARS:
        value = os.environ.get(name)
        if value and (_BREAKS.search(value) or value != value.strip()):
            raise StorageError(f"{name} holds whitespace or control characters (a line break "
                               "pasted with it?); set it again (its value is not printed)")


def describe(exc: BaseException, s3, uri: str, action: str) -> str:
    """One line for a storage failure: what, where (endpoint, bucket), and what to check."""
    endpoint = s3.meta.endpoint_url
    bucket, _ = parse_uri(uri)
    where = f"endpoint {endpoint}, bucket '{bucket}'"
    cause = _root_cause(exc)
    if isinstance(cause, bexc.NoCredentialsError):
        return (f"{action} {uri}: no S3 credentials ({where}); set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY")
    if isinstance(cause, bexc.PartialCredentialsError):
        return f"{action} {uri}: incomplete S3 credentials ({where}): {cause}"
    if isinstance(cause, _UNREACHABLE):
        return (f"{action} {uri}: cannot reach S3 {where} after {max_attempts()} attempts "
                f"({type(cause).__name__}); check AWS_ENDPOINT_URL and that the server runs")
    if isinstance(cause, bexc.ClientError):
        error = cause.response.get("Error", {})
        code = str(error.get("Code", ""))
        if code == "NoSuchBucket":
            return f"{action} {uri}: bucket '{bucket}' does not exist at endpoint {endpoint}"
        if code in _AUTH_CODES:
            return (f"{action} {uri}: S3 {where} refused the credentials ({code}); check "
                    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
        if code in _MISSING_KEY_CODES:
            return f"{action} {uri}: no such object ({where})"
        return f"{action} {uri}: S3 error {code} ({where}): {error.get('Message', '')}"
    return f"{action} {uri}: {type(cause).__name__} ({where}): {cause}"


@contextlib.contextmanager
def _errors(s3, uri: str, action: str) -> Iterator[None]:
    try:
        yield
    except StepError:
        raise
    except (bexc.BotoCoreError, bexc.ClientError, S3UploadFailedError) as exc:
        raise StorageError(_scrub(describe(exc, s3, uri, action))) from None
    except Exception as exc:  # s3transfer wraps botocore errors in its own types
        cause = _root_cause(exc)
        if cause is exc:
            raise
        raise StorageError(_scrub(describe(exc, s3, uri, action))) from None


def _is_missing(exc: bexc.ClientError) -> bool:
    return str(exc.response.get("Error", {}).get("Code", "")) in _MISSING_KEY_CODES


# ---- progress -----------------------------------------------------------------------------
class _Counter:
    """Thread-safe byte counter feeding a tqdm bar on stderr and an optional callback."""

    def __init__(self, total: int, label: str, show: bool, on_bytes: Progress | None):
        self.lock = threading.Lock()
        self.done = 0
        self.on_bytes = on_bytes
        self.bar = tqdm(total=total, desc=label, unit="B", unit_scale=True,
                        unit_divisor=1024, file=sys.stderr, disable=not show, leave=False)

    def __call__(self, count: int) -> None:
        with self.lock:
            self.done += count
            self.bar.update(count)
        if self.on_bytes:
            self.on_bytes(count)

    def close(self) -> None:
        self.bar.close()


# ---- single objects -----------------------------------------------------------------------
def _head(s3, uri: str, action: str) -> dict | None:
    """HEAD the object: its metadata, or None when it is missing from an existing bucket."""
    bucket, key = parse_uri(uri)
    with _errors(s3, uri, action):
        try:
            return s3.head_object(Bucket=bucket, Key=key)
        except bexc.ClientError as exc:
            if not _is_missing(exc):
                raise
            # HEAD has no body, so a missing bucket also reads as 404: ask the bucket.
            try:
                s3.head_bucket(Bucket=bucket)
            except bexc.ClientError as bucket_exc:
                if not _is_missing(bucket_exc):
                    raise
                raise StorageError(f"{action} {uri}: bucket '{bucket}' does not exist at "
                                   f"endpoint {s3.meta.endpoint_url}") from None
            return None


def exists(uri: str, client=None) -> bool:
    """True when the object exists; a missing bucket or refused credentials raise."""
    return _head(client or client_for(uri), uri, "checking") is not None


def size(uri: str, client=None) -> int | None:
    """The object's size in bytes (its ContentLength), None when it is missing."""
    head = _head(client or client_for(uri), uri, "reading")
    return None if head is None else int(head.get("ContentLength", 0))


def list_objects(uri: str, client=None) -> dict[str, tuple[int, str]]:
    """Key → (size, ETag) of every object under the prefix ``uri`` (as a directory:
    's3://b/a' lists 'a/...'), in key order."""
    bucket, key = parse_uri(uri)
    prefix = _prefix(key)
    s3 = client or client_for(uri)
    objects: dict[str, tuple[int, str]] = {}
    with _errors(s3, uri, "listing"):
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            objects.update((item["Key"], (int(item["Size"]), item.get("ETag", "")))
                           for item in page.get("Contents", []))
    return objects


def list_keys(uri: str, client=None) -> list[str]:
    """Keys under the prefix ``uri`` (as a directory: 's3://b/a' lists 'a/...')."""
    return list(list_objects(uri, client))


def delete_prefix(uri: str, client=None) -> int:
    """Delete every object under the prefix ``uri``; return how many."""
    bucket, key = parse_uri(uri)
    if not key.strip("/"):
        raise StepError(f"refusing to delete a whole bucket ({uri}); name a prefix")
    s3 = client or client_for(uri)
    keys = list_keys(uri, s3)
    with _errors(s3, uri, "deleting"):
        for start in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[start:start + 1000]]
            s3.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
    return len(keys)


def put_bytes(data: bytes, uri: str, client=None) -> None:
    bucket, key = parse_uri(uri)
    s3 = client or client_for(uri)
    with _errors(s3, uri, "writing"):
        s3.put_object(Bucket=bucket, Key=key, Body=data)


def get_bytes(uri: str, client=None, limit: int | None = None) -> bytes:
    """The object's bytes; with ``limit``, an object larger than that is a StorageError
    (its announced size is checked before the body is read, and the read stops there)."""
    bucket, key = parse_uri(uri)
    s3 = client or client_for(uri)
    with _errors(s3, uri, "reading"):
        response = s3.get_object(Bucket=bucket, Key=key)
        if limit is None:
            return response["Body"].read()

        def refuse(size: int) -> None:
            if size > limit:
                response["Body"].close()
                raise StorageError(f"reading {uri}: the object is larger than the {limit} "
                                   "bytes allowed")
        return _bounded_body(response, limit, refuse)


def _bounded_body(response: dict, limit: int, refuse: Callable[[int], None]) -> bytes:
    """An object's body, never read past ``limit`` + 1 bytes: ``refuse(size)`` (which raises
    when the size is too large) sees its announced size before the read and what was read."""
    refuse(int(response.get("ContentLength", 0)))
    data = response["Body"].read(limit + 1)
    refuse(len(data))
    return data


def upload_file(path: Path | str, uri: str, client=None, *, progress: bool = False,
                config: TransferConfig | None = None) -> int:
    """Upload one file (multipart above the threshold); return its size."""
    path = Path(path)
    if not path.is_file():
        raise StepError(f"cannot upload {path}: not a file")
    bucket, key = parse_uri(uri)
    s3 = client or client_for(uri)
    size = path.stat().st_size
    counter = _Counter(size, path.name, progress, None)
    try:
        with _errors(s3, uri, "uploading to"):
            s3.upload_file(str(path), bucket, key, Config=config or transfer_config(),
                           Callback=counter)
    finally:
        counter.close()
    return size


# ---- whole directories --------------------------------------------------------------------
def _run_transfers(s3, uri: str, action: str, jobs: list[tuple[str, str, int]],
                   upload: bool, config: TransferConfig, counter: _Counter,
                   on_done: Callable[[str], None] | None,
                   listed: dict[str, tuple[int, str]] | None = None) -> None:
    """Run (local path, key, size) transfers in parallel over one shared thread pool.

    A download whose key is in ``listed`` (key → (size, ETag) from :func:`list_objects`)
    skips s3transfer's HEAD request; for a directory of small files that halves the
    requests. The ETag still guards the read (s3transfer sends it as If-Match).
    """

    bucket, _ = parse_uri(uri)
    listed = listed or {}

    class _Progress(BaseSubscriber):
        def __init__(self, key: str | None = None):
            self.key = key

        def on_queued(self, future, **kwargs):
            if self.key in listed:
                size, etag = listed[self.key]
                future.meta.provide_transfer_size(size)
                future.meta.provide_object_etag(etag)

        def on_progress(self, future, bytes_transferred, **kwargs):
            counter(bytes_transferred)

    with _errors(s3, uri, action):
        with create_transfer_manager(s3, config) as manager:
            futures = []
            for local, key, _size in jobs:
                if upload:
                    future = manager.upload(local, bucket, key, subscribers=[_Progress()])
                else:
                    future = manager.download(bucket, key, local,
                                              subscribers=[_Progress(key)])
                futures.append((key, future))
            try:
                for key, future in futures:
                    future.result()
                    if on_done:
                        on_done(key)
            except BaseException:
                for _, future in futures:
                    future.cancel()
                raise


def upload_dir(local_dir: Path | str, uri: str, client=None, *,
               config: TransferConfig | None = None, progress: bool = True,
               on_uploaded: Callable[[str], None] | None = None) -> int:
    """Upload every file under ``local_dir`` to the prefix ``uri``; return the bytes sent.

    Files go in parallel (multipart above the threshold). ``MANIFEST.json``, when present,
    goes last, after every other object is complete, and any manifest already at the prefix
    is deleted first: a reader that sees a manifest sees a complete artifact.
    ``on_uploaded(key)`` is called as each object completes.
    """
    root = Path(local_dir)
    if not root.is_dir():
        raise StepError(f"cannot upload {root}: not a directory")
    bucket, key = parse_uri(uri)
    prefix = _prefix(key)
    s3 = client or client_for(uri)
    config = config or transfer_config()
    jobs = [(str(root / rel), prefix + rel.as_posix(), (root / rel).stat().st_size)
            for rel in list_files(root)]
    manifest = root / MANIFEST
    total = sum(size for *_, size in jobs) + (manifest.stat().st_size if manifest.is_file()
                                              else 0)
    with _errors(s3, uri, "uploading to"):
        s3.delete_object(Bucket=bucket, Key=prefix + MANIFEST)
    counter = _Counter(total, f"upload {uri}", progress, None)
    try:
        _run_transfers(s3, uri, "uploading to", jobs, True, config, counter, on_uploaded)
        if manifest.is_file():
            _run_transfers(s3, uri, "uploading to",
                           [(str(manifest), prefix + MANIFEST, manifest.stat().st_size)],
                           True, config, counter, on_uploaded)
    finally:
        counter.close()
    return total


def _safe_relative(rel: str, uri: str) -> PurePosixPath:
    path = PurePosixPath(rel)
    if path.is_absolute() or ".." in path.parts or not path.parts or rel != path.as_posix():
        raise StorageError(f"{uri}/{MANIFEST} lists an unsafe path '{rel}'")
    return path


def manifest_bytes(uri: str, client=None, action: str = "reading") -> bytes | None:
    """The bytes of the artifact's ``MANIFEST.json`` at prefix ``uri``, held to
    ``max_json_bytes`` before its body is read; None when there is none (one GET)."""
    bucket, key = parse_uri(uri)
    s3 = client or client_for(uri)
    where = f"{uri}/{MANIFEST}"
    with _errors(s3, uri, action):
        try:
            return _bounded_body(s3.get_object(Bucket=bucket, Key=_prefix(key) + MANIFEST),
                                 limits.get("max_json_bytes"),
                                 lambda size: limits.check("max_json_bytes", size, where))
        except bexc.ClientError as exc:
            if not _is_missing(exc):
                raise
            return None


def download_dir(uri: str, local_dir: Path | str, client=None, *, artifact: str | None = None,
                 require_manifest: bool = True, check_hashes: bool = True,
                 config: TransferConfig | None = None, progress: bool = True) -> int:
    """Download the artifact at prefix ``uri`` into ``local_dir``; return the bytes fetched.

    With a ``MANIFEST.json`` at the prefix, exactly the listed files are fetched, the
    manifest is written last, and the directory is verified with ``artifacts.require``
    (sizes and sha256); on a mismatch the local manifest is removed again so that the
    directory never looks complete. A prefix without a manifest is refused unless
    ``require_manifest=False``, in which case every object under it is fetched.
    """
    bucket, key = parse_uri(uri)
    prefix = _prefix(key)
    root = Path(local_dir)
    s3 = client or client_for(uri)
    raw = manifest_bytes(uri, s3, "downloading")
    listed = list_objects(uri, s3)
    if raw is None:
        if not listed:  # as Argo's S3 driver: an empty prefix is not a directory
            raise StorageError(f"nothing at {uri} (endpoint {s3.meta.endpoint_url})")
        if require_manifest:
            raise StorageError(f"{uri} has no {MANIFEST} (endpoint {s3.meta.endpoint_url}): "
                               "the producing step did not finish")
        jobs = [(str(root / _safe_relative(k[len(prefix):], uri)), k, size)
                for k, (size, _) in listed.items()]
    else:
        where = f"{uri}/{MANIFEST}"
        manifest = schemas.parse_json(raw, where)
        entries = [(e.path, e.size) for e in schemas.validate(schemas.Manifest, manifest,
                                                                where).files]
        jobs = [(str(root / _safe_relative(rel, uri)), prefix + rel, size)
                for rel, size in entries]
    for local, *_ in jobs:
        Path(local).parent.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    total = sum(size for *_, size in jobs)
    counter = _Counter(total, f"download {uri}", progress, None)
    try:
        _run_transfers(s3, uri, "downloading", jobs, False, config or transfer_config(),
                       counter, None, listed)
    finally:
        counter.close()
    if raw is None:
        return counter.done
    (root / MANIFEST).write_bytes(raw)
    try:
        require(root, artifact or manifest.get("artifact", ""), check_hashes=check_hashes)
    except StepError as exc:
        (root / MANIFEST).unlink(missing_ok=True)
        raise StorageError(f"downloaded from {uri}: {exc}") from None
    return counter.done + len(raw)


# ---- one large object, resumable ----------------------------------------------------------
def _read_state(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def download_file(uri: str, dest: Path | str, *, anonymous: bool | None = None,
                  resume: bool = True, progress: bool = True, client=None,
                  on_bytes: Progress | None = None, chunk_size: int = _STREAM_CHUNK,
                  limit: str | None = None, size: int | None = None) -> int:
    """Stream one object to ``dest``; return the bytes fetched by this call.

    Data goes to ``dest.part`` (its ETag and size noted in ``dest.part.json``) and is renamed
    to ``dest`` at the end. A later call resumes a ``.part`` with a Range request when the
    object's ETag and size are unchanged, and starts over otherwise. A dropped stream is
    resumed from where it stopped, up to ``UNET_S3_MAX_ATTEMPTS`` times. ``anonymous=None``
    reads the known public MSD buckets unsigned from AWS and everything else signed.
    ``limit`` names a :mod:`steps.limits` size limit the object must keep to; ``size``, when
    given, is the only size the object may have (checked before anything is fetched).
    """
    bucket, key = parse_uri(uri)
    dest = Path(dest)
    part = dest.with_name(dest.name + ".part")
    state_path = dest.with_name(dest.name + ".part.json")
    s3 = client or client_for(uri, anonymous)
    head = _head(s3, uri, "downloading")
    if head is None:
        raise StorageError(f"downloading {uri}: no such object "
                           f"(endpoint {s3.meta.endpoint_url}, bucket '{bucket}')")
    expected, size, etag = size, int(head["ContentLength"]), head.get("ETag", "")
    if expected is not None and size != expected:
        raise StorageError(f"downloading {uri}: the object has {size} bytes, {expected} "
                           "expected")
    if limit:
        limits.check(limit, size, f"downloading {uri}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    state = _read_state(state_path) if resume else {}
    have = part.stat().st_size if part.is_file() else 0
    if state.get("etag") != etag or state.get("size") != size or have > size:
        have = 0
    state_path.write_text(json.dumps({"uri": uri, "etag": etag, "size": size}))
    counter = _Counter(size, dest.name, progress, on_bytes)
    counter.bar.update(have)
    try:
        with open(part, "r+b" if have else "wb") as out:
            out.truncate(have)
            out.seek(have)
            _stream(s3, uri, etag, size, out, counter, chunk_size)
    finally:
        counter.close()
    if part.stat().st_size != size:
        raise StorageError(f"downloading {uri}: got {part.stat().st_size} of {size} bytes")
    os.replace(part, dest)
    state_path.unlink(missing_ok=True)
    return counter.done


def _stream(s3, uri: str, etag: str, size: int, out, counter: _Counter,
            chunk_size: int) -> None:
    """Append the object's bytes from ``out.tell()`` on, reopening a dropped stream."""
    bucket, key = parse_uri(uri)
    failures = 0
    while out.tell() < size:
        start = out.tell()
        try:
            with _errors(s3, uri, "downloading"):
                extra = {"IfMatch": etag} if etag else {}
                body = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-",
                                     **extra)["Body"]
            for chunk in body.iter_chunks(chunk_size):
                if out.tell() + len(chunk) > size:
                    raise StorageError(f"downloading {uri}: the endpoint sent more than the "
                                       f"{size} bytes the object has")
                out.write(chunk)
                counter(len(chunk))
        except (bexc.ResponseStreamingError, bexc.ReadTimeoutError, ConnectionError,
                bexc.IncompleteReadError) as exc:
            failures += 1
            if failures >= max_attempts():
                raise StorageError(_scrub(f"downloading {uri}: the stream broke "
                                          f"{failures} times (endpoint "
                                          f"{s3.meta.endpoint_url}): {exc}")) from None
        else:
            if out.tell() == start:
                break
