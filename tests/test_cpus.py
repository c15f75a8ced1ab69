"""How many CPUs a step has (``steps.limits.cpu_count``), and what sizes itself by it.

The cgroup cases read a fake tree under ``tmp_path`` (its ``proc/self/cgroup``,
``proc/self/mountinfo`` and cgroup files), passed as the function's ``root``; the affinity
mask is the real one of a child process, or a stand-in where the quota must decide.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from steps import limits, preprocess, train
from steps.errors import StepError
from workflows.config import load_config
from emulator.spec import cpu_field
from workflows.unet import build

REPO = Path(__file__).resolve().parents[1]
POD = "/kubepods/burstable/pod1/ctr"
# This development VM's layout: cgroup v1 controllers, an empty v2 hierarchy beside them.
HYBRID_MOUNTS = [
    "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu",
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory",
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw",
]
HYBRID_GROUPS = f"4:memory:{POD}\n1:cpu:{POD}\n0::{POD}\n"


def fake_root(tmp_path: Path, groups: str, mounts: list[str], files: dict[str, str]) -> Path:
    """A root with /proc/self/{cgroup,mountinfo} and the cgroup files ``files``."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(groups)
    (tmp_path / "proc/self/mountinfo").write_text("\n".join(mounts) + "\n")
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text + "\n")
    return tmp_path


def v1_quota(directory: str, quota: int, period: int = 100000) -> dict[str, str]:
    return {f"{directory}/cpu.cfs_quota_us": str(quota),
            f"{directory}/cpu.cfs_period_us": str(period)}


@pytest.fixture
def many_cores(monkeypatch):
    """A 64-CPU affinity mask and no override, so that the quota decides."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.delenv(limits.CPUS_ENV, raising=False)


# ------------------------------------------------------------------------- cgroup quota

@pytest.mark.parametrize("quota, cpus", [(50000, 1), (150000, 2), (300000, 3)])
def test_v1_quota_of_the_process_cgroup_rounded_up(tmp_path, many_cores, quota, cpus):
    root = fake_root(tmp_path, HYBRID_GROUPS, HYBRID_MOUNTS,
                     v1_quota(f"sys/fs/cgroup/cpu{POD}", quota))
    assert limits.cpu_count(root) == cpus


def test_v1_cpu_and_cpuacct_mounted_together(tmp_path, many_cores):
    """Docker hosts mount the two controllers as one hierarchy, ``cpu,cpuacct``."""
    mounts = ["32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct"]
    root = fake_root(tmp_path, f"3:cpu,cpuacct:{POD}\n", mounts,
                     v1_quota(f"sys/fs/cgroup/cpu,cpuacct{POD}", 250000))
    assert limits.cpu_count(root) == 3


def test_a_tighter_quota_on_a_parent_cgroup_applies(tmp_path, many_cores):
    files = {**v1_quota(f"sys/fs/cgroup/cpu{POD}", -1),
             **v1_quota("sys/fs/cgroup/cpu/kubepods/burstable/pod1", 200000),
             **v1_quota("sys/fs/cgroup/cpu/kubepods", 800000)}
    assert limits.cpu_count(fake_root(tmp_path, HYBRID_GROUPS, HYBRID_MOUNTS, files)) == 2


@pytest.mark.parametrize("text, cpus", [("250000 100000", 3), ("100000 50000", 2),
                                        ("max 100000", 64)])
def test_v2_cpu_max(tmp_path, many_cores, text, cpus):
    mounts = ["30 25 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate"]
    root = fake_root(tmp_path, f"0::{POD}\n", mounts,
                     {f"sys/fs/cgroup{POD}/cpu.max": text})
    assert limits.cpu_count(root) == cpus


def test_inside_a_container_the_mount_is_its_own_cgroup(tmp_path, many_cores):
    """podman/docker mount the container's cgroup at /sys/fs/cgroup/cpu while
    /proc/self/cgroup still names the full path (``podman run --cpus=1`` here)."""
    ctr = "/libpod_parent/libpod-8eb24bab"
    mounts = [f"93 92 0:29 {ctr} /sys/fs/cgroup/cpu ro,nosuid - cgroup cgroup rw,cpu"]
    root = fake_root(tmp_path, f"1:cpu:{ctr}\n0::{ctr}\n", mounts,
                     v1_quota("sys/fs/cgroup/cpu", 100000))
    assert limits.cpu_count(root) == 1


def test_no_quota_and_no_cgroup_files_give_the_affinity_mask(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.delenv(limits.CPUS_ENV, raising=False)
    root = fake_root(tmp_path, HYBRID_GROUPS, HYBRID_MOUNTS,
                     v1_quota(f"sys/fs/cgroup/cpu{POD}", -1))
    assert limits.cpu_count(root) == 3
    assert limits.cpu_count(tmp_path / "nothing-here") == 3


def test_memory_limit_is_read_on_the_process_cgroup_path(tmp_path):
    files = {f"sys/fs/cgroup/memory{POD}/memory.limit_in_bytes": str(3 << 30),
             "sys/fs/cgroup/memory/kubepods/memory.limit_in_bytes": str(2 << 30),
             "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712"}
    root = fake_root(tmp_path, HYBRID_GROUPS, HYBRID_MOUNTS, files)
    assert limits.memory_bytes(root) == 2 << 30


# ------------------------------------------------------------------ affinity, override

def _count_in_child(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items()
             if k not in (limits.CPUS_ENV, "OMP_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**clean, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_affinity_mask_of_a_real_process():
    """A process pinned to one CPU (taskset, a cpuset) counts one, whatever the node has."""
    one = min(os.sched_getaffinity(0))
    code = ("import os; from steps import limits; "
            f"os.sched_setaffinity(0, {{{one}}}); print(limits.cpu_count())")
    assert _count_in_child(code) == "1"


def test_the_override_wins_and_zero_or_empty_is_none(tmp_path, monkeypatch, many_cores):
    root = fake_root(tmp_path, HYBRID_GROUPS, HYBRID_MOUNTS,
                     v1_quota(f"sys/fs/cgroup/cpu{POD}", 100000))
    monkeypatch.setenv(limits.CPUS_ENV, "5")
    assert limits.cpu_count(root) == 5
    for unset in ("0", ""):
        monkeypatch.setenv(limits.CPUS_ENV, unset)
        assert limits.cpu_count(root) == 1
    monkeypatch.setenv(limits.CPUS_ENV, "two")
    with pytest.raises(StepError, match="UNET_CPUS='two' is not an integer"):
        limits.cpu_count(root)


def test_set_threads_sizes_torch_before_and_after_its_import():
    code = ("import torch; from steps import limits; n = limits.set_threads(); "
            "import os; print(n, torch.get_num_threads(), os.environ['OMP_NUM_THREADS'])")
    assert _count_in_child(code, UNET_CPUS="1") == "1 1 1"
    code = ("from steps import limits; limits.set_threads(); import torch; "
            "print(torch.get_num_threads())")
    assert _count_in_child(code, UNET_CPUS="1") == "1"
    code = "from steps import limits; print(limits.threads())"
    assert _count_in_child(code, UNET_CPUS="4", OMP_NUM_THREADS="3") == "3"


# ------------------------------------------------------- the CPUs other work keeps busy

class FakeClock:
    """/proc/stat's busy ticks, this process's own ticks and the monotonic clock, as a test
    sets them (in seconds of one CPU at 100 ticks per second)."""

    def __init__(self, monkeypatch):
        self.now, self.busy, self.own = 0.0, 0.0, 0.0
        monkeypatch.setattr(limits, "_TICK", 100)
        monkeypatch.setattr(limits, "busy_ticks", lambda cpus: round(self.busy * 100))
        monkeypatch.setattr(limits, "own_ticks", lambda: round(self.own * 100))
        monkeypatch.setattr(limits.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(limits.time, "sleep", self.wait)
        monkeypatch.setattr(limits.os, "sched_getaffinity", lambda pid: {0, 1})
        monkeypatch.setattr(limits, "_IMPORTED", None)     # the window opens in the test
        self.others = 0.0     # CPUs' worth of other work while time passes

    def wait(self, seconds: float, ours: float = 0.0) -> None:
        self.now += seconds
        self.busy += (self.others + ours) * seconds
        self.own += ours * seconds


@pytest.fixture
def clock(monkeypatch):
    monkeypatch.delenv(limits.ADAPT_ENV, raising=False)
    return FakeClock(monkeypatch)


@pytest.mark.parametrize("others, threads", [(0.0, 2), (0.3, 2), (0.7, 2), (0.8, 1), (1.0, 1),
                                            (2.0, 1)])
def test_a_pool_leaves_the_cpus_that_other_work_takes(clock, capsys, others, threads):
    """On 2 CPUs, a CPU counts as taken from 0.75 busy; at least one thread."""
    clock.others = others
    assert limits.FairThreads(2).start() == threads
    assert capsys.readouterr().err == (
        f"threads: {threads} of 2 ({others:.1f} CPU busy with other work on 2 CPU(s); "
        "UNET_ADAPT_THREADS=0 keeps 2)\n")


def test_its_own_work_is_not_counted_as_other_work(clock):
    fair = limits.FairThreads(2)
    fair.start()
    clock.wait(3.0, ours=2.0)         # both CPUs busy, all of it this process's
    assert fair.others() == 0.0


def test_the_pool_follows_a_neighbour_that_comes_and_goes(clock, capsys):
    fair = limits.FairThreads(2)
    assert fair.start() == 2
    clock.others = 1.0
    clock.wait(1.0, ours=1.0)
    assert fair.retune() is None, "not before RETUNE_EVERY_S"
    clock.wait(1.5, ours=1.0)
    assert fair.retune() == 1
    clock.wait(2.5, ours=1.0)
    assert fair.retune() is None, "unchanged"
    clock.others = 0.0
    clock.wait(2.5, ours=1.0)
    assert fair.retune() == 2
    said = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[0] for line in said] == ["threads: 2 of 2", "threads: 1 of 2",
                                                      "threads: 2 of 2"]


def test_the_variable_turns_it_off_and_one_thread_needs_nothing(clock, monkeypatch, capsys):
    clock.others = 2.0
    monkeypatch.setenv(limits.ADAPT_ENV, "0")
    assert limits.FairThreads(2).start() == 2
    monkeypatch.delenv(limits.ADAPT_ENV)
    assert limits.FairThreads(1).start() == 1
    assert capsys.readouterr().err == ""


KERNEL_STAT = ("cpu  10 0 10 100 0 0 0 0 0 0\n"
               "cpu0 4 1 2 50 9 1 1 1 0 0\n"
               "cpu1 6 0 8 50 0 0 0 0 0 0\n"
               "intr 123\n")


@pytest.mark.parametrize("text", [
    "cpu  1 2 3\ncpu0 1 2 3\n",                                  # short counters
    "cpu  1 2 3 4 5 6 7 8\ncpu0 1 2 x 4 5 6 7 8\n",              # a non-number
    "cpu  1 2 3 4 5 6 7 8\ncpuX 1 2 3 4 5 6 7 8\n",              # no CPU number
    "cpu  1 2 3 4 5 6 7 8\ncpu0 1 2 3 4 5 6 7 -8\n",             # a negative counter
    "cpu  1 2 3 4 5 6 7 8\n\n",                                  # an empty line
    "",
])
def test_a_proc_stat_that_is_not_the_kernels_measures_nothing(tmp_path, text):
    """An emulated /proc (a container runtime's) may write what it likes: the pools then keep
    their ceiling instead of the step failing."""
    stat = tmp_path / "stat"
    stat.write_text(text)
    assert limits.busy_ticks({0, 1}, stat) is None
    stat.write_bytes(b"\xff\xfe")
    assert limits.busy_ticks({0, 1}, stat) is None


def test_busy_ticks_add_the_busy_counters_of_the_cpus_asked_for(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(KERNEL_STAT)
    assert limits.busy_ticks({0}, stat) == 4 + 1 + 2 + 1 + 1 + 1      # idle, iowait left out
    assert limits.busy_ticks({0, 1}, stat) == 10 + 14
    assert limits.busy_ticks(set(), tmp_path / "missing") is None


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="needs root and unshare(1) to mount over /proc/stat")
def test_a_step_starts_beside_an_odd_proc_stat(tmp_path):
    """The measurement opens when a step imports steps.limits: a /proc/stat it cannot read
    (bind-mounted over the real one in a mount namespace of the test's own) must neither
    fail the import nor size the pools."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3\ncpu0 1 2 3\n")
    code = "from steps import limits; print(limits.set_threads())"
    clean = {k: v for k, v in os.environ.items()
             if k not in (limits.CPUS_ENV, "OMP_NUM_THREADS", limits.ADAPT_ENV)}
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount --bind "$0" /proc/stat && exec "$1" -c "$2"', str(stat), sys.executable,
         code], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**clean, "UNET_CPUS": "2"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2"
    assert "not measured" in done.stderr and "Traceback" not in done.stderr


def test_a_child_that_has_ended_is_still_own_work():
    """A pool worker that finished (and was waited for) used this step's CPU, not other
    work's: its time stays in own_ticks."""
    before = limits.own_ticks()
    subprocess.run([sys.executable, "-c", "import time\nend = time.process_time() + 0.5\n"
                    "while time.process_time() < end: pass"], check=True, timeout=60)
    assert limits.own_ticks() - before >= 0.4 * limits._TICK


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_a_step_beside_a_busy_process_starts_with_the_cpu_it_leaves(tmp_path):
    """Real /proc/stat: a step pinned to two CPUs, one of them kept busy by another process,
    sizes its pool to one thread and says so."""
    first, second = sorted(os.sched_getaffinity(0))[:2]
    spinner = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, "
                                f"{{{first}}})\nwhile True: pass"])
    try:
        code = (f"import os; os.sched_setaffinity(0, {{{first}, {second}}}); "
                "from steps import limits; print(limits.set_threads())")
        clean = {k: v for k, v in os.environ.items()
                 if k not in (limits.CPUS_ENV, "OMP_NUM_THREADS", limits.ADAPT_ENV)}
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                              text=True, timeout=120, env=clean)
    finally:
        spinner.kill()
        spinner.wait()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"
    assert done.stderr.startswith("threads: 1 of 2 (")


# --------------------------------------------------------------- what sizes itself by it

def test_loader_workers_keep_one_cpu_per_rank(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv(limits.CPUS_ENV, "4")
    assert [train.loader_workers(n) for n in (0, 2, 8)] == [0, 2, 3]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert train.loader_workers(8) == 1
    monkeypatch.setenv(limits.CPUS_ENV, "1")
    assert train.loader_workers(2) == 0


def test_preprocess_workers_times_threads_fit_the_cpus(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv(limits.CPUS_ENV, "4")
    assert preprocess.plan_workers(8, 100) == (4, 1)
    assert preprocess.plan_workers(2, 100) == (2, 2)
    assert preprocess.plan_workers(8, 1) == (1, 4)


def test_ddp_ranks_share_the_step_threads(monkeypatch):
    seen = {}

    class Launcher:
        def __init__(self, cmd, env):
            seen.update(env)

        def wait(self):
            return 0

    monkeypatch.setattr(train.subprocess, "Popen", Launcher)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv(limits.CPUS_ENV, "8")
    assert train.relaunch(["--device", "cpu"], 4) == 0
    assert seen["OMP_NUM_THREADS"] == "2"


def test_onnxruntime_sessions_use_the_step_cpus(tmp_path, monkeypatch):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper
    from steps.predict import open_session

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph), tmp_path / "m.onnx")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv(limits.CPUS_ENV, "1")
    assert open_session(tmp_path / "m.onnx").get_session_options().intra_op_num_threads == 1


# ----------------------------------------------------- the templates and the count agree

@pytest.mark.parametrize("profile", [None, "local", "cpu_quick", "cuda_1gpu"])
def test_every_step_container_gets_its_cpu_request_as_the_count(profile):
    """Each step pod requests CPUs (train: limit = request) and gets ``UNET_CPUS`` from
    that request through the downward API, so its threads match its share of the node."""
    doc = build(load_config(None, profile, []), "workflow").to_dict()
    containers = [t for t in doc["spec"]["templates"] if "container" in t]
    assert {t["name"] for t in containers} >= {"download", "preprocess", "train", "convert"}
    for template in containers:
        container = template["container"]
        assert container["resources"]["requests"]["cpu"], template["name"]
        refs = [e["valueFrom"]["resourceFieldRef"] for e in container["env"]
                if e["name"] == limits.CPUS_ENV]
        assert refs == [{"resource": "requests.cpu", "divisor": "1"}], template["name"]


def test_a_literal_override_in_extra_env_replaces_the_request():
    cfg = load_config(None, "local", ["resources.extra_env={UNET_CPUS: '1'}"])
    templates = {t["name"]: t for t in build(cfg, "workflow").to_dict()["spec"]["templates"]}
    env = templates["train"]["container"]["env"]
    assert [e for e in env if e["name"] == limits.CPUS_ENV] == \
        [{"name": limits.CPUS_ENV, "value": "1"}]


@pytest.mark.parametrize("resources, ref, value", [
    ({"requests": {"cpu": "2"}}, {"resource": "requests.cpu", "divisor": "1"}, "2"),
    ({"requests": {"cpu": "500m"}}, {"resource": "requests.cpu", "divisor": "1"}, "1"),
    ({"requests": {"cpu": "1.5"}}, {"resource": "requests.cpu"}, "2"),
    ({"limits": {"cpu": "3"}}, {"resource": "requests.cpu"}, "3"),
    ({"requests": {"cpu": "2"}}, {"resource": "requests.cpu", "divisor": "1m"}, "2000"),
    ({}, {"resource": "requests.cpu"}, "0"),
])
def test_the_local_runner_resolves_the_request_as_kubernetes_does(resources, ref, value):
    assert cpu_field(resources, ref, "where") == value


FRAGMENTED = """
import ctypes, sys
from steps import limits
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
chunks = [libc.malloc(64 << 10) for _ in range(1500)]       # ~94 MiB on the heap
for c in chunks:
    ctypes.memset(c, 1, 64 << 10)
for c in chunks[:-1]:                                       # the last pins the heap's top
    libc.free(c)
before = rss()
print(limits.release_freed_memory(), before - rss())
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "malloc_trim"), reason="not glibc")
def test_freed_heap_memory_goes_back_to_the_kernel():
    """Buffers freed below a live one stay in the process (glibc trims only the heap's top);
    release_freed_memory, which train calls after each validation volume, hands them back."""
    done = subprocess.run([sys.executable, "-c", FRAGMENTED], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    released, dropped = done.stdout.split()
    assert released == "True" and int(dropped) > 80 << 20, done.stdout
