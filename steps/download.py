"""Download step: fetch MSD Task01_BrainTumour and publish it as the ``raw`` artifact.

``python -m steps.download --source URI --raw DIR [--md5 HEX|auto|""] [--cache-dir DIR]``

Output (``raw``): ``Task01_BrainTumour/{dataset.json, imagesTr/, labelsTr/, imagesTs/}`` plus
``MANIFEST.json``, written last by :func:`steps.artifacts.publish`.

Sources:

- ``s3://msd-for-monai/Task01_BrainTumour.tar`` and ``s3://msd-for-monai-eu/…``: the public
  AWS buckets, read anonymously from AWS itself whatever ``AWS_ENDPOINT_URL`` says;
- ``s3://bucket/key``: any other object on the configured endpoint (``AWS_*`` variables);
- ``https://…`` / ``http://…``: streamed, resumed from the ``.part`` file with a Range request
  after an interruption, transient errors retried with exponential backoff;
- ``file:///path/x.tar`` (or .tar.gz), or ``file:///path/dir`` holding an extracted task (the
  Task01_BrainTumour directory or its parent);
- ``synthetic://?cases=N&shape=HxWxD&seed=S&test=M``: BraTS-like cases from
  :mod:`steps.synthetic`.

Downloads land in a cache directory beside the output (never in it), are checked against the
md5 before anything is extracted, and are extracted member by member with every unsafe member
refused (absolute paths, ``..``, links, devices) and macOS ``._*`` files dropped.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import http.client
import json
import lzma
import os
import re
import shutil
import sys
import tarfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Sequence
from urllib.error import HTTPError, URLError
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit
from urllib.request import Request, urlopen

from tqdm import tqdm

from steps import __version__
from steps.artifacts import publish
from steps.errors import OneLineArgumentParser, StepError, run_main
from steps.synthetic import MIN_SHAPE, TASK, write_msd_task

ARTIFACT = "raw"
STEP = "download"
DATASET_JSON = "dataset.json"
# MONAI's DecathlonDataset md5 of the published tarball.
PUBLISHED_MD5 = {"Task01_BrainTumour.tar": "240a19d752f0d9e9101544901065d872"}
SCHEMES = ("s3", "https", "http", "file", "synthetic")
SYNTHETIC_DEFAULTS = {"cases": 10, "shape": "240x240x155", "seed": 0, "test": 0}

HTTP_RETRIES = 5
HTTP_BACKOFF_S = 1.0
HTTP_TIMEOUT_S = 60.0
TRANSIENT_HTTP = frozenset({408, 425, 429, 500, 502, 503, 504})
_CHUNK = 1 << 20
_ARCHIVE_ERRORS = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, lzma.LZMAError)
_SECRET_QUERY = re.compile(r"sig|token|key|credential|secret|password|auth", re.IGNORECASE)


@dataclass(frozen=True)
class Source:
    """A parsed ``--source``: ``kind`` is one of SCHEMES (http covers https)."""
    kind: str
    uri: str
    path: Path | None = None
    synthetic: dict[str, Any] = field(default_factory=dict)

    @property
    def file_name(self) -> str:
        """Base name of the object the URI points at ('' for synthetic)."""
        if self.kind == "synthetic":
            return ""
        if self.path is not None:
            return self.path.name
        return PurePosixPath(unquote(urlsplit(self.uri).path)).name


def redact(uri: str) -> str:
    """``uri`` safe to print: no user:password, and secret-looking query values hidden."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return uri
    netloc = parts.netloc.rsplit("@", 1)[-1]
    query = "&".join(f"{k}=***" if _SECRET_QUERY.search(k) else f"{k}={v}"
                     for k, v in parse_qsl(parts.query, keep_blank_values=True))
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


# ----------------------------------------------------------------------------- parsing

def parse_source(uri: str) -> Source:
    """Parse ``--source``; a malformed or unsupported URI is a StepError naming it."""
    parts = urlsplit(uri.strip())
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise StepError(f"--source '{redact(uri)}': unsupported scheme '{parts.scheme}' "
                        f"(use one of {', '.join(s + '://' for s in SCHEMES)})")
    if scheme == "s3":
        if not parts.netloc or not parts.path.strip("/"):
            raise StepError(f"--source '{uri}': an s3 source needs s3://bucket/key")
        return Source("s3", uri.strip())
    if scheme in ("http", "https"):
        if not parts.netloc or not parts.path.strip("/"):
            raise StepError(f"--source '{redact(uri)}': an http(s) source needs a host and a "
                            "file path")
        return Source("http", uri.strip())
    if scheme == "file":
        return Source("file", uri.strip(), path=_file_path(uri, parts))
    return Source("synthetic", uri.strip(), synthetic=_synthetic_params(uri, parts))


def _file_path(uri: str, parts) -> Path:
    """file:///abs/path, file://localhost/abs/path, or file://relative/path."""
    if parts.netloc in ("", "localhost"):
        raw = parts.path
    else:
        raw = parts.netloc + parts.path
    if not raw:
        raise StepError(f"--source '{uri}': a file source needs a path (file:///data/x.tar)")
    return Path(unquote(raw))


def _synthetic_params(uri: str, parts) -> dict[str, Any]:
    """cases (≥1), shape (HxWxD), seed (≥0) and test (≥0) from the query string."""
    if parts.netloc or parts.path.strip("/"):
        raise StepError(f"--source '{uri}': write synthetic://?cases=N&shape=HxWxD&seed=S")
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        raise StepError(f"--source '{uri}': malformed query '{parts.query}'") from None
    params = dict(SYNTHETIC_DEFAULTS)
    seen = set()
    for key, value in pairs:
        if key not in SYNTHETIC_DEFAULTS:
            raise StepError(f"--source '{uri}': unknown parameter '{key}' (known: "
                            f"{', '.join(SYNTHETIC_DEFAULTS)})")
        if key in seen:
            raise StepError(f"--source '{uri}': parameter '{key}' is given twice")
        seen.add(key)
        params[key] = value
    out = {"cases": _int_param(uri, "cases", params["cases"], 1),
           "seed": _int_param(uri, "seed", params["seed"], 0),
           "test": _int_param(uri, "test", params["test"], 0),
           "shape": _shape_param(uri, str(params["shape"]))}
    return out


def _int_param(uri: str, key: str, value: Any, minimum: int) -> int:
    try:
        number = int(str(value))
    except ValueError:
        raise StepError(f"--source '{uri}': {key}='{value}' is not an integer") from None
    if number < minimum:
        raise StepError(f"--source '{uri}': {key}={number} must be at least {minimum}")
    return number


def _shape_param(uri: str, value: str) -> tuple[int, int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)", value.strip().lower())
    if not match:
        raise StepError(f"--source '{uri}': shape='{value}' is not HxWxD (e.g. 240x240x155)")
    shape = tuple(int(g) for g in match.groups())
    if any(s < m for s, m in zip(shape, MIN_SHAPE)):
        raise StepError(f"--source '{uri}': shape={value} is smaller than the minimum "
                        f"{'x'.join(map(str, MIN_SHAPE))}")
    return shape  # type: ignore[return-value]


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
    stable = urlunsplit(urlsplit(source.uri)._replace(query="", fragment=""))
    digest = hashlib.sha256(stable.encode()).hexdigest()[:12]
    return f"{digest}-{source.file_name or 'download'}"


def fetch(source: Source, cache_dir: Path, progress: bool = True) -> tuple[Path, bool]:
    """Make the archive local; return (path, is_cached_copy).

    A finished file in the cache is reused; an unfinished ``.part`` is resumed.
    """
    if source.kind == "file":
        assert source.path is not None
        return source.path, False
    cache_dir.mkdir(parents=True, exist_ok=True)
    dest = cache_dir / cache_name(source)
    if dest.is_file():
        print(f"download: using cached {dest}", file=sys.stderr)
        return dest, True
    if source.kind == "http":
        http_download(source.uri, dest, progress=progress)
    else:
        s3_download(source.uri, dest, progress=progress)
    return dest, True


def s3_download(uri: str, dest: Path, progress: bool = True) -> Path:
    """Fetch an S3 object through :mod:`steps.storage`, resuming ``dest.part``.

    storage reads the public MSD buckets unsigned from AWS in their own region, and every
    other bucket signed from the configured endpoint.
    """
    from steps import storage
    storage.download_file(uri, dest, resume=True, progress=progress)
    return dest


class _Transient(Exception):
    """A network fault worth retrying; ``progressed`` when bytes arrived before it."""

    def __init__(self, message: str, progressed: bool = False):
        super().__init__(message)
        self.progressed = progressed


def http_download(url: str, dest: Path, *, retries: int = HTTP_RETRIES,
                  backoff_s: float = HTTP_BACKOFF_S, timeout_s: float = HTTP_TIMEOUT_S,
                  progress: bool = True) -> Path:
    """Stream ``url`` to ``dest`` through ``dest.part``, resuming with Range requests.

    A dropped connection that delivered bytes is resumed at once; a fault with no progress is
    retried up to ``retries`` times with exponential backoff. Permanent HTTP errors (404, 403…)
    fail at once with one line.
    """
    part = dest.with_name(dest.name + ".part")
    failures = 0
    with tqdm(desc=dest.name.split("-", 1)[-1], unit="B", unit_scale=True, unit_divisor=1024,
              disable=not progress, file=sys.stderr) as bar:
        while True:
            try:
                _http_attempt(url, part, timeout_s, bar)
                break
            except _Transient as exc:
                failures = 0 if exc.progressed else failures + 1
                if failures > retries:
                    raise StepError(f"download of {redact(url)} failed after {retries} "
                                    f"retries: {exc}") from None
                if failures:
                    time.sleep(min(backoff_s * 2 ** (failures - 1), 60.0))
    os.replace(part, dest)
    return dest


def _http_attempt(url: str, part: Path, timeout_s: float, bar: tqdm) -> None:
    """One GET from the current end of ``part``; raises _Transient when incomplete."""
    offset = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": f"unet-argo/{__version__}"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        response = urlopen(Request(url, headers=headers), timeout=timeout_s)
    except HTTPError as exc:
        _http_error(url, part, offset, exc)
        return
    except (URLError, http.client.HTTPException, ConnectionError, TimeoutError) as exc:
        raise _Transient(str(getattr(exc, "reason", exc))) from None
    with response:
        offset, total = _resume_point(response, offset)
        bar.total = total
        bar.n = offset
        bar.refresh()
        received = _stream(response, part, offset, bar)
    size = offset + received
    if total is not None and size < total:
        raise _Transient(f"connection closed after {size} of {total} bytes",
                         progressed=received > 0)


def _http_error(url: str, part: Path, offset: int, exc: HTTPError) -> None:
    """Map an HTTP error status: complete file, restart, retry, or a permanent StepError."""
    if exc.code == 416 and offset:
        total = _range_total(exc.headers.get("Content-Range", ""))
        if total == offset:
            return  # the .part file is already complete
        part.unlink()
        raise _Transient("server refused to resume; restarting from zero", progressed=True)
    if exc.code in TRANSIENT_HTTP:
        raise _Transient(f"HTTP {exc.code} {exc.reason}")
    raise StepError(f"download of {redact(url)} failed: HTTP {exc.code} {exc.reason}")


def _resume_point(response, offset: int) -> tuple[int, int | None]:
    """(offset to append at, total size or None) from a 200 or 206 response."""
    length = response.headers.get("Content-Length")
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


def _stream(response, part: Path, offset: int, bar: tqdm) -> int:
    """Append the response body to ``part`` at ``offset``; return the bytes received."""
    received = 0
    try:
        with open(part, "r+b" if offset else "wb") as out:
            out.seek(offset)
            out.truncate()
            while True:
                try:
                    chunk = response.read(_CHUNK)
                except (http.client.HTTPException, ConnectionError, TimeoutError) as exc:
                    raise _Transient(f"connection lost ({exc.__class__.__name__})",
                                     progressed=received > 0) from None
                if not chunk:
                    return received
                out.write(chunk)
                received += len(chunk)
                bar.update(len(chunk))
    except _Transient:
        raise
    except OSError as exc:
        raise StepError(f"cannot write {part}: {exc.strerror or exc}") from None


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

def member_target(member: tarfile.TarInfo, archive: Path) -> PurePosixPath | None:
    """Relative path to extract ``member`` to, None to skip it; unsafe members are refused."""
    name = member.name
    where = f"{archive.name}: member '{name}'"
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
    if not (member.isfile() or member.isdir()):
        raise StepError(f"unsafe archive {where} has unsupported type {member.type!r}")
    if not rel.parts or "__MACOSX" in rel.parts or rel.name.startswith("._"):
        return None
    return rel


class _CountingReader:
    """File wrapper that reports bytes read to a progress bar (for streamed extraction)."""

    def __init__(self, handle: BinaryIO, bar: tqdm):
        self._handle, self._bar = handle, bar

    def read(self, size: int = -1) -> bytes:
        data = self._handle.read(size)
        self._bar.update(len(data))
        return data


def extract_tar(archive: Path, dest: Path, progress: bool = True) -> int:
    """Stream-extract ``archive`` (tar, tar.gz, tar.bz2, tar.xz) into ``dest``; return files.

    Members are read one at a time (mode ``r|*``), so memory stays flat for a 7 GB tar.
    """
    dest.mkdir(parents=True, exist_ok=True)
    files = 0
    with open(archive, "rb") as handle, tqdm(total=archive.stat().st_size, desc="extract",
                                             unit="B", unit_scale=True, unit_divisor=1024,
                                             disable=not progress, file=sys.stderr) as bar:
        try:
            with tarfile.open(fileobj=_CountingReader(handle, bar), mode="r|*") as tar:
                for member in tar:
                    rel = member_target(member, archive)
                    if rel is None:
                        continue
                    target = dest.joinpath(*rel.parts)
                    if member.isdir():
                        target.mkdir(parents=True, exist_ok=True)
                        continue
                    target.parent.mkdir(parents=True, exist_ok=True)
                    source = tar.extractfile(member)
                    assert source is not None
                    with open(target, "wb") as out:
                        shutil.copyfileobj(source, out, _CHUNK)
                    files += 1
        except _ARCHIVE_ERRORS as exc:
            raise StepError(f"{archive.name} is not a readable tar archive "
                            f"({exc.__class__.__name__}: {exc})") from None
        except OSError as exc:
            raise StepError(f"cannot extract {archive.name}: {exc}") from None
    return files


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


def copy_task(task: Path, dest: Path) -> None:
    """Copy an extracted task directory, following symlinks, without macOS ``._*`` files."""
    shutil.copytree(task, dest, copy_function=shutil.copyfile,
                    ignore=shutil.ignore_patterns("._*", "__MACOSX", ".DS_Store"))


# ----------------------------------------------------------------------------- validation

def validate_task(task: Path) -> tuple[int, int]:
    """Check ``dataset.json`` against the files; return (training cases, test cases).

    Errors name the task-relative file: the first missing image or label, or the bad key.
    """
    where = f"{TASK}/{DATASET_JSON}"
    try:
        meta = json.loads((task / DATASET_JSON).read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise StepError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise StepError(f"{where} must hold a JSON object")
    for key in ("modality", "labels"):
        if not isinstance(meta.get(key), dict) or not meta[key]:
            raise StepError(f"{where} has no '{key}' map")
    training = meta.get("training")
    if not isinstance(training, list) or not training:
        raise StepError(f"{where} has no 'training' list")
    test = meta.get("test", [])
    if not isinstance(test, list):
        raise StepError(f"{where}: 'test' must be a list")
    for key, entries in (("numTraining", training), ("numTest", test)):
        if key in meta and meta[key] != len(entries):
            raise StepError(f"{where}: {key} is {meta[key]} but the list has {len(entries)}")
    for index, entry in enumerate(training):
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str)
                                                  for k in ("image", "label")):
            raise StepError(f"{where}: training[{index}] needs 'image' and 'label' paths")
        _check_listed(task, where, entry["image"])
        _check_listed(task, where, entry["label"])
    for index, entry in enumerate(test):
        image = entry.get("image") if isinstance(entry, dict) else entry
        if not isinstance(image, str):
            raise StepError(f"{where}: test[{index}] is not an image path")
        _check_listed(task, where, image)
    return len(training), len(test)


def _check_listed(task: Path, where: str, listed: str) -> None:
    rel = PurePosixPath(listed)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise StepError(f"{where} lists '{listed}', which is not a path inside {TASK}")
    if not task.joinpath(*rel.parts).is_file():
        raise StepError(f"{where} lists {listed} but {TASK}/{rel.as_posix()} is missing")


# ----------------------------------------------------------------------------- the step

def build_raw(source: Source, staging: Path, cache_dir: Path, md5: str | None,
              progress: bool = True) -> Path:
    """Fill ``staging`` with ``Task01_BrainTumour/``; return it (not yet validated)."""
    target = staging / TASK
    if source.kind == "synthetic":
        p = source.synthetic
        return write_msd_task(staging, p["cases"], p["shape"], p["seed"], p["test"], progress)
    if source.kind == "file":
        assert source.path is not None
        if not source.path.exists():
            raise StepError(f"--source '{source.uri}': {source.path} does not exist")
        if source.path.is_dir():
            copy_task(locate_task(source.path, str(source.path)), target)
            (target / "imagesTs").mkdir(exist_ok=True)
            return target
    archive, cached = fetch(source, cache_dir, progress)
    if md5:
        try:
            check_md5(archive, md5, progress)
        except StepError:
            if cached:
                archive.unlink()  # a corrupt download must not be reused by the next run
            raise
    scratch = staging / ".extract"
    extract_tar(archive, scratch, progress)
    os.replace(locate_task(scratch, archive.name), target)
    shutil.rmtree(scratch, ignore_errors=True)
    (target / "imagesTs").mkdir(exist_ok=True)
    return target


def _parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="python -m steps.download",
        description="Fetch MSD Task01_BrainTumour (or generate a synthetic stand-in) and "
                    "publish it as the 'raw' artifact: Task01_BrainTumour/{dataset.json, "
                    "imagesTr/, labelsTr/, imagesTs/} plus MANIFEST.json.")
    parser.add_argument(
        "--source", required=True, metavar="URI",
        help="where the data comes from: s3://msd-for-monai/Task01_BrainTumour.tar or "
             "s3://msd-for-monai-eu/... (public AWS buckets, read anonymously); "
             "s3://bucket/key on the endpoint from AWS_ENDPOINT_URL/AWS_* variables; "
             "https://... or http://... (resumed with Range requests); file:///path to a "
             ".tar/.tar.gz or to an extracted task directory (or its parent); "
             "synthetic://?cases=N&shape=HxWxD&seed=S&test=M for generated BraTS-like cases "
             f"(defaults: {'&'.join(f'{k}={v}' for k, v in SYNTHETIC_DEFAULTS.items())})")
    parser.add_argument(
        "--raw", required=True, metavar="DIR",
        help="output directory of the 'raw' artifact; must be empty or absent")
    parser.add_argument(
        "--md5", default="auto", metavar="HEX",
        help="expected md5 of the downloaded archive, checked before extraction. 'auto' "
             "(default) uses the published digest when the file is Task01_BrainTumour.tar "
             f"({PUBLISHED_MD5['Task01_BrainTumour.tar']}); '' skips the check")
    parser.add_argument(
        "--cache-dir", default=None, metavar="DIR",
        help="where downloads are kept while they run ('.part' files are resumed by the next "
             "run). Default: .<raw name>.download beside --raw, removed after success; an "
             "explicit --cache-dir is kept and its finished files are reused")
    parser.add_argument(
        "--no-progress", action="store_true",
        help="no progress bars on stderr (errors and the final summary still print)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    source = parse_source(args.source)
    md5 = resolve_md5(args.md5, source)
    raw = Path(args.raw)
    cache_dir = Path(args.cache_dir) if args.cache_dir else raw.parent / f".{raw.name}.download"
    progress = not args.no_progress
    params = {"source": redact(source.uri), "md5": args.md5}
    started = time.monotonic()
    with publish(raw, ARTIFACT, STEP, params) as staging:
        task = build_raw(source, staging, cache_dir, md5, progress)
        n_train, n_test = validate_task(task)
    if not args.cache_dir:
        shutil.rmtree(cache_dir, ignore_errors=True)
    size = sum(p.stat().st_size for p in raw.rglob("*") if p.is_file())
    print(f"download: {n_train} training + {n_test} test cases of {TASK} from "
          f"{redact(source.uri)} -> {raw} ({size / 2**20:.1f} MiB, "
          f"{time.monotonic() - started:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
