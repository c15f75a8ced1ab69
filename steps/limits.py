"""The size limits that every way data enters is held to: one table, read at call time.

Each limit is a named setting with a default sized for the real dataset (MSD Task01 is a
7.1 GiB tar of 1 241 files; its largest volume inflates to 142 MiB) and an environment
variable that overrides it (``UNET_MAX_<NAME>``; on a cluster, ``extra_env`` in the pipeline
config). A value over a limit is refused before anything is allocated or written, with one
line that names the input, the value, the limit and how to raise it.

The same home reads what the process really has, from its cgroup (v1 and v2), affinity mask
and overrides: :func:`memory_bytes` for the memory limits, :func:`cpu_count` for every thread
pool and worker count (``os.cpu_count()`` is the node's cores, not the pod's share).
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import os
import platform
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

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
    Limit("max_json_bytes", 64 * MiB, "bytes",
          "one JSON metadata file (dataset.json, MANIFEST.json, model-card.json)"),
    # The anchors' network (32 filters, 6 levels) checkpoints with its AdamW state in about
    # 240 MiB; the largest network the checkpoint schema accepts in about 1.1 GiB.
    Limit("max_checkpoint_bytes", 4 * GiB, "bytes",
          "one checkpoint (train's ckpt-*.pt and best-epoch*.pt, convert's best.pt), by its "
          "file size or S3 ContentLength before it is read"),
    Limit("max_tar_header_bytes", 1 * MiB, "bytes",
          "one metadata block of a tar archive (a PAX header, a GNU long name), which is "
          "read whole into memory"),
    Limit("http_budget_seconds", 6 * 3600, "seconds",
          "one http(s) download from its first request, retries and waits included"),
    Limit("http_stall_seconds", 60, "seconds",
          "the window in which an http(s) download must receive http_window_bytes; a body "
          "that trickles slower is a stalled attempt, retried"),
    Limit("http_window_bytes", 64 * KiB, "bytes",
          "what an http(s) download must receive in every http_stall_seconds"),
    Limit("max_inference_seconds", 600, "seconds",
          "one onnxruntime call on a batch of slices (predict, convert's parity, quantize's "
          "gate); a model that runs longer is stopped"),
    Limit("max_memory_fraction", 80, "% of memory",
          "share of the step's memory that one planned allocation (a training batch, a "
          "synthetic volume) may take"),
)}


def get(name: str) -> int:
    """The limit's value: ``UNET_<NAME>`` when set (a positive integer), else its default."""
    limit = LIMITS[name]
    value = env_int(limit.env, minimum=1)
    return limit.default if value is None else value


def env_int(env: str, minimum: int) -> int | None:
    """The integer in the environment variable ``env`` (None when unset or empty); anything
    else, or a value below ``minimum``, is a one-line StepError naming it."""
    raw = os.environ.get(env, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise StepError(f"{env}={raw!r} is not an integer") from None
    if value < minimum:
        raise StepError(f"{env}={value} must be at least {minimum}")
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


# ------------------------------------------------------------------ the cgroup's share

CPUS_ENV = "UNET_CPUS"   # the templates set it from the pod's CPU request (downward API)


def _unescape(field: str) -> str:
    """A /proc/self/mountinfo path field: spaces, tabs, newlines and backslashes come octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def cgroup_dirs(controller: str, root: Path = Path("/")) -> Iterator[Path]:
    """The directories of this process's cgroup for ``controller`` ("cpu", "memory"), then
    each ancestor up to the mount: a limit set on any of them applies. Both cgroup v1 (one
    mount per controller) and v2 (one ``cgroup2`` mount) are read, so a hybrid host gives
    both; inside a container the mount's root is the container's own cgroup. ``root``
    prefixes /proc and the mount points (a fake tree in tests)."""
    try:
        groups = (root / "proc/self/cgroup").read_text().splitlines()
        mounts = (root / "proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return
    paths = {}                     # "v2" or a v1 controller -> the process's cgroup path
    for line in groups:
        hid, controllers, path = line.split(":", 2)
        for name in (["v2"] if hid == "0" else controllers.split(",")):
            paths[name] = path
    for line in mounts:
        fields = line.split()
        fstype, _source, options = fields[fields.index("-") + 1:][:3]
        if fstype == "cgroup2":
            kind = "v2"
        elif fstype == "cgroup" and controller in options.split(","):
            kind = controller
        else:
            continue
        if kind not in paths:
            continue
        mount_root, point = _unescape(fields[3]), root / _unescape(fields[4]).lstrip("/")
        rel = os.path.relpath(paths[kind], mount_root)
        here = point if rel.startswith("..") else point / rel   # outside the mount: its top
        while True:
            yield here
            if here == point:
                break
            here = here.parent


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cpu_quota(directory: Path) -> float | None:
    """CPUs allowed by one cgroup directory (quota / period), None when it sets none."""
    v2 = _read(directory / "cpu.max")                      # "max 100000" or "150000 100000"
    if v2 is not None:
        quota, _, period = v2.partition(" ")
    else:
        quota = _read(directory / "cpu.cfs_quota_us") or "-1"   # -1: no quota
        period = _read(directory / "cpu.cfs_period_us") or "0"
    if not (quota.isdigit() and period.isdigit()) or int(period) == 0:
        return None
    return int(quota) / int(period)


def _cpus_override() -> int | None:
    """``UNET_CPUS`` as a count; unset, empty or 0 (the downward API's value for a pod
    without a CPU request) is no override."""
    return env_int(CPUS_ENV, minimum=0) or None


def cpu_count(root: Path = Path("/")) -> int:
    """CPUs this process really has, for sizing every thread pool and worker count.

    ``UNET_CPUS`` when set (an explicit override; each step template sets it from its pod's
    CPU request, so a pod without a CPU limit still sizes to its share), else the fewer of
    the CPUs in the affinity mask (cpusets) and the tightest cgroup CPU quota on the path
    to the process's cgroup, rounded up (1.5 CPUs: 2 threads). ``os.cpu_count()`` is the
    node's cores, which on a 96-core node with an 8-CPU limit oversubscribes 12 times.
    """
    override = _cpus_override()
    if override:
        return override
    count = len(os.sched_getaffinity(0))
    quotas = [q for d in cgroup_dirs("cpu", root) if (q := _cpu_quota(d)) is not None]
    if quotas:
        count = min(count, math.ceil(min(quotas)))
    return max(1, count)


def threads(root: Path = Path("/")) -> int:
    """Threads for one compute pool (torch, onnxruntime, OpenVINO): ``OMP_NUM_THREADS`` when
    set (a parent, e.g. the DDP launcher, gives each child its share), else
    :func:`cpu_count`."""
    raw = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else cpu_count(root)


def set_threads(count: int | None = None) -> int:
    """Size this process's compute threads to ``count`` and return it; by default to
    :func:`threads`, or fewer where other work keeps this process's CPUs busy
    (:class:`FairThreads`, measured over a short window; said on stderr). ``OMP_NUM_THREADS``
    is exported: torch reads it at its first import, and child processes (spawned workers,
    the DDP launcher's, convert's clean load) inherit it. Where torch is imported already its
    pools are set now; it is not imported here, since download runs without it."""
    global _fair
    if count is None:
        _fair = FairThreads(threads())
        count = _fair.start()
    _apply(count)
    return count


def retune_threads() -> None:
    """Follow the free CPUs during long work (train's loop calls it every step; it measures
    at most every RETUNE_EVERY_S): the pools of :func:`set_threads` resized when other work
    came or went."""
    count = _fair.retune() if _fair is not None else None
    if count is not None:
        _apply(count)


def _apply(count: int) -> None:
    os.environ["OMP_NUM_THREADS"] = str(count)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(count)
        with contextlib.suppress(RuntimeError):   # fixed once inter-op work has started
            torch.set_num_interop_threads(count)


# ---------------------------------------------------------------- the CPUs others keep busy
# Threads of one pool meet at a barrier after every parallel operator; a thread that waits
# there spins (OpenMP's active wait: libgomp's GOMP_SPINCOUNT, onnxruntime's spinning pool)
# while the thread it waits for is descheduled by a neighbour's process. On 2 cores beside one
# busy process, two torch threads trained at about 1 % of their idle rate, burning a whole
# CPU in the spin; one thread kept 64 % (benchmarks/contention.py). So a pool is sized to the
# CPUs that are free, not only to the CPUs the process may use.
ADAPT_ENV = "UNET_ADAPT_THREADS"      # "0": size pools from cpu_count() / OMP_NUM_THREADS only
START_WINDOW_S = 0.25                 # the first measurement: from this module's import (the
                                      # step's own imports, usually longer), at least this
RETUNE_EVERY_S = 2.0                  # then at most this often, over the time since the last
TAKEN = 0.75                          # a CPU counts as taken when other work keeps it this busy
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


PROC_STAT = Path("/proc/stat")


def busy_ticks(cpus: set[int], stat: Path = PROC_STAT) -> int | None:
    """Clock ticks that ``cpus`` spent busy (user, nice, system, irq, softirq, steal) since
    boot, from ``stat`` (/proc/stat); None where it cannot be read, a ``cpuN`` line is not the
    kernel's (fewer than 8 counters, a field that is not a count: a container runtime's
    emulated /proc may write anything) or one of ``cpus`` has no line. Nothing is measured
    then, and the pools keep their ceiling."""
    try:
        lines = stat.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    total, seen = 0, set()
    for line in lines[1:]:
        name, *fields = line.split() or [""]
        if not name.startswith("cpu"):
            break
        if not (name[3:].isdigit() and len(fields) >= 8 and all(f.isdigit() for f in fields[:8])):
            return None
        if int(name[3:]) in cpus:
            seen.add(int(name[3:]))
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
            total += user + nice + system + irq + softirq + steal
    return total if seen == cpus else None


def own_ticks() -> int:
    """Clock ticks of CPU this process (all its threads) and its children have used: the
    children that have ended and been waited for (``os.times``' children fields: a finished
    pool worker's time is still this step's), and the live ones (loader and pool workers)
    from /proc."""
    times = os.times()
    total = round((times.user + times.system + times.children_user + times.children_system)
                  * _TICK)
    for children in Path("/proc/self/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            for pid in children.read_text().split():
                stat = Path(f"/proc/{pid}/stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
                total += int(fields[11]) + int(fields[12])   # utime, stime
    return total


_fair: "FairThreads | None" = None     # set_threads' measurement, which retune_threads goes on


def adapting() -> bool:
    """Whether pools follow the free CPUs (the default); ``UNET_ADAPT_THREADS=0`` keeps them
    at their ceiling, which a run must for bitwise reproducible results (a thread count
    changes the order of float sums)."""
    return os.environ.get(ADAPT_ENV, "1") != "0"


def _sample(cpus: set[int]) -> tuple[float, int, int] | None:
    """(now, busy ticks of ``cpus``, own ticks); None where /proc/stat cannot be read."""
    busy = busy_ticks(cpus)
    return None if busy is None else (time.monotonic(), busy, own_ticks())


class FairThreads:
    """This process's compute threads, kept at the CPUs it can really use: at most
    ``ceiling`` (its share: :func:`threads`), and no more than the CPUs of its affinity mask
    that other work leaves free, that work measured as the CPUs' busy time (/proc/stat, the
    whole machine's, also in a container) less this process's own and its children's."""

    def __init__(self, ceiling: int):
        self.ceiling, self.count = ceiling, ceiling
        self.cpus = os.sched_getaffinity(0)
        self.enabled = adapting() and ceiling > 1
        self._mark = None
        if self.enabled:
            imported = _IMPORTED if self.cpus == _IMPORTED_CPUS else None
            self._mark = imported or _sample(self.cpus)

    def others(self) -> float | None:
        """CPUs' worth of other work since the last measurement (None: not measured; only
        called while enabled)."""
        then, now = self._mark, _sample(self.cpus)
        if then is None or now is None or now[0] <= then[0]:
            return None
        self._mark = now
        ticks = (now[1] - then[1]) - (now[2] - then[2])
        return max(0.0, ticks / _TICK / (now[0] - then[0]))

    def fair(self, others: float) -> int:
        """The threads for ``others`` CPUs' worth of other work: the CPUs it does not take
        (a CPU counts as taken from TAKEN busy), within 1 and the ceiling."""
        taken = int(others + (1 - TAKEN))
        return max(1, min(self.ceiling, len(self.cpus) - taken))

    def start(self) -> int:
        """The count to start with, measured since this module's import (at least
        START_WINDOW_S), said on stderr."""
        if self.enabled:
            if self._mark is not None:
                time.sleep(max(0.0, START_WINDOW_S - (time.monotonic() - self._mark[0])))
            others = self.others()
            self.count = self.ceiling if others is None else self.fair(others)
            self._say(others)
        return self.count

    def retune(self) -> int | None:
        """The new count when it should change, at most every RETUNE_EVERY_S (call it as
        often as you like); None otherwise."""
        if not self.enabled or self._mark is None or \
                time.monotonic() - self._mark[0] < RETUNE_EVERY_S:
            return None
        others = self.others()
        count = self.count if others is None else self.fair(others)
        if count == self.count:
            return None
        self.count = count
        self._say(others)
        return count

    def _say(self, others: float | None) -> None:
        busy = "not measured" if others is None else f"{others:.1f} CPU busy with other work"
        print(f"threads: {self.count} of {self.ceiling} ({busy} on {len(self.cpus)} CPU(s); "
              f"{ADAPT_ENV}=0 keeps {self.ceiling})", file=sys.stderr)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), for figures that depend on it (speeds)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_bytes(root: Path = Path("/")) -> int:
    """Memory this process may use: the tightest cgroup limit on its cgroup's path (v2
    ``memory.max``, v1 ``memory.limit_in_bytes``), else physical RAM."""
    found = []
    for directory in cgroup_dirs("memory", root):
        for name in ("memory.max", "memory.limit_in_bytes"):
            text = _read(directory / name) or ""
            if text.isdigit() and int(text) < 1 << 60:
                found.append(int(text))
    if found:
        return min(found)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover - not a POSIX system
        return 1 << 62


_LIBC = ctypes.CDLL(None)       # the C library the interpreter runs on


def release_freed_memory() -> bool:
    """Hand the C heap's free pages back to the kernel (glibc's ``malloc_trim(0)``): whole-
    volume buffers freed between validation cases of different sizes otherwise stay in the
    process's anonymous memory, which grew with the validation cases (train on the cluster:
    1.70x from 30 to 240 full-size cases). False where the C library has none (musl)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is None:      # pragma: no cover - not glibc
        return False
    trim(0)
    return True


def check_memory(nbytes: int, what: str) -> None:
    """Refuse a planned allocation of ``nbytes`` that would not fit in memory."""
    fraction = get("max_memory_fraction")
    allowed = memory_bytes() * min(fraction, 100) // 100
    if nbytes > allowed:
        raise StepError(f"{what}: needs {_amount(nbytes, 'bytes')}, over the limit "
                        f"max_memory_fraction={fraction}% of {_amount(memory_bytes(), 'bytes')}"
                        f" memory (set {LIMITS['max_memory_fraction'].env} to change it)")


# The first window opens when a step imports this module, so that its own imports (torch,
# onnxruntime: seconds) are the measurement and the step seldom waits for one.
_IMPORTED_CPUS = os.sched_getaffinity(0)
_IMPORTED = _sample(_IMPORTED_CPUS) if adapting() else None
