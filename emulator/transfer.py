"""Moving artifacts between a node directory and the bucket, with Argo's keys and archives.

Argo's executor (``SaveArtifacts``) names an output artifact without an explicit key
``<keyFormat>/<file>``, where the artifact repository's keyFormat defaults to
``{{workflow.name}}/{{pod.name}}`` and ``<file>`` is the path's base name for
``archive: {none: {}}`` or ``<artifact>.tgz`` for the default tar+gzip archive. An explicit
``s3.key`` on the artifact is used as it is. A directory stored with ``archive: none`` is
a key prefix holding its regular files (Argo's ``PutDirectory`` in
``workflow/artifacts/s3/s3.go`` skips directories and links, so an empty directory stores
nothing); loading tries the key as one object first, then as a prefix, and a prefix with no
object is not found, as in Argo's ``loadS3Artifact``. A tar archive holds the path's base
name as its top entry. All S3 calls go through :mod:`steps.storage`.
"""
from __future__ import annotations

import shutil
import tarfile
import tempfile
from pathlib import Path

from steps import storage
from steps.artifacts import MANIFEST
from emulator.errors import LocalRunError
from emulator.results import ArtifactRef

DEFAULT_KEY_FORMAT = "{{workflow.name}}/{{pod.name}}"


def archive_mode(spec: dict) -> str:
    """``none`` or ``tar`` (Argo's default when ``archive`` is absent)."""
    archive = spec.get("archive")
    return "none" if archive is not None and "none" in archive else "tar"


def output_key(spec: dict, key_prefix: str, explicit_key: str | None) -> str:
    if explicit_key:
        return explicit_key.strip("/")
    name = Path(spec["path"]).name if archive_mode(spec) == "none" else f"{spec['name']}.tgz"
    return f"{key_prefix.strip('/')}/{name}"


def upload_output(spec: dict, local: Path, bucket: str, key: str) -> ArtifactRef:
    """Store ``local`` (file or directory) as output artifact ``spec``; return where."""
    mode = archive_mode(spec)
    kind = "dir" if local.is_dir() else "file"
    ref = ArtifactRef(spec["name"], bucket, key, mode, kind,
                      manifest=kind == "dir" and (local / MANIFEST).is_file())
    if mode == "tar":
        level = ((spec.get("archive") or {}).get("tar") or {}).get("compressionLevel", 6)
        with tempfile.TemporaryDirectory(dir=local.parent) as tmp:
            tgz = Path(tmp) / f"{spec['name']}.tgz"
            with tarfile.open(tgz, "w:gz", compresslevel=max(0, min(int(level), 9))) as tar:
                tar.add(local, arcname=local.name)
            storage.upload_file(tgz, ref.uri)
    elif kind == "dir":
        storage.upload_dir(local, ref.uri, progress=False)
    else:
        storage.upload_file(local, ref.uri)
    return ref


def probe(name: str, bucket: str, key: str) -> ArtifactRef:
    """What a key-only input artifact is: one object (a .tgz is unpacked) or a prefix."""
    uri = f"s3://{bucket}/{key}"
    if storage.exists(uri):
        tar = key.endswith((".tgz", ".tar.gz"))
        return ArtifactRef(name, bucket, key, "tar" if tar else "none", "file")
    keys = storage.list_keys(uri)
    if not keys:
        raise LocalRunError(f"input artifact '{name}': nothing at {uri}")
    prefix = key.strip("/") + "/"
    return ArtifactRef(name, bucket, key, "none", "dir", manifest=prefix + MANIFEST in keys)


def download_input(ref: ArtifactRef, dest: Path) -> None:
    """Place artifact ``ref`` at ``dest`` as the step expects to find it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if ref.archive == "tar":
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            tgz = Path(tmp) / "artifact.tgz"
            storage.download_file(ref.uri, tgz, progress=False)
            _untar(tgz, Path(tmp) / "out", dest)
    elif ref.kind == "dir":
        storage.download_dir(ref.uri, dest, artifact=None, require_manifest=ref.manifest,
                             progress=False)
    else:
        storage.download_file(ref.uri, dest, progress=False)


def _untar(tgz: Path, scratch: Path, dest: Path) -> None:
    """Extract; a single top-level entry (Argo's layout) becomes ``dest`` itself."""
    scratch.mkdir()
    with tarfile.open(tgz, "r:*") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(scratch, filter="data")
        else:  # Python without extraction filters: refuse unsafe members ourselves
            for member in tar.getmembers():
                target = (scratch / member.name).resolve()
                if not target.is_relative_to(scratch.resolve()) or member.issym() \
                        or member.islnk():
                    raise LocalRunError(f"{tgz.name}: unsafe archive member {member.name!r}")
            tar.extractall(scratch)
    entries = list(scratch.iterdir())
    source = entries[0] if len(entries) == 1 else scratch
    if dest.exists():
        shutil.rmtree(dest) if dest.is_dir() else dest.unlink()
    shutil.move(str(source), dest)


def fetch(ref: ArtifactRef, dest: Path) -> Path:
    """Download a finished run's artifact for the user (same layout as a step sees it)."""
    if dest.exists():
        shutil.rmtree(dest) if dest.is_dir() else dest.unlink()
    download_input(ref, dest)
    return dest
