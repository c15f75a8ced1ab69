"""An input artifact read by key from S3, file by file, instead of copied whole into the pod.

Argo's executor copies a whole input artifact into the pod before the step starts (v4.0.5
``workflow/artifacts/s3/s3.go``: ``GetDirectory`` fetches every object under the key). A step
that reads only part of an artifact, or one part at a time, can instead take the artifact's
S3 prefix (``s3://BUCKET/PREFIX``, where the producing step's output was saved): ``open_remote``
reads its ``MANIFEST.json`` (held to ``max_json_bytes`` and checked as a local manifest is),
and ``Remote.fetch`` brings one listed file into a folder of the step's own, checked against
the manifest's size before it streams and its sha256 after. So the pod holds what the step
is working on, not the artifact.

The other way, a step can write its output by key as it makes it (``Saver``): each finished
file goes to ``PREFIX/<path>`` at once, from a thread of its own so the upload overlaps the
work, and leaves the pod; the manifest the step writes last lists it. The executor then saves
only what is left in the output folder (the metadata and the manifest) at the same key, beside
what the step saved: its S3 driver adds objects under a key and removes none (v4.0.5
``workflow/artifacts/s3/s3.go``: ``saveS3Artifact``, ``PutDirectory``), and a reader's
``GetDirectory`` lists every object under it. So the artifact in S3 is whole, and the pod
never held it.
"""
from __future__ import annotations

import hashlib
import re
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Iterator, Sequence, TypeVar

from steps import schemas, storage
from steps.artifacts import MANIFEST, check_manifest, clean_relative, sha256_file
from steps.errors import StepError

SCHEME = "s3://"
T = TypeVar("T")


# "<n> bytes of <artifact> fetched by key[ in <s> s]" ("saved by key"): how a step that read an
# input (wrote its output) by key says what it moved (in its last line); the scale benchmarks
# count it as the step's S3 reads (writes), and the seconds, given where the step waited for
# its fetches, as time outside its compute.
FETCHED = re.compile(r"(\d+) bytes of ([\w-]+) fetched by key(?: in (\d+(?:\.\d+)?) s)?")
SAVED = re.compile(r"(\d+) bytes of ([\w-]+) saved by key")


def fetched_note(remote: "Remote", rels, seconds: float | None = None) -> str:
    """The words of :data:`FETCHED` for the files ``rels`` fetched from ``remote``, and the
    ``seconds`` the step waited for them when it did nothing else meanwhile."""
    waited = "" if seconds is None else f" in {seconds:.2f} s"
    return f"{remote.bytes_of(rels)} bytes of {remote.artifact} fetched by key{waited}"


def saved_note(saver: "Saver") -> str:
    """The words of :data:`SAVED` for what ``saver`` has saved."""
    return f"{saver.bytes_saved()} bytes of {saver.artifact} saved by key"


def artifact_bytes(root: Path, saver: "Saver | None") -> int:
    """The whole artifact's bytes: its files under ``root`` and those ``saver`` saved by key
    (no longer under ``root``, or never there). A step's summary gives this, not the few
    files a folder keeps once its cases are saved by key."""
    saved = saver.saved() if saver else []      # first: an upload under way removes its files
    here = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    return here + sum(entry["size"] for entry in saved
                      if not root.joinpath(*PurePosixPath(entry["path"]).parts).is_file())


def fetched_bytes(log: str) -> dict[str, int]:
    """Artifact -> the bytes a step's log says it fetched by key."""
    return _said_bytes(log, FETCHED)


def saved_bytes(log: str) -> dict[str, int]:
    """Artifact -> the bytes a step's log says it saved by key."""
    return _said_bytes(log, SAVED)


def _said_bytes(log: str, said: re.Pattern) -> dict[str, int]:
    return {m.group(2): int(m.group(1)) for m in said.finditer(log)}


def fetch_seconds(log: str) -> float:
    """The seconds a step's log says it waited for its fetches by key (0 where it says none)."""
    return sum(float(m.group(3) or 0) for m in FETCHED.finditer(log))


def is_remote(location: Path | str) -> bool:
    """Whether an artifact flag's value (``params.artifact_location``) is an S3 prefix."""
    return isinstance(location, str) and location.startswith(SCHEME)


@dataclass(frozen=True)
class Remote:
    """An artifact at an S3 prefix: ``files`` maps each path its manifest lists to (size,
    sha256)."""
    uri: str
    artifact: str
    files: dict[str, tuple[int, str]]
    manifest_bytes: int = 0
    manifest_sha256: str = ""

    def bytes_of(self, rels) -> int:
        """What fetching the listed files ``rels`` (and the manifest) reads from S3: each
        fetch is held to its listed size, so this is exact once they are fetched."""
        return self.manifest_bytes + sum(self.files[rel][0] for rel in rels)

    def fetch(self, rel: str, dest: Path) -> Path:
        """Fetch the listed file ``rel`` to ``dest``; a file that is not what the manifest
        says is removed and refused by name."""
        size, sha256 = self.files[rel]
        where = f"artifact '{self.artifact}' at {self.uri}"
        try:
            storage.download_file(f"{self.uri}/{rel}", dest, resume=False, progress=False,
                                  size=size)
            if sha256_file(dest) != sha256:
                raise StepError(f"{where}: {rel} does not match its sha256 in {MANIFEST}")
        except BaseException:
            dest.unlink(missing_ok=True)
            raise
        return dest


def open_remote(uri: str, artifact: str) -> Remote:
    """The artifact at prefix ``uri`` by its manifest (StepError naming it when absent,
    too large, malformed, of another artifact, or listing a path that leaves the prefix)."""
    where = f"artifact '{artifact}' at {uri}: {MANIFEST}"
    raw = storage.manifest_bytes(uri)
    if raw is None:
        raise StepError(f"{where} is missing (the producing step did not finish)")
    manifest: dict[str, Any] = check_manifest(schemas.parse_json(raw, where), artifact, where)
    files = {}
    for entry in manifest["files"]:
        pure = clean_relative(entry["path"])
        if pure is None or pure.as_posix() != entry["path"]:
            raise StepError(f"{where}: {entry['path']!r} is not a clean relative path")
        files[entry["path"]] = (entry["size"], entry["sha256"])
    return Remote(uri=uri, artifact=artifact, files=files, manifest_bytes=len(raw),
                  manifest_sha256=hashlib.sha256(raw).hexdigest())


class Saver:
    """Artifact ``artifact`` saved at the S3 prefix ``uri`` while the step writes it, one item
    (a case: a few files) at a time: :meth:`save` uploads an item's finished files to
    ``uri/<rel>`` on one background thread (the step's work goes on), records their sizes and
    sha256 for the manifest and removes the local files. :meth:`saved` waits for them all and
    gives the manifest's entries.

    :meth:`paced` hands the step its items so that at most ``ahead`` of them are begun and
    not yet saved: where the upload is slower than the work, the work waits, and the step's
    disk holds at most ``ahead`` items whatever the size of the artifact.

    With ``keep`` the local files stay after their upload, for the step to check them whole
    (the download validates its task against its files); :meth:`let_go` then removes them.

    Used as a context manager: the prefix must be empty on entry (another run's leftovers
    would pass for this one's files); on any error, SIGTERM's included, the queued uploads
    finish and then every object under the prefix is deleted, so nothing partial is left
    there."""

    def __init__(self, uri: str, artifact: str, keep: bool = False):
        storage.parse_uri(uri)
        self.uri, self.artifact, self.keep = uri.rstrip("/"), artifact, keep
        self._room: threading.Semaphore | None = None
        self._ahead = 0
        self._closed = False
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._failed: BaseException | None = None

    def __enter__(self) -> "Saver":
        leftover = storage.list_keys(self.uri)
        if leftover:
            raise StepError(f"output '{self.artifact}' at {self.uri} is not empty (found "
                            f"{leftover[0]}); it is saved by key at a prefix of its own")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"save-{self.artifact}")
        return self

    def paced(self, items: Iterable[T], ahead: int) -> Iterator[T]:
        """``items``, each once fewer than ``ahead`` earlier ones are begun and unsaved (every
        item given out must then be passed to :meth:`save`)."""
        self._room, self._ahead = threading.Semaphore(ahead), ahead
        for item in items:
            self._room.acquire()
            if self._closed:
                return
            yield item

    def save(self, files: Sequence[tuple[Path, str]]) -> None:
        """Queue one item's files, (local path, path in the artifact) each, for upload; an
        earlier upload's error is raised here, so the step stops at its next item."""
        if self._failed is not None:
            raise self._failed
        future = self._pool.submit(self._upload, [(Path(path), rel) for path, rel in files])
        future.add_done_callback(self._done)
        self._pending.append(future)

    def _done(self, future: Future) -> None:
        if self._room is not None:
            self._room.release()
        if not future.cancelled() and future.exception() is not None:
            self._failed = self._failed or future.exception()

    def _upload(self, files: list[tuple[Path, str]]) -> list[dict[str, Any]]:
        entries = []
        for path, rel in files:
            entries.append({"path": rel, "size": path.stat().st_size,
                            "sha256": sha256_file(path)})
            storage.upload_file(path, f"{self.uri}/{rel}")
            if not self.keep:
                path.unlink()
        return entries

    def saved(self) -> list[dict[str, Any]]:
        """The manifest entries of every file saved, once all are uploaded (the first
        upload's error is raised here)."""
        return [entry for future in self._pending for entry in future.result()]

    def discard(self) -> None:
        """Forget every file saved so far, once its upload has ended, and delete them from
        S3: the step publishes them otherwise (kept local files), or saves them again."""
        self.saved()
        storage.delete_prefix(self.uri)
        self._pending.clear()

    def let_go(self, root: Path) -> None:
        """Remove ``root/<path>`` of every file saved (kept until now, ``keep``), once all
        are uploaded: what stays under ``root`` is the rest of the artifact."""
        for entry in self.saved():
            root.joinpath(*PurePosixPath(entry["path"]).parts).unlink()

    def bytes_saved(self) -> int:
        return sum(entry["size"] for entry in self.saved())

    def __exit__(self, kind, exc, tb) -> None:
        self._closed = True                 # a paced() waiting for room (a pool's feeder
        for _ in range(self._ahead):        # thread) stops instead of waiting for ever
            self._room.release()
        self._pool.shutdown(wait=True)      # on error too: then nothing lands after the delete
        if kind is None:
            return
        try:
            storage.delete_prefix(self.uri)
        except StepError as cleanup:     # S3 itself may be the fault: the step's error stands
            print(f"warning: {self.uri} may hold part of '{self.artifact}' (never listed by a "
                  f"manifest): {cleanup}", file=sys.stderr)
