"""Download step: fetch MSD Task01_BrainTumour and publish it as the ``raw`` artifact.

``python -m steps.download --source URI --raw DIR [--md5 HEX|auto|""] [--cache-dir DIR]``

Output (``raw``): ``Task01_BrainTumour/{dataset.json, imagesTr/, labelsTr/, imagesTs/}`` plus
``MANIFEST.json``, written last by :func:`steps.artifacts.publish`.

Sources:

- ``s3://msd-for-monai/Task01_BrainTumour.tar`` and ``s3://msd-for-monai-eu/…``: the public
  AWS buckets, read anonymously from AWS itself whatever ``AWS_ENDPOINT_URL`` says;
- ``s3://bucket/key``: any other object on the configured endpoint (``AWS_*`` variables);
- ``https://…`` / ``http://…``: streamed, resumed with a Range request after an interruption,
  transient errors retried with exponential backoff; without ``--cache-dir`` the tar is
  extracted as it arrives, so the step's disk holds the data once, not twice;
- ``file:///path/x.tar`` (or .tar.gz), or ``file:///path/dir`` holding an extracted task (the
  Task01_BrainTumour directory or its parent);
- ``synthetic://?cases=N&shape=HxWxD&seed=S&test=M``: BraTS-like cases from
  :mod:`steps.synthetic`.

Other downloads land in a cache inside the output directory (gone with it on success or
failure; an explicit ``--cache-dir`` is kept and trusted only after a good run). Every archive
is held to the size limits of :mod:`steps.limits` and checked against the md5 before anything
is published (a cached one before anything is extracted), and is extracted member by
member with every unsafe member refused (absolute paths, ``..``,
links, devices, sparse files) and macOS ``._*`` files dropped. A directory source
contributes only ``dataset.json`` and the regular files it lists.

With ``--raw-uri s3://BUCKET/PREFIX`` (Argo passes the key its executor saves ``raw`` at), a
tar's case files are also saved there by key as they are extracted (``steps.bykey.Saver``),
on a thread of their own, so the upload overlaps the download instead of following it in the
wait container (at 750 cases: 88 s, 0.13 of the run). They stay in ``--raw`` until the task is
validated and then leave it; the executor saves the rest (``dataset.json``, the manifest) at
the same key. A generated or directory source is left whole to the executor.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import http.client
import itertools
import json
import lzma
import os
import re
import shutil
import stat
import sys
import tarfile
import time
import zlib
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Iterator, Sequence
from urllib.error import HTTPError, URLError
from urllib.parse import urlsplit
from urllib.request import HTTPRedirectHandler, Request, build_opener

from tqdm import tqdm

from steps import __version__, bykey, limits, schemas, storage, uris
from steps.artifacts import check_disjoint, clean_relative, publish, sha256_file
from steps.errors import OneLineArgumentParser, StepError, run_main
from steps.params import IO, add_artifacts
from steps.synthetic import TASK, write_msd_task
from steps.uris import redact

STEP = "download"
ARTIFACT = IO[STEP].writes
DATASET_JSON = "dataset.json"
# MONAI's DecathlonDataset md5 of the published tarball.
PUBLISHED_MD5 = {"Task01_BrainTumour.tar": "240a19d752f0d9e9101544901065d872"}

HTTP_RETRIES = 5             # failed requests in a row without the file growing
HTTP_BACKOFF_S = 1.0         # first wait; doubles per failure in a row, at most 60 s
HTTP_TIMEOUT_S = 60.0        # one request's connect and read timeout
TRANSIENT_HTTP = frozenset({408, 425, 429, 500, 502, 503, 504})
MAX_REDIRECTS = 5
MAX_VALIDATOR_BYTES = 256    # an ETag or an HTTP date, as the first response gave it
# What a validator may be before it is sent back as If-Range: a strong ETag or an HTTP date.
_VALIDATOR = re.compile(r'"[\x21\x23-\x7e]{0,200}"|[A-Za-z]{3}, \d{2} [A-Za-z]{3} \d{4} '
                        r'\d{2}:\d{2}:\d{2} GMT')


class _Redirects(HTTPRedirectHandler):
    """urllib's redirects held to what the download speaks: http and https only, never from
    https down to http, never to a URL with credentials in it (http.client would echo them in
    its error), at most MAX_REDIRECTS; anything else is one line saying why."""

    max_redirections = MAX_REDIRECTS

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        old, new = urlsplit(req.full_url).scheme.lower(), urlsplit(newurl).scheme.lower()
        why = None
        if new not in ("http", "https"):
            why = f"to the scheme '{new or '(none)'}', which the download does not speak"
        elif old == "https" and new == "http":
            why = "from https down to http"
        elif uris.has_credentials(newurl):
            why = "to a URL with credentials in it"
        elif len(getattr(req, "redirect_dict", {})) >= MAX_REDIRECTS:
            why = f"more than {MAX_REDIRECTS} times"
        if why:
            raise StepError(f"download of {redact(req.full_url)}: HTTP {code} redirects "
                            f"{why} ({redact(newurl)})")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = build_opener(_Redirects)
_CHUNK = 1 << 20
_ARCHIVE_ERRORS = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, lzma.LZMAError)
_VERIFIED = ".verified"     # beside a cached download: its size and sha256 after a good run


@dataclass(frozen=True)
class Source:
    """A parsed ``--source``: ``kind`` is one of ``uris.SOURCE_KINDS`` (http covers https)."""
    kind: str
    uri: str
    path: Path | None = None
    synthetic: dict[str, Any] = field(default_factory=dict)
    file_name: str = ""       # base name of the object the URI points at ('' for synthetic)


# ----------------------------------------------------------------------------- parsing

def parse_source(uri: str) -> Source:
    """Parse ``--source`` with :func:`steps.uris.parse`; a bad URI is a StepError naming it."""
    parsed = uris.parse(uri, "--source", uris.SOURCE_KINDS)
    if parsed.kind == "s3" and not parsed.key.strip("/"):
        raise StepError(f"--source '{uri}': an s3 source needs s3://bucket/key")
    synthetic = _synthetic_params(parsed) if parsed.kind == "synthetic" else {}
    return Source(parsed.kind, parsed.text, parsed.path, synthetic, parsed.name)


def _synthetic_params(parsed: uris.Uri) -> dict[str, Any]:
    """The query's parameters (``steps.uris.synthetic_params``, the rule render applies too),
    held to this step's limits: the case count, and a case's size against the volume limit
    and the memory this step has."""
    uri = parsed.text
    out = uris.synthetic_params(uri, parsed.query, "--source")
    limits.check("max_cases", out["cases"] + out["test"], f"--source '{uri}': cases + test")
    shape = "x".join(map(str, out["shape"]))
    voxels = out["shape"][0] * out["shape"][1] * out["shape"][2]
    limits.check("max_volume_bytes", voxels * 4 * 4, f"--source '{uri}': shape={shape} "
                 "(4 float32 channels)")
    # Generating a case holds the image, the tissue map and a few float32 temporaries.
    limits.check_memory(voxels * 4 * 12, f"--source '{uri}': shape={shape}")
    return out


def resolve_md5(md5: str, source: Source) -> str | None:
    """The digest to check: ``auto`` → the published one for a known file name, else none."""
    value = md5.strip().lower()
    archive = source.kind in ("s3", "http") or (source.kind == "file"
                                                and not (source.path and source.path.is_dir()))
    if value == "auto":
        return PUBLISHED_MD5.get(source.file_name) if archive else None
    if value == "":
        return None
    if not re.fullmatch(r"[0-9a-f]{32}", value):
        raise StepError(f"--md5 '{md5}' is not 32 hexadecimal digits (or 'auto', or '' for no "
                        "check)")
    if not archive:
        raise StepError(f"--md5 applies to an archive; --source '{redact(source.uri)}' is a "
                        f"{'directory' if source.kind == 'file' else source.kind} source")
    return value


# ----------------------------------------------------------------------------- fetching

def cache_name(source: Source) -> str:
    """Cache file name: a short hash of the URI (without query) plus the object's name."""
    digest = hashlib.sha256(uris.stable(source.uri).encode())
    return f"{digest.hexdigest()[:12]}-{source.file_name or 'download'}"


def trust_cached(dest: Path) -> None:
    """Mark a cached download good (its size and sha256), after a run that used it worked."""
    _write_own(dest.with_name(dest.name + _VERIFIED),
               json.dumps({"size": dest.stat().st_size, "sha256": sha256_file(dest)}))


def _write_own(path: Path, text: str) -> None:
    """Write a small file of the cache folder anew: whatever was there (a planted link
    included) is removed, not followed, and the file is created, never opened through a
    link."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        handle.write(text)


def forget_cached(dest: Path) -> None:
    """Drop a cached download and its mark: a run that used it failed."""
    for path in (dest, dest.with_name(dest.name + _VERIFIED)):
        path.unlink(missing_ok=True)


def _trusted(dest: Path) -> bool:
    """A cached file is reused only with a mark whose size and sha256 it still has."""
    try:
        mark = schemas.load(dest.with_name(dest.name + _VERIFIED), schemas.CacheMark,
                            f"{dest}{_VERIFIED}")
        return dest.stat().st_size == mark.size and sha256_file(dest) == mark.sha256
    except (OSError, StepError):
        return False


def fetch(source: Source, cache_dir: Path, progress: bool = True) -> Path:
    """Make the archive local; return its path (the source itself for a file).

    A cached file is reused only when an earlier run that used it succeeded and it still
    has that run's sha256; an unfinished ``.part`` is resumed.
    """
    if source.kind == "file":
        assert source.path is not None
        return source.path
    cache_dir.mkdir(parents=True, exist_ok=True)
    dest = cache_dir / cache_name(source)
    if dest.is_file() and _trusted(dest):
        print(f"download: using cached {dest}", file=sys.stderr)
        return dest
    forget_cached(dest)
    if source.kind == "http":
        http_download(source.uri, dest, progress=progress)
    else:
        s3_download(source.uri, dest, progress=progress)
    return dest


def s3_download(uri: str, dest: Path, progress: bool = True) -> Path:
    """Fetch an S3 object through :mod:`steps.storage`, resuming ``dest.part``.

    storage reads the public MSD buckets unsigned from AWS in their own region, and every
    other bucket signed from the configured endpoint.
    """
    storage.download_file(uri, dest, resume=True, progress=progress, limit="max_download_bytes")
    return dest


class _Transient(Exception):
    """A network fault worth retrying (whether it made progress, the body's offset says)."""


@dataclass
class HttpBody:
    """The body of ``url`` as one stream that outlives its connections.

    :meth:`chunks` yields ``(offset, bytes)`` in order from ``offset``. After a dropped
    connection, a stall or a transient HTTP status it asks again from where the body got to,
    with Range and an If-Range of ``validator`` (the strong ETag or Last-Modified of the
    response that sent byte 0), so a changed file comes whole: from offset 0 again. Every failed
    request is followed by a wait that doubles from ``backoff_s`` (at most 60 s) and restarts
    only when the body has passed its furthest point: a server that always drops the
    connection at the same place, or ignores Range and starts over, is given up on after
    ``retries`` more requests. Nothing goes on after ``budget_s`` (``http_budget_seconds``)
    from the first request: no retry starts, and a body still streaming is cut. A body that
    brings fewer than ``http_window_bytes`` in ``http_stall_seconds`` is a stalled attempt.
    Permanent HTTP errors (404, 403…) fail at once with one line.
    """
    url: str
    offset: int = 0
    validator: str | None = None
    retries: int = HTTP_RETRIES
    backoff_s: float = HTTP_BACKOFF_S
    timeout_s: float = HTTP_TIMEOUT_S
    budget_s: float | None = None
    bar: tqdm | None = None

    def chunks(self) -> Iterator[tuple[int, bytes]]:
        budget_s = limits.get("http_budget_seconds") if self.budget_s is None else self.budget_s
        started = time.monotonic()
        failures, attempts, furthest = 0, 0, self.offset
        while True:
            attempts += 1
            try:
                yield from self._attempt((started + budget_s, budget_s))
                return
            except _Transient as exc:
                failures = 1 if self.offset > furthest else failures + 1
                furthest = max(furthest, self.offset)
                wait = min(self.backoff_s * 2 ** (failures - 1), 60.0)
                elapsed = time.monotonic() - started
                if failures > self.retries:
                    raise StepError(f"download of {redact(self.url)} failed after {attempts} "
                                    f"attempts ({failures} in a row without progress): "
                                    f"{exc}") from None
                if elapsed + wait > budget_s:
                    raise StepError(f"download of {redact(self.url)} gave up after {attempts} "
                                    f"attempts in {elapsed:.0f} s, its time budget of "
                                    f"{budget_s:g} s ({exc})") from None
                time.sleep(wait)

    def _attempt(self, budget: tuple[float, float]) -> Iterator[tuple[int, bytes]]:
        """One GET from ``offset``; raises _Transient when the body is incomplete."""
        headers = {"User-Agent": f"unet-argo/{__version__}"}
        if self.offset:
            headers["Range"] = f"bytes={self.offset}-"
            if self.validator:
                headers["If-Range"] = self.validator
        try:
            response = _OPENER.open(Request(self.url, headers=headers), timeout=self.timeout_s)
        except HTTPError as exc:
            self._http_error(exc)
            return
        except (URLError, http.client.HTTPException, ConnectionError, TimeoutError) as exc:
            raise _Transient(str(getattr(exc, "reason", exc))) from None
        with response:
            self.offset, total = _resume_point(response, self.offset, self.url)
            if total is not None:
                limits.check("max_download_bytes", total, f"download of {redact(self.url)}")
            if self.offset == 0:
                self.validator = _validator_of(response)
            if self.bar is not None:
                self.bar.total, self.bar.n = total, self.offset
                self.bar.refresh()
            for chunk in _body(response, self.offset, self.url, budget):
                yield self.offset, chunk
                self.offset += len(chunk)
                if self.bar is not None:
                    self.bar.update(len(chunk))
        if total is not None and self.offset < total:
            raise _Transient(f"connection closed after {self.offset} of {total} bytes")

    def _http_error(self, exc: HTTPError) -> None:
        """An HTTP error status: the body complete, a restart, a retry, or a StepError."""
        if exc.code == 416 and self.offset:
            if _range_total(exc.headers.get("Content-Range", "")) == self.offset:
                return  # what we hold is already the whole body
            self.offset = 0
            raise _Transient("server refused to resume; restarting from zero")
        if exc.code in TRANSIENT_HTTP:
            raise _Transient(f"HTTP {exc.code} {exc.reason}")
        raise StepError(f"download of {redact(self.url)} failed: HTTP {exc.code} {exc.reason}")


def http_download(url: str, dest: Path, *, retries: int = HTTP_RETRIES,
                  backoff_s: float = HTTP_BACKOFF_S, timeout_s: float = HTTP_TIMEOUT_S,
                  budget_s: float | None = None, progress: bool = True) -> Path:
    """Fetch ``url`` (:class:`HttpBody`) to ``dest`` through ``dest.part``, which an earlier
    run's ``.part`` continues (with the validator saved beside it)."""
    part = dest.with_name(dest.name + ".part")
    validator_file = part.with_name(part.name + ".validator")
    offset, validator = _own_file_size(part), _read_validator(validator_file)
    if offset and not validator and os.path.lexists(validator_file):
        offset = 0          # one we cannot trust proves nothing: start over
    with tqdm(desc=dest.name.split("-", 1)[-1], unit="B", unit_scale=True, unit_divisor=1024,
              disable=not progress, file=sys.stderr) as bar:
        body = HttpBody(url, offset, validator, retries, backoff_s, timeout_s, budget_s, bar)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW   # never into a planted link
            with os.fdopen(os.open(part, flags, 0o600), "wb") as out:
                out.seek(offset)
                for at, chunk in body.chunks():
                    if at == 0:     # the body from its start: what the file held goes
                        _save_validator(validator_file, body.validator)
                        out.seek(0)
                        out.truncate()
                    out.write(chunk)
        except OSError as exc:
            raise StepError(f"cannot write {part}: {exc.strerror or exc}") from None
    os.replace(part, dest)
    validator_file.unlink(missing_ok=True)
    return dest


class _SentAgain(Exception):
    """The server began the body again from byte 0 (it changed, or Range was ignored)."""

    def __init__(self, chunk: bytes):
        super().__init__("sent again from byte 0")
        self.chunk = chunk


class _BodyReader:
    """The chunks of an :class:`HttpBody` as the file object ``tarfile`` reads, with the md5
    of what it gave. A chunk at offset 0 after others raises :class:`_SentAgain`."""

    def __init__(self, chunks: Iterator[tuple[int, bytes]]):
        self._chunks = chunks
        self._chunk, self._at, self.size = b"", 0, 0
        self.md5 = hashlib.md5(usedforsecurity=False)

    def read(self, size: int = -1) -> bytes:
        while self._at == len(self._chunk):
            offset, chunk = next(self._chunks, (self.size, b""))
            if not chunk:
                return b""
            if offset != self.size:
                raise _SentAgain(chunk)
            self._chunk, self._at, self.size = chunk, 0, self.size + len(chunk)
        end = len(self._chunk) if size < 0 else min(self._at + size, len(self._chunk))
        data = self._chunk[self._at:end]
        self._at = end
        self.md5.update(data)
        return data

    def drain(self) -> None:
        """Read what the tar left after its end (its padding), for the whole file's md5."""
        while self.read(_CHUNK):
            pass


def _own_file_size(path: Path) -> int:
    """The size of a file this step left in its cache folder, or 0 when absent. Anything
    there but a regular file (a symbolic link to a host file, a FIFO) is refused: the
    download writes into it and sends what it derives from it to the server."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return 0
    if not stat.S_ISREG(info.st_mode):
        raise StepError(f"{path} is not a regular file (a link or device planted in the "
                        "download's cache folder?); remove it")
    return info.st_size


def _read_validator(path: Path) -> str | None:
    """The validator saved beside a partial download: a regular file (never followed as a
    link) of at most MAX_VALIDATOR_BYTES holding one strong ETag or HTTP date; None when
    absent or anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:          # absent, or a link (ELOOP)
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_VALIDATOR_BYTES:
            return None
        value = handle.read(MAX_VALIDATOR_BYTES + 1).decode("ascii", errors="replace").strip()
    return value if _VALIDATOR.fullmatch(value) else None


def _validator_of(response) -> str | None:
    """The response's strong ETag, else its Last-Modified, when it is one If-Range may carry."""
    etag = response.headers.get("ETag", "")
    value = (etag if etag and not etag.startswith("W/")
             else response.headers.get("Last-Modified") or "").strip()
    return value if _VALIDATOR.fullmatch(value) else None


def _save_validator(path: Path, value: str | None) -> None:
    if value:
        _write_own(path, value)
    else:
        path.unlink(missing_ok=True)


def _resume_point(response, offset: int, url: str) -> tuple[int, int | None]:
    """(offset to append at, total size or None) from a 200 or 206 response."""
    length = response.headers.get("Content-Length")
    if length is not None and not length.strip().isdigit():
        raise StepError(f"download of {redact(url)}: the server sent Content-Length "
                        f"{length!r:.40}, not a number of bytes")
    if response.status == 206:
        match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)",
                             response.headers.get("Content-Range", "").strip())
        if match and int(match.group(1)) == offset:
            total = match.group(3)
            return offset, int(total) if total != "*" else None
        raise _Transient("server answered the resume request with the wrong range")
    # 200: the whole file (a server that ignores Range starts us over).
    return 0, int(length) if length is not None else None


def _range_total(content_range: str) -> int | None:
    match = re.search(r"/(\d+)\s*$", content_range)
    return int(match.group(1)) if match else None


def _body(response, offset: int, url: str, budget: tuple[float, float]) -> Iterator[bytes]:
    """The response body from ``offset``, as it arrives.

    A body without a length stops at ``max_download_bytes``; one that trickles (fewer than
    ``http_window_bytes`` in a ``http_stall_seconds`` window) is a stalled attempt; nothing
    streams past the ``budget``'s deadline: (monotonic deadline, the budget in seconds)."""
    allowed = limits.get("max_download_bytes")
    stall_s, window_bytes = limits.get("http_stall_seconds"), limits.get("http_window_bytes")
    received, window_start, in_window = 0, time.monotonic(), 0
    while True:
        try:
            chunk = response.read1(_CHUNK)     # what has arrived, not a full buffer
        except (http.client.HTTPException, ConnectionError, TimeoutError) as exc:
            raise _Transient(f"connection lost ({exc.__class__.__name__})") from None
        if not chunk:
            return
        now, in_window = time.monotonic(), in_window + len(chunk)
        if now > budget[0]:
            raise StepError(f"download of {redact(url)} ran past its time budget of "
                            f"{budget[1]:g} s ({limits.LIMITS['http_budget_seconds'].env}) "
                            f"after {offset + received + len(chunk)} bytes")
        if now - window_start >= stall_s:
            if in_window < window_bytes:
                raise _Transient(f"stalled: {in_window} bytes in {now - window_start:.0f}"
                                 f" s, fewer than {window_bytes} "
                                 f"({limits.LIMITS['http_window_bytes'].env})")
            window_start, in_window = now, 0
        if offset + received + len(chunk) > allowed:
            limits.check("max_download_bytes", offset + received + len(chunk),
                         f"download of {redact(url)} (still streaming)")
        yield chunk
        received += len(chunk)


# ----------------------------------------------------------------------------- checking

def file_md5(path: Path, progress: bool = True) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as handle, tqdm(total=path.stat().st_size, desc="md5", unit="B",
                                          unit_scale=True, unit_divisor=1024,
                                          disable=not progress, file=sys.stderr) as bar:
        while chunk := handle.read(8 * _CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def check_md5(path: Path, expected: str, progress: bool = True) -> None:
    actual = file_md5(path, progress)
    if actual != expected:
        raise StepError(f"md5 mismatch for {path.name}: expected {expected}, got {actual}")


# ----------------------------------------------------------------------------- extraction

def member_target(member: tarfile.TarInfo, archive: str) -> PurePosixPath | None:
    """Relative path to extract ``member`` (of the archive named ``archive``) to, None to skip
    it; unsafe members are refused."""
    name = member.name
    where = f"{archive}: member '{name}'"
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        raise StepError(f"unsafe archive {where} has an absolute path")
    rel = PurePosixPath(name.replace("\\", "/"))
    if ".." in rel.parts:
        raise StepError(f"unsafe archive {where} points outside the archive ('..')")
    if member.issym() or member.islnk():
        raise StepError(f"unsafe archive {where} is a {'symbolic' if member.issym() else 'hard'}"
                        f" link to '{member.linkname}'")
    if member.ischr() or member.isblk() or member.isfifo():
        raise StepError(f"unsafe archive {where} is a device or fifo")
    if member.issparse() or any(key.startswith("GNU.sparse") for key in member.pax_headers):
        raise StepError(f"unsafe archive {where} is a sparse file (claims {member.size} bytes)")
    if not (member.isfile() or member.isdir()):
        raise StepError(f"unsafe archive {where} has unsupported type {member.type!r}")
    if not rel.parts or "__MACOSX" in rel.parts or rel.name.startswith("._"):
        return None
    return rel


_METADATA_BLOCKS = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE,
                    tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)


class _BoundedTarInfo(tarfile.TarInfo):
    """A tar header whose metadata blocks (PAX headers, GNU long names and links) are held
    to ``max_tar_header_bytes`` before tarfile reads one whole into memory: a 10 MB .tar.gz
    can declare a 2 GiB PAX header. tarfile builds every header, nested ones included,
    through this class's ``_proc_member``."""

    def _proc_member(self, tarfile_):
        if self.type in _METADATA_BLOCKS:
            limits.check("max_tar_header_bytes", self.size,
                         f"tar header block (type {self.type.decode(errors='replace')!r}) at "
                         f"byte {self.offset}")
        return super()._proc_member(tarfile_)


class _CountingReader:
    """File wrapper that reports bytes read to a progress bar (for streamed extraction)."""

    def __init__(self, handle: BinaryIO, bar: tqdm):
        self._handle, self._bar = handle, bar

    def read(self, size: int = -1) -> bytes:
        data = self._handle.read(size)
        self._bar.update(len(data))
        return data


class _Budget:
    """The extraction limits of one archive or source directory, checked before each write."""

    def __init__(self, label: str):
        self.label, self.members, self.total = label, 0, 0
        self.max_members = limits.get("max_members")
        self.max_member = limits.get("max_member_bytes")
        self.max_total = limits.get("max_extract_bytes")

    def take(self, name: str, size: int) -> None:
        self.members += 1
        self.total += size
        if self.members > self.max_members:
            limits.check("max_members", self.members, f"{self.label}: at member '{name}'")
        if size > self.max_member:
            limits.check("max_member_bytes", size, f"{self.label}: member '{name}'")
        if self.total > self.max_total:
            limits.check("max_extract_bytes", self.total, f"{self.label}: up to '{name}'")


def extract_tar(archive: Path, dest: Path, progress: bool = True,
                saver: bykey.Saver | None = None) -> int:
    """Stream-extract ``archive`` (tar, tar.gz, tar.bz2, tar.xz) into ``dest``; return files."""
    with open(archive, "rb") as handle, tqdm(total=archive.stat().st_size, desc="extract",
                                             unit="B", unit_scale=True, unit_divisor=1024,
                                             disable=not progress, file=sys.stderr) as bar:
        return extract_stream(_CountingReader(handle, bar), archive.name, dest, saver)


def saved_as_extracted(rel: PurePosixPath) -> bool:
    """Whether an extracted file goes to the ``saver`` at once, at its path in the tar: a
    file of ``Task01_BrainTumour/`` (the task's own layout, where that path is its path in
    the artifact) other than its ``dataset.json``, which :func:`locate_task` reads to
    confirm the layout at the end."""
    return rel.parts[0] == TASK and rel != PurePosixPath(TASK, DATASET_JSON)


def extract_stream(fileobj, name: str, dest: Path, saver: bykey.Saver | None = None) -> int:
    """Extract the tar that ``fileobj.read`` gives (the archive ``name``) into ``dest``;
    return the files written. With a ``saver``, each file :func:`saved_as_extracted` picks is
    queued to be saved by key as soon as it is written, so the upload overlaps the rest of
    the extraction.

    Members are read one at a time (mode ``r|*``), so memory stays flat for a 7 GB tar; each
    one's declared size is held to the limits before a byte of it is written. A file member
    named twice is refused: the later one would overwrite the earlier one's file, perhaps
    while it is being saved.
    """
    dest.mkdir(parents=True, exist_ok=True)
    budget = _Budget(name)
    written: set[PurePosixPath] = set()
    try:
        with tarfile.open(fileobj=fileobj, mode="r|*", tarinfo=_BoundedTarInfo) as tar:
            for member in tar:
                rel = member_target(member, name)
                budget.take(member.name, member.size if member.isfile() else 0)
                if rel is None:
                    continue
                target = dest.joinpath(*rel.parts)
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                if rel in written:
                    raise StepError(f"{name}: member '{member.name}' appears twice in the "
                                    "archive")
                written.add(rel)
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None
                with open(target, "wb") as out:
                    shutil.copyfileobj(source, out, _CHUNK)
                if saver is not None and saved_as_extracted(rel):
                    saver.save([(target, rel.as_posix())])
    except _ARCHIVE_ERRORS as exc:
        raise StepError(f"{name} is not a readable tar archive "
                        f"({exc.__class__.__name__}: {exc})") from None
    except OSError as exc:
        raise StepError(f"cannot extract {name}: {exc}") from None
    return len(written)


def stream_http_tar(url: str, name: str, dest: Path, md5: str | None,
                    progress: bool = True, saver: bykey.Saver | None = None) -> None:
    """Extract the tar at ``url`` into ``dest`` as it arrives (:class:`HttpBody`), with no
    copy of the archive on disk; its md5, over every byte the server sent, is checked at the
    end, before anything extracted is published (a ``saver``'s objects are deleted with the
    rest of a failed step's). A body sent again from byte 0 is extracted again into an
    emptied ``dest``, and saved again (HttpBody's retries bound how often)."""
    with tqdm(desc=name, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
              file=sys.stderr) as bar:
        chunks = HttpBody(url, bar=bar).chunks()
        while True:
            reader = _BodyReader(chunks)
            try:
                extract_stream(reader, name, dest, saver)
                reader.drain()
                break
            except _SentAgain as again:
                if saver is not None:
                    saver.discard()       # its uploads read the files about to be removed
                shutil.rmtree(dest)
                chunks = itertools.chain([(0, again.chunk)], chunks)
    actual = reader.md5.hexdigest()
    if md5 and actual != md5:
        raise StepError(f"md5 mismatch for {name}: expected {md5}, got {actual}")


def locate_task(root: Path, label: str) -> Path:
    """The directory holding ``dataset.json``: ``root/Task01_BrainTumour``, ``root`` itself,
    or the only subdirectory of ``root`` that has one."""
    if (root / TASK / DATASET_JSON).is_file():
        return root / TASK
    if (root / DATASET_JSON).is_file():
        return root
    found = sorted(d for d in root.iterdir() if d.is_dir() and (d / DATASET_JSON).is_file())
    if len(found) == 1:
        return found[0]
    raise StepError(f"{label}: no {TASK}/{DATASET_JSON} found"
                    + (f" (several candidates: {', '.join(d.name for d in found)})"
                       if found else ""))


def _regular(path: Path, root: Path, label: str) -> os.stat_result:
    """lstat of ``path``, which must be a regular file (not a link, fifo or device) whose
    real location is inside ``root``."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise StepError(f"{label}: {path} cannot be read ({exc.strerror or exc})") from None
    if stat.S_ISLNK(info.st_mode):
        raise StepError(f"{label}: {path} is a symbolic link; only regular files are copied")
    if not stat.S_ISREG(info.st_mode):
        raise StepError(f"{label}: {path} is not a regular file (a fifo, device or directory)")
    if not path.resolve().is_relative_to(root):
        raise StepError(f"{label}: {path} lies outside {root} (through a linked directory)")
    return info


def copy_task(task: Path, root: Path, dest: Path) -> None:
    """Copy ``dataset.json`` and exactly the files it lists from ``task`` (inside the source
    directory ``root``) to ``dest``. Nothing else is read: no link is followed out of
    ``root``, and a listed link, fifo or device is refused by name."""
    label = f"--source {root}"
    root = root.resolve()
    if not task.resolve().is_relative_to(root):
        raise StepError(f"{label}: {task} lies outside the source directory")
    _regular(task / DATASET_JSON, root, label)
    listed = listed_paths(read_spec(task / DATASET_JSON), f"{TASK}/{DATASET_JSON}")
    budget = _Budget(label)
    for rel in [DATASET_JSON, *listed]:
        source = task.joinpath(*PurePosixPath(rel).parts)
        info = _regular(source, root, label)
        budget.take(rel, info.st_size)
        target = dest.joinpath(*PurePosixPath(rel).parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        with os.fdopen(os.open(source, flags), "rb") as src, open(target, "wb") as out:
            shutil.copyfileobj(src, out, _CHUNK)


# ----------------------------------------------------------------------------- validation

def read_spec(path: Path) -> schemas.RawTask:
    """The task's ``dataset.json``, checked against the schema preprocess reads it with."""
    return schemas.load(path, schemas.RawTask, f"{TASK}/{DATASET_JSON}")


def listed_paths(spec: schemas.RawTask, where: str) -> list[str]:
    """Every image and label path ``dataset.json`` lists (at most ``max_cases`` cases),
    each a clean relative path."""
    limits.check("max_cases", len(spec.training) + len(spec.test), f"{where}: training + test")
    paths = [path for entry in spec.training for path in (entry.image, entry.label)]
    paths += [entry if isinstance(entry, str) else entry.image for entry in spec.test]
    for listed in paths:
        if clean_relative(listed) is None:
            raise StepError(f"{where} lists '{listed}', which is not a path inside {TASK}")
    return list(dict.fromkeys(PurePosixPath(p).as_posix() for p in paths))


def validate_task(task: Path) -> tuple[int, int]:
    """Check ``dataset.json`` against the files; return (training cases, test cases).

    Errors name the task-relative file: the first missing image or label, or the bad key.
    """
    where = f"{TASK}/{DATASET_JSON}"
    spec = read_spec(task / DATASET_JSON)
    for rel in listed_paths(spec, where):
        if not task.joinpath(*PurePosixPath(rel).parts).is_file():
            raise StepError(f"{where} lists {rel} but {TASK}/{rel} is missing")
    return len(spec.training), len(spec.test)


# ----------------------------------------------------------------------------- the step

def extracts_tar(source: Source) -> bool:
    """Whether :func:`build_raw` extracts a tar for ``source`` (and can save by key as it
    does): http(s) and S3 sources, and a file that is not a directory."""
    return source.kind in ("http", "s3") or (source.kind == "file" and source.path is not None
                                             and source.path.is_file())


def build_raw(source: Source, staging: Path, cache_dir: Path | None, md5: str | None,
              progress: bool = True, saver: bykey.Saver | None = None) -> Path:
    """Fill ``staging`` with ``Task01_BrainTumour/``; return it (not yet validated). Without
    a ``cache_dir`` an http archive is extracted as it arrives (no copy of it on disk), and an
    S3 one is fetched into ``staging/.download``, which the step removes. A tar's files are
    also saved by key as they are extracted (``saver``, :func:`extract_stream`) when it has
    the task's own layout; another layout's are left to the executor."""
    target = staging / TASK
    if source.kind == "synthetic":
        p = source.synthetic
        return write_msd_task(staging, p["cases"], p["shape"], p["seed"], p["test"], progress)
    if source.kind == "file":
        assert source.path is not None
        if not source.path.exists():
            raise StepError(f"--source '{source.uri}': {source.path} does not exist")
        if source.path.is_dir():
            copy_task(locate_task(source.path, str(source.path)), source.path, target)
            (target / "imagesTs").mkdir(exist_ok=True)
            return target
        if not source.path.is_file():
            raise StepError(f"--source '{source.uri}': {source.path} is not a regular file "
                            "or directory")
    scratch = staging / ".extract"
    if source.kind == "http" and cache_dir is None:
        stream_http_tar(source.uri, source.file_name or "download", scratch, md5, progress,
                        saver)
        label = source.file_name
    else:
        archive = fetch(source, cache_dir or staging / ".download", progress)
        if md5:
            check_md5(archive, md5, progress)
        extract_tar(archive, scratch, progress, saver)
        label = archive.name
    task = locate_task(scratch, label)
    if saver is not None:
        if task == scratch / TASK:
            saver.saved()      # its uploads read the files where they were extracted
        else:
            saver.discard()    # saved at their paths in the tar, which are not the artifact's
    os.replace(task, target)
    shutil.rmtree(scratch, ignore_errors=True)
    (target / "imagesTs").mkdir(exist_ok=True)
    return target


def _parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="python -m steps.download",
        description="Fetch MSD Task01_BrainTumour (or generate a synthetic stand-in) and "
                    f"publish it as the '{ARTIFACT}' artifact.")
    parser.add_argument(
        "--source", required=True, metavar="URI",
        help="where the data comes from: s3://msd-for-monai/Task01_BrainTumour.tar or "
             "s3://msd-for-monai-eu/... (public AWS buckets, read anonymously); "
             "s3://bucket/key on the endpoint from AWS_ENDPOINT_URL/AWS_* variables; "
             "https://... or http://... (resumed with Range requests); file:///path to a "
             ".tar/.tar.gz or to an extracted task directory (or its parent); "
             "synthetic://?cases=N&shape=HxWxD&seed=S&test=M for generated BraTS-like cases "
             f"(defaults: {'&'.join(f'{k}={v}' for k, v in uris.SYNTHETIC_DEFAULTS.items())})")
    add_artifacts(parser, STEP)
    parser.add_argument(
        "--md5", default="auto", metavar="HEX",
        help="expected md5 of the downloaded archive, checked before extraction. 'auto' "
             "(default) uses the published digest when the file is Task01_BrainTumour.tar "
             f"({PUBLISHED_MD5['Task01_BrainTumour.tar']}); '' skips the check")
    parser.add_argument(
        "--cache-dir", default=None, metavar="DIR",
        help="where downloads are kept ('.part' files are resumed by the next run). Default: "
             "none for http(s), whose tar is extracted as it arrives; inside --raw for s3, "
             "removed with it on success or failure. An explicit --cache-dir is kept; a finished file in it is reused only after a run "
             "that used it succeeded, and only while its sha256 is unchanged")
    parser.add_argument(
        "--no-progress", action="store_true",
        help="no progress bars on stderr (errors and the final summary still print)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    source = parse_source(args.source)
    md5 = resolve_md5(args.md5, source)
    raw = Path(args.raw)
    check_disjoint({"--raw": raw, "--raw-uri": args.raw_uri, "--cache-dir": args.cache_dir},
                   {"--source": source.uri if source.kind == "s3" else source.path})
    if args.cache_dir:
        try:
            Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StepError(f"--cache-dir {args.cache_dir}: cannot create it "
                            f"({exc.strerror or exc})") from None
    progress = not args.no_progress
    params = {"source": redact(source.uri), "md5": args.md5}
    started = time.monotonic()
    saver = bykey.Saver(args.raw_uri, ARTIFACT, keep=True) \
        if args.raw_uri and extracts_tar(source) else None
    # as in preprocess: on an error the saver's uploads end (and its prefix is emptied) before
    # publish empties the folder they read from
    with publish(raw, ARTIFACT, STEP, params, saved=saver and saver.saved) as staging, \
            saver or nullcontext():
        cache_dir = Path(args.cache_dir) if args.cache_dir else None
        kept = cache_dir / cache_name(source) if args.cache_dir and source.kind in (
            "http", "s3") else None
        try:
            task = build_raw(source, staging, cache_dir, md5, progress, saver)
            n_train, n_test = validate_task(task)
        except BaseException:
            if kept:
                forget_cached(kept)  # never trusted by a later run
            raise
        if kept:
            trust_cached(kept)
        elif not args.cache_dir:
            shutil.rmtree(staging / ".download", ignore_errors=True)
        if saver is not None:
            saver.let_go(staging)   # validated whole; the executor saves only the rest
    size = bykey.artifact_bytes(raw, saver)
    print(f"download: {n_train} training + {n_test} test cases of {TASK} from "
          f"{redact(source.uri)} -> {raw} ({size / 2**20:.1f} MiB, "
          f"{time.monotonic() - started:.1f} s"
          f"{', ' + bykey.saved_note(saver) if saver else ''})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
