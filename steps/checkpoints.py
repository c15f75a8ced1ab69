"""Training checkpoints in a local directory or under an S3 prefix, written atomically.

Layout under the checkpoint URI::

    ckpt-<global step, 10 digits>.pt   torch.save of a plain dict (loads with weights_only=True)
    best-epoch<epoch, 4 digits>.pt     best weights so far (the model artifact's best.pt)
    latest                             text: the name of the newest complete ckpt-*.pt

A checkpoint file is complete before ``latest`` names it: locally it is written to a
temporary name, fsynced and renamed; on S3 the object is uploaded (an S3 PUT is all or
nothing) and only then is the ``latest`` object replaced. A crash at any moment therefore
leaves ``latest`` naming a complete checkpoint, or absent.
"""
from __future__ import annotations

import io
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from steps import limits, storage, uris
from steps.errors import StepError

LATEST = "latest"
LATEST_MAX_BYTES = 64          # "ckpt-<10 digits>.pt" and a newline
KEEP = 2
_CKPT = re.compile(r"^ckpt-(\d{10})\.pt$")
_BEST = re.compile(r"^best-epoch\d{4}\.pt$")
# What write_bytes leaves behind when killed before its rename: mkstemp's ".<name>.<8>.tmp"
# for a name this module writes (a checkpoint, a best file, the pointer, a compile cache).
_TEMPORARY = re.compile(r"^\.(ckpt-\d{10}\.pt|best-epoch\d{4}\.pt|latest|"
                        r"compile-cache-[0-9a-f]{16}\.bin)\.[A-Za-z0-9_]{8}\.tmp$")


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:010d}.pt"


def best_name(epoch: int) -> str:
    return f"best-epoch{epoch:04d}.pt"


def _storage():
    return storage


def serialize(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def check_state(expected: dict[str, Any], state: dict[str, Any], where: str) -> None:
    """Refuse a state dict whose names or shapes differ from ``expected`` (the network the
    checkpoint's own config describes), or whose values are not all finite."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    resized = [k for k in sorted(set(expected) & set(state))
               if tuple(expected[k].shape) != tuple(state[k].shape)]
    if resized:
        k = resized[0]
        problem = (f"'{k}' has shape {list(state[k].shape)}, the config needs "
                   f"{list(expected[k].shape)} ({len(resized)} tensors differ)")
    elif missing:
        problem = f"'{missing[0]}' is missing ({len(missing)} missing)"
    elif unexpected:
        problem = f"'{unexpected[0]}' is unexpected ({len(unexpected)} unexpected)"
    else:
        check_finite(state, where)
        return
    raise StepError(f"{where} does not match its model_config: {problem}")


def check_finite(state: dict[str, torch.Tensor], where: str) -> None:
    """Every floating-point tensor of ``state`` finite: a diverged run's weights are NaN/Inf
    and every prediction from them is noise."""
    bad = [name for name, tensor in state.items()
           if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
    if bad:
        raise StepError(f"{where}: {len(bad)} of {len(state)} tensors hold NaN/Inf values "
                        f"(first: '{bad[0]}'); the training diverged")


def deserialize(data: bytes, source: str) -> dict[str, Any]:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling fault is a bad checkpoint
        raise StepError(f"checkpoint {source} cannot be loaded ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''})")


class CheckpointStore:
    """Checkpoints under ``uri`` (``s3://bucket/prefix`` or a local directory).

    A local directory is created by the first write, never by opening or reading the store:
    a store that is only read (train's ``--resume-from``, a refused run's ``--checkpoint-uri``)
    is left as it was, absent included. A path that could never become a directory (a file
    in its place or above it) is refused here, before any work."""

    def __init__(self, uri: str, flag: str = "checkpoint URI"):
        parsed = uris.parse(uri, flag, uris.CHECKPOINT_KINDS)
        self.s3 = parsed.kind == "s3"
        self.flag, self.text = flag, parsed.text
        self.uri = parsed.text.rstrip("/") if self.s3 else str(parsed.path).rstrip("/") or "/"
        if not self.s3:
            place = Path(self.uri)
            while not place.exists() and place != place.parent:
                place = place.parent
            if not place.is_dir():
                self._cannot_create("Not a directory")

    def _cannot_create(self, reason: str) -> None:
        raise StepError(f"{self.flag} {self.text}: cannot create {self.uri} ({reason})")

    def _create(self) -> None:
        """The local directory, made before its first write."""
        try:
            Path(self.uri).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._cannot_create(exc.strerror or str(exc))

    def _join(self, name: str) -> str:
        """The place of the file ``name``: one path segment (names can come from a saved
        checkpoint's ``best_file``, which must not lead out of the store)."""
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise StepError(f"checkpoint store {self.uri}: '{name}' is not a file name in it")
        return f"{self.uri}/{name}"

    # -- primitive object operations -----------------------------------------------------
    def write_bytes(self, name: str, data: bytes) -> None:
        """Write ``name`` completely or not at all."""
        if self.s3:
            _storage().put_bytes(data, self._join(name))
            return
        target = Path(self._join(name))
        self._create()
        fd, tmp_name = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=self.uri)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp_name, target)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        dir_fd = os.open(self.uri, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def read_bytes(self, name: str, limit: int | None = None) -> bytes | None:
        """The file ``name``, or None when absent; one larger than ``limit`` bytes is a
        StepError, found before it is read."""
        if self.s3:
            storage = _storage()
            if not storage.exists(self._join(name)):
                return None
            return storage.get_bytes(self._join(name), limit=limit)
        path = Path(self._join(name))
        if not path.is_file():
            return None
        with path.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if limit is not None and size > limit:
                raise StepError(f"{path} is {size} bytes, more than the {limit} allowed")
            return handle.read()

    def size(self, name: str) -> int | None:
        """The size of ``name`` in bytes (an S3 object's ContentLength), None when absent."""
        if self.s3:
            return _storage().size(self._join(name))
        path = Path(self._join(name))
        return path.stat().st_size if path.is_file() else None

    def names(self) -> list[str]:
        if self.s3:
            keys = _storage().list_keys(self.uri + "/")
            return sorted(str(key).rstrip("/").rsplit("/", 1)[-1] for key in keys)
        if not Path(self.uri).is_dir():         # not created yet: nothing written
            return []
        return sorted(p.name for p in Path(self.uri).iterdir() if p.is_file())

    def delete(self, name: str) -> None:
        if self.s3:
            storage = _storage()
            bucket, key = storage.parse_uri(self._join(name))
            storage.client_for(self.uri).delete_object(Bucket=bucket, Key=key)
        else:
            Path(self._join(name)).unlink(missing_ok=True)

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, state: dict[str, Any], step: int) -> str:
        """Write ``state`` as the checkpoint of global ``step``, then point ``latest`` at it."""
        name = checkpoint_name(step)
        self.write_bytes(name, serialize(state))
        self.write_bytes(LATEST, name.encode())
        self.prune(current=name, keep_best=state.get("best_file"))
        return name

    def latest_name(self) -> str | None:
        data = self.read_bytes(LATEST, limit=LATEST_MAX_BYTES)
        if data is None:
            return None
        name = data.decode("ascii", errors="replace").strip()
        if not _CKPT.match(name):
            raise StepError(f"checkpoint pointer {self._join(LATEST)} names {name[:40]!r}, "
                            "not a checkpoint file")
        return name

    def load_latest(self) -> dict[str, Any] | None:
        """The newest complete checkpoint, or None when there is none."""
        name = self.latest_name()
        if name is None:
            return None
        return self.load(name)

    def load(self, name: str) -> dict[str, Any]:
        """The checkpoint ``name``, its size held to ``max_checkpoint_bytes`` before a byte
        of it is read (the file's size, an S3 object's ContentLength; the read itself stops
        at the limit too)."""
        missing = StepError(f"checkpoint {self._join(name)} is named by "
                            f"{self._join(LATEST)} but missing")
        size = self.size(name)
        if size is None:
            raise missing
        limits.check("max_checkpoint_bytes", size, f"checkpoint {self._join(name)}")
        data = self.read_bytes(name, limit=limits.get("max_checkpoint_bytes"))
        if data is None:
            raise missing
        return deserialize(data, self._join(name))

    def prune(self, current: str | None = None, keep_best: str | None = None) -> None:
        """Keep the newest ``KEEP`` checkpoints, the one ``latest`` names (``current``, even
        when older ones from another run sort after it) and the best file in use; delete
        the rest of what this module writes. Only names of exactly its own patterns are
        touched: a user's file in the same folder stays, whatever it is called."""
        names = self.names()
        others = [n for n in names if _CKPT.match(n) and n != current]
        room = KEEP - 1 if current in names else KEEP
        doomed = others[:max(len(others) - room, 0)]
        doomed += [n for n in names if _BEST.match(n) and n != keep_best]
        # Temporary files of writes killed before their rename (local stores only).
        doomed += [n for n in names if _TEMPORARY.match(n)]
        for name in doomed:
            self.delete(name)
