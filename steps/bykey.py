"""An input artifact read by key from S3, file by file, instead of copied whole into the pod.

Argo's executor copies a whole input artifact into the pod before the step starts (v4.0.5
``workflow/artifacts/s3/s3.go``: ``GetDirectory`` fetches every object under the key). A step
that reads only part of an artifact, or one part at a time, can instead take the artifact's
S3 prefix (``s3://BUCKET/PREFIX``, where the producing step's output was saved): ``open_remote``
reads its ``MANIFEST.json`` (held to ``max_json_bytes`` and checked as a local manifest is),
and ``Remote.fetch`` brings one listed file into a folder of the step's own, checked against
the manifest's size before it streams and its sha256 after. So the pod holds what the step
is working on, not the artifact.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steps import limits, schemas, storage
from steps.artifacts import MANIFEST, check_manifest, clean_relative, sha256_file
from steps.errors import StepError

SCHEME = "s3://"


# "<n> bytes of <artifact> fetched by key": how a step that read an input by key says what it
# read (in its last line); the scale benchmarks count it as the step's S3 reads.
FETCHED = re.compile(r"(\d+) bytes of ([\w-]+) fetched by key")


def fetched_note(remote: "Remote", rels) -> str:
    """The words of :data:`FETCHED` for the files ``rels`` fetched from ``remote``."""
    return f"{remote.bytes_of(rels)} bytes of {remote.artifact} fetched by key"


def fetched_bytes(log: str) -> dict[str, int]:
    """Artifact -> the bytes a step's log says it fetched by key."""
    return {m.group(2): int(m.group(1)) for m in FETCHED.finditer(log)}


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
    storage.parse_uri(uri)
    where = f"artifact '{artifact}' at {uri}: {MANIFEST}"
    if not storage.exists(f"{uri}/{MANIFEST}"):
        raise StepError(f"{where} is missing (the producing step did not finish)")
    raw = storage.get_bytes(f"{uri}/{MANIFEST}", limit=limits.get("max_json_bytes"))
    manifest: dict[str, Any] = check_manifest(schemas.parse_json(raw, where), artifact, where)
    files = {}
    for entry in manifest["files"]:
        pure = clean_relative(entry["path"])
        if pure is None or pure.as_posix() != entry["path"]:
            raise StepError(f"{where}: {entry['path']!r} is not a clean relative path")
        files[entry["path"]] = (entry["size"], entry["sha256"])
    return Remote(uri=uri, artifact=artifact, files=files, manifest_bytes=len(raw))
