"""The size limits that every way data enters is held to: one table, read at call time.

Each limit is a named setting with a default sized for the real dataset (MSD Task01 is a
7.1 GiB tar of 1 241 files; its largest volume inflates to 142 MiB) and an environment
variable that overrides it (``UNET_MAX_<NAME>``; on a cluster, ``extra_env`` in the pipeline
config). A value over a limit is refused before anything is allocated or written, with one
line that names the input, the value, the limit and how to raise it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from steps.errors import StepError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True)
class Limit:
    name: str
    default: int
    unit: str          # "bytes" or a count noun, for the error line
    help: str

    @property
    def env(self) -> str:
        return f"UNET_{self.name.upper()}"


LIMITS = {limit.name: limit for limit in (
    Limit("max_download_bytes", 32 * GiB, "bytes",
          "one downloaded archive (http, https, s3), by Content-Length or while it streams"),
    Limit("max_extract_bytes", 64 * GiB, "bytes",
          "all files of an extracted tar or copied source directory together"),
    Limit("max_member_bytes", 4 * GiB, "bytes",
          "one file of a tar or source directory"),
    Limit("max_members", 20_000, "members",
          "entries of a tar archive (files and directories)"),
    Limit("max_volume_bytes", 1 * GiB, "bytes",
          "one NIfTI volume, header and voxels, as its header declares it decompressed"),
    Limit("max_cases", 5_000, "cases",
          "cases of a dataset.json or a synthetic:// source"),
    Limit("max_memory_fraction", 80, "% of memory",
          "share of the step's memory that one planned allocation (a training batch, a "
          "synthetic volume) may take"),
)}


def get(name: str) -> int:
    """The limit's value: ``UNET_<NAME>`` when set (a positive integer), else its default."""
    limit = LIMITS[name]
    raw = os.environ.get(limit.env, "").strip()
    if not raw:
        return limit.default
    try:
        value = int(raw)
    except ValueError:
        raise StepError(f"{limit.env}={raw!r} is not an integer") from None
    if value < 1:
        raise StepError(f"{limit.env}={value} must be at least 1")
    return value


def _amount(value: int, unit: str) -> str:
    if unit != "bytes":
        return f"{value} {unit}"
    for size, suffix in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if value >= size:
            return f"{value} bytes ({value / size:.3g} {suffix})"
    return f"{value} bytes"


def check(name: str, value: int, what: str) -> None:
    """Raise one StepError line when ``value`` is over the limit ``name``."""
    allowed = get(name)
    if value > allowed:
        limit = LIMITS[name]
        raise StepError(f"{what}: {_amount(value, limit.unit)} is over the limit {name}="
                        f"{allowed} ({limit.help}; set {limit.env} to change it)")


def memory_bytes() -> int:
    """Memory this process may use: the cgroup limit when there is one, else physical RAM."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover - not a POSIX system
        return 1 << 62


def check_memory(nbytes: int, what: str) -> None:
    """Refuse a planned allocation of ``nbytes`` that would not fit in memory."""
    fraction = get("max_memory_fraction")
    allowed = memory_bytes() * min(fraction, 100) // 100
    if nbytes > allowed:
        raise StepError(f"{what}: needs {_amount(nbytes, 'bytes')}, over the limit "
                        f"max_memory_fraction={fraction}% of {_amount(memory_bytes(), 'bytes')}"
                        f" memory (set {LIMITS['max_memory_fraction'].env} to change it)")
