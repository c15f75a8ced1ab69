"""Artifact directories: ``MANIFEST.json`` and publishing without partial results.

Every output directory of a step ends with a ``MANIFEST.json`` written last. It names the
artifact, the schema version, every file with its size and sha256, and the producing step
with its version and parameters. Consumers call :func:`require` before they read anything.

:func:`publish` gives a step a staging directory; only when the step's body finishes do the
files move into the output directory and the manifest follows. On any error the output
directory is left empty, so nothing partial is ever published.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator, Sequence

from steps import __version__, schemas, uris
from steps.params import IO, OUTPUTS_DIR
from steps.errors import StepError

MANIFEST = "MANIFEST.json"
SCHEMA_VERSION = 1
_STAGING = ".staging"
_HASH_CHUNK = 8 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def list_files(root: Path) -> list[Path]:
    """Every regular file under ``root`` except the manifest, as sorted relative paths."""
    files = [p.relative_to(root) for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    return sorted(f for f in files if f.as_posix() != MANIFEST and _STAGING not in f.parts)


def build_manifest(root: Path, artifact: str, step: str, parameters: dict[str, Any],
                   elsewhere: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The manifest of every file under ``root``, and of ``elsewhere``'s entries (files
    of the artifact already saved by key, ``steps.bykey.Saver``), in path order."""
    files = [{"path": rel.as_posix(), "size": (root / rel).stat().st_size,
              "sha256": sha256_file(root / rel)} for rel in list_files(root)]
    files = sorted([*files, *elsewhere], key=lambda entry: entry["path"])
    return {
        "artifact": artifact,
        "schema_version": SCHEMA_VERSION,
        "producer": {"step": step, "version": __version__, "parameters": parameters},
        "files": files,
    }


def write_manifest(root: Path, artifact: str, step: str, parameters: dict[str, Any],
                   elsewhere: Sequence[dict[str, Any]] = ()) -> Path:
    """Hash every file under ``root`` and write ``MANIFEST.json`` atomically, last."""
    manifest = build_manifest(root, artifact, step, parameters, elsewhere)
    target = root / MANIFEST
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, target)
    return target


def write_outputs(out: Path, step: str, values: dict[str, str]) -> None:
    """The step's small results as ``argo-outputs/<name>`` (Argo's output parameters);
    the names must be exactly the step's ``params.IO`` outputs."""
    names = sorted(IO[step].outputs)
    if sorted(values) != names:
        raise ValueError(f"{step} outputs {sorted(values)} are not {names}")
    folder = out / OUTPUTS_DIR
    folder.mkdir()
    for name, text in values.items():
        (folder / name).write_text(f"{text}\n")


def clean_relative(rel: Any) -> PurePosixPath | None:
    """``rel`` as a relative POSIX path that cannot leave its root by name (no absolute path,
    ``..``, backslash or control character), or None: the one rule for paths listed in an
    artifact's or a task's metadata."""
    if not isinstance(rel, str) or not rel or "\\" in rel or any(ord(c) < 32 for c in rel):
        return None
    pure = PurePosixPath(rel)
    return None if pure.is_absolute() or ".." in pure.parts or not pure.parts else pure


def inside(root: Path | str, rel: Any, where: str) -> Path:
    """``root/rel`` for a path read from an artifact's own metadata (``MANIFEST.json``,
    ``dataset.json``): a clean relative path that stays inside ``root``, links included."""
    root = Path(root)
    pure = clean_relative(rel)
    if pure is None:
        raise StepError(f"{where}: {rel!r} is not a relative path inside {root}")
    path = root.joinpath(*pure.parts)
    if not path.resolve().is_relative_to(root.resolve()):
        raise StepError(f"{where}: {rel!r} leads outside {root} (through a link)")
    return path


def _real(path: Path | str) -> Path:
    """``path`` absolute with every link resolved (as far as it exists)."""
    return Path(os.path.abspath(path)).resolve()


def _s3_parts(place: Path | str) -> tuple[str, ...] | None:
    """(bucket, *key's parts) of an ``s3://`` place; None for a local path."""
    if not (isinstance(place, str) and place.startswith("s3://")):
        return None
    parsed = uris.parse(place, "S3 URI", ("s3",))
    return (parsed.bucket, *PurePosixPath(parsed.key.strip("/")).parts)


def _overlap(a: Path | str, b: Path | str) -> bool:
    """Equal (by name after links, or the same file by inode), or one inside the other; two
    S3 prefixes by bucket and key, and an S3 prefix never with a local path."""
    s3_a, s3_b = _s3_parts(a), _s3_parts(b)
    if s3_a is not None or s3_b is not None:
        shorter = min(len(s3_a or ()), len(s3_b or ()))
        return s3_a is not None and s3_b is not None and s3_a[:shorter] == s3_b[:shorter]
    real_a, real_b = _real(a), _real(b)
    if real_a.is_relative_to(real_b) or real_b.is_relative_to(real_a):
        return True
    try:
        return os.path.samefile(a, b)        # hard links
    except OSError:
        return False


def check_disjoint(outputs: dict[str, Path | str | None],
                   inputs: dict[str, Path | str | None]) -> None:
    """Refuse an output (flag -> local path or ``s3://`` prefix) that equals, contains or
    lies inside an input or another output, links resolved: writing there would change an
    artifact the step reads, which then fails its own manifest. Every step calls it with its
    flags before any work; None (an unset flag, or an S3 place a step does not compare) is
    skipped."""
    outs = [(flag, _place(path)) for flag, path in outputs.items() if path]
    ins = [(flag, _place(path)) for flag, path in inputs.items() if path]
    for index, (flag, path) in enumerate(outs):
        for other, place in outs[index + 1:] + ins:
            if _overlap(path, place):
                raise StepError(f"{flag} {path} and {other} {place} overlap (the same place, "
                                "or one inside the other): an output must lie apart from "
                                "the step's inputs and other outputs")


def _place(path: Path | str) -> Path | str:
    """A local path as a Path; an ``s3://`` prefix kept as text (a Path would fold its //)."""
    return path if _s3_parts(path) is not None else Path(path)


def read_manifest(root: Path, artifact: str) -> dict[str, Any]:
    """``root``'s manifest checked against ``schemas.Manifest`` and naming ``artifact``."""
    path = Path(root) / MANIFEST
    where = f"artifact '{artifact}' at {root}: {MANIFEST}"
    if not path.is_file():
        raise StepError(f"{where} is missing (the producing step did not finish)")
    return check_manifest(schemas.read_json(path, where), artifact, where)


def check_manifest(manifest: Any, artifact: str, where: str) -> dict[str, Any]:
    """A parsed manifest checked against ``schemas.Manifest``, naming ``artifact`` in our
    schema version."""
    checked = schemas.validate(schemas.Manifest, manifest, where)
    if checked.artifact != artifact:
        raise StepError(f"{where} names artifact {checked.artifact!r}")
    if checked.schema_version != SCHEMA_VERSION:
        raise StepError(f"{where} schema version {checked.schema_version} is not "
                        f"{SCHEMA_VERSION}")
    return manifest


def require(root: Path | str, artifact: str, check_hashes: bool = True) -> dict[str, Any]:
    """Check that ``root`` holds a complete ``artifact``; return its manifest.

    Every listed file must exist with the listed size (and sha256 when ``check_hashes``), and
    no unlisted file may be present. Raises StepError naming the artifact and the file.
    """
    root = Path(root)
    manifest = read_manifest(root, artifact)
    listed = {entry["path"]: entry for entry in manifest["files"]}
    for rel, entry in listed.items():
        path = inside(root, rel, f"artifact '{artifact}' at {root}: {MANIFEST}")
        if not path.is_file():
            raise StepError(f"artifact '{artifact}' at {root}: {rel} is listed in {MANIFEST} "
                            "but missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise StepError(f"artifact '{artifact}' at {root}: {rel} has {size} bytes, "
                            f"{MANIFEST} says {entry['size']}")
        if check_hashes and sha256_file(path) != entry["sha256"]:
            raise StepError(f"artifact '{artifact}' at {root}: {rel} does not match its "
                            f"sha256 in {MANIFEST}")
    extra = [rel.as_posix() for rel in list_files(root) if rel.as_posix() not in listed]
    if extra:
        raise StepError(f"artifact '{artifact}' at {root}: {extra[0]} is not listed in "
                        f"{MANIFEST}")
    return manifest


def manifest_digest(root: Path | str) -> str:
    """sha256 of an artifact's MANIFEST.json: one digest that pins every file in it."""
    return sha256_file(Path(root) / MANIFEST)


def _empty(directory: Path) -> None:
    for child in directory.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


def _disk_full(exc: OSError) -> bool:
    """ENOSPC, EFBIG (RLIMIT_FSIZE) or EDQUOT, or numpy's errno-less short-write error."""
    if exc.errno in _FULL:
        return True
    text = str(exc)
    return exc.errno is None and " requested and " in text and text.endswith(" written")


@contextmanager
def publish(out_dir: Path | str, artifact: str, step: str, parameters: dict[str, Any],
            saved: Callable[[], Sequence[dict[str, Any]]] | None = None) -> Iterator[Path]:
    """Yield an empty staging directory; on success publish it into ``out_dir``.

    ``saved``, when given, is called after the body: the manifest entries of the artifact's
    files that the step saved by key and no longer holds (``steps.bykey.Saver``).

    The staging directory lives inside ``out_dir`` (same filesystem, so moves are renames, and
    no write outside the declared output). ``out_dir`` must be empty or absent. On success the
    staged files move up and ``MANIFEST.json`` is written last; on any exception ``out_dir``
    is emptied, removed when this call made it, and the exception propagates: Argo's wait
    container saves an output whose path exists even after the step failed (v4.0.5
    cmd/argoexec/commands/wait.go, SaveArtifacts), and would list an empty artifact.
    """
    out_dir = Path(out_dir)
    made = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        leftovers = [p.name for p in out_dir.iterdir()]
        if not leftovers:
            (out_dir / _STAGING).mkdir()
    except OSError as exc:  # e.g. a pod without a writable volume there, or a path in /proc
        raise StepError(f"output directory {out_dir} for '{artifact}': cannot create it "
                        f"({exc.strerror or exc}: {exc.filename}); the step needs a writable "
                        "directory there (on a cluster: a volume mounted at or above it)"
                        ) from None
    if leftovers:
        raise StepError(f"output directory {out_dir} for '{artifact}' is not empty "
                        f"(found {sorted(leftovers)[0]})")
    staging = out_dir / _STAGING
    try:
        yield staging
        for child in sorted(staging.iterdir()):
            os.replace(child, out_dir / child.name)
        staging.rmdir()
        write_manifest(out_dir, artifact, step, parameters, saved() if saved else ())
    except BaseException as exc:
        _empty(out_dir)
        if made:
            out_dir.rmdir()
        if isinstance(exc, OSError) and _disk_full(exc):
            raise StepError(f"output directory {out_dir} for '{artifact}': disk full or file "
                            f"size limit reached ({exc.strerror or exc}); nothing was "
                            "published, free space or give the step a larger volume") from None
        raise
