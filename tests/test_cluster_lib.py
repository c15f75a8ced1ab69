"""cluster/'s host-side helpers, without a cluster: lib.sh's on files of the test's own,
forward.py in front of a stand-in kubectl, and the suite's pruning of the logs it keeps."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from real_cluster import KEPT_TIME, prune_kept_logs

LIB = Path(__file__).resolve().parents[1] / "cluster" / "lib.sh"


def lib(function: str, *args: Path, state: Path | None = None) -> subprocess.CompletedProcess:
    """lib.sh's ``function`` called with ``args`` (the cluster's state folder ``state``)."""
    env = {**os.environ, **({"UNET_CLUSTER_STATE": str(state)} if state else {})}
    return subprocess.run(["bash", "-c", f'source "{LIB}"; {function} "$@"', "lib",
                           *map(str, args)], capture_output=True, text=True, timeout=30, env=env)


def test_restore_sysctls_puts_each_value_back_and_says_which_did_not_take(tmp_path):
    """What down.sh does with the kubelet's host sysctls: a value that cannot be written back
    (here a key that is a folder, as a read-only or vanished /proc/sys entry fails) is
    named with what it is now, and the call fails; the others are written."""
    root = tmp_path / "sys"
    (root / "vm").mkdir(parents=True)
    (root / "vm/overcommit_memory").write_text("1\n")
    (root / "kernel/panic_on_oops").mkdir(parents=True)
    saved = tmp_path / "sysctl.saved"
    saved.write_text("vm/overcommit_memory 0\nkernel/panic_on_oops 0\n")
    done = lib("restore_sysctls", saved, root)
    assert done.returncode == 1
    assert done.stdout.splitlines() == [
        "sysctl kernel/panic_on_oops is (unreadable), not 0 as before the cluster"]
    assert (root / "vm/overcommit_memory").read_text() == "0\n"


def test_restore_sysctls_is_silent_when_all_take(tmp_path):
    root = tmp_path / "sys"
    (root / "kernel").mkdir(parents=True)
    (root / "kernel/panic").write_text("10\n")
    saved = tmp_path / "sysctl.saved"
    saved.write_text("kernel/panic 0\n")
    done = lib("restore_sysctls", saved, root)
    assert (done.returncode, done.stdout) == (0, "")
    assert (root / "kernel/panic").read_text() == "0\n"


def test_keep_logs_copies_the_clusters_and_its_pods_logs_out_of_its_state(tmp_path):
    """What down.sh keeps with KEEP_LOGS before it removes the state folder: the cluster's
    logs and the kubelet's pod logs, a link as the file it names; never into the state
    folder itself, nor over a folder that is there."""
    state = tmp_path / "state"
    (state / "logs").mkdir(parents=True)
    (state / "logs/argo-port-forward.log").write_text("forward: listening\n")
    pod = state / "pod-logs/argo_argo-server-0_uid/argo-server"
    pod.mkdir(parents=True)
    (pod / "0.log").write_text("server: watch closed\n")
    (pod / "1.log").symlink_to(pod / "0.log")
    kept = tmp_path / "kept/run-1"
    done = lib("keep_logs", kept, state=state)
    assert done.returncode == 0, done.stderr
    assert (kept / "logs/argo-port-forward.log").read_text() == "forward: listening\n"
    copied = kept / "pod-logs/argo_argo-server-0_uid/argo-server"
    assert not (copied / "1.log").is_symlink()
    assert (copied / "1.log").read_text() == (copied / "0.log").read_text() == \
        "server: watch closed\n"
    for dest, why in ((state / "kept", "is inside"), (state, "is inside"), (kept, "exists")):
        refused = lib("keep_logs", dest, state=state)
        assert refused.returncode == 1 and why in refused.stderr, (dest, refused.stderr)
    assert not (state / "kept").exists()


# ---- cluster/forward.py: the port-forward that outlives kubectl's ----------------------------
# A stand-in kubectl for one connection. Every third connection (its bytes carry its number)
# is not answered the first time a kubectl gets it: that kubectl ends without answering, as one
# that another connection's reset took down while it accepted. The others answer in upper case
# and then end as the real one does when the server resets the stream after the call. Which
# connection fails is the connection's, not the kubectl's: numbering the kubectls (a counter
# file each read and rewrote) let concurrent ones share a number, and a run of failing ones
# could then use up one connection's resends (CI, 2026-11-30: connection 13 got nothing). The
# real one, on the real cluster, is tests/test_cluster.py's 200 calls in a row.
FAKE_KUBECTL = '''#!{python}
import os, socket, sys
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
print(f"Forwarding from 127.0.0.1:{{server.getsockname()[1]}} -> {{sys.argv[-1][1:]}}", flush=True)
conn, _ = server.accept()
data = b""
while not data.endswith(b"\\n") and (chunk := conn.recv(100)):
    data += chunk
number = int(data.split(b"-")[1])
try:    # the first kubectl to get this connection (an atomic claim: O_EXCL)
    os.close(os.open(os.path.join({seen!r}, str(number)), os.O_CREAT | os.O_EXCL))
    first = True
except FileExistsError:
    first = False
if not (first and number % 3 == 1):
    conn.sendall(data.upper())
conn.close()
print("error: lost connection to pod", file=sys.stderr)
sys.exit(1)
'''
RESENT = range(1, 20, 3)      # the connections of the 20 that are not answered the first time


def _running(program: Path) -> list[str]:
    """The processes whose command line runs ``program``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(program).encode() in cmdline.read_bytes():
                found.append(cmdline.parent.name)
        except OSError:
            pass
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ask(port: int, number: int, deadline: float = 30) -> bytes:
    end = time.monotonic() + deadline
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=20) as conn:
                conn.sendall(f"ping-{number}-\n".encode())
                return conn.recv(100)
        except ConnectionRefusedError:   # only until forward.py listens
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


def test_forward_gives_each_connection_a_kubectl_and_resends_an_unanswered_one(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    kubectl = bin_dir / "kubectl"
    (tmp_path / "seen").mkdir()
    kubectl.write_text(FAKE_KUBECTL.format(python=sys.executable, seen=str(tmp_path / "seen")))
    kubectl.chmod(0o755)
    port = _free_port()
    log = tmp_path / "forward.log"
    with log.open("w") as err:
        forward = subprocess.Popen(
            [sys.executable, str(LIB.parent / "forward.py"), f"127.0.0.1:{port}", "2746", "--",
             "-n", "argo", "svc/argo-server"], stderr=err,
            env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    try:
        answers = [_ask(port, n) for n in range(12)]
        with ThreadPoolExecutor(4) as pool:          # connections at once
            answers += list(pool.map(lambda n: _ask(port, n), range(12, 20)))
    finally:
        forward.terminate()
        forward.wait(timeout=30)
    assert answers == [f"PING-{n}-\n".encode() for n in range(20)]   # none refused or lost
    assert not _running(kubectl), "forward.py left a kubectl of its own running"
    said = log.read_text()
    assert said.count("ended before its connection was answered (exit 1: error: lost "
                      "connection to pod); sent again") == len(RESENT), said
    assert "Traceback" not in said and "Task was destroyed" not in said, said


def test_prune_kept_logs_leaves_room_for_one_more_of_the_newest_and_nothing_else_of_ours(tmp_path):
    """Before a failed session keeps its logs, the oldest of the folders earlier ones kept go,
    so that the new one makes the limit; a user's file or folder of another name stays, and so
    does what a link named like ours points to."""
    times = [time.strftime(KEPT_TIME, time.gmtime(1_780_000_000 + 3600 * i)) for i in range(7)]
    for name in times:
        (tmp_path / name / "pods").mkdir(parents=True)
        (tmp_path / name / "pods" / "argo-server.log").write_text("log\n")
    (tmp_path / "notes").mkdir()
    (tmp_path / "20260101T000000Z.txt").write_text("a user's\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "20200101T000000Z").symlink_to(elsewhere)
    removed = prune_kept_logs(tmp_path, limit=5)
    assert [p.name for p in removed] == times[:3]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*times[3:], "notes", "20260101T000000Z.txt", "20200101T000000Z", "elsewhere"])
    assert prune_kept_logs(tmp_path, limit=5) == []
    assert [p.name for p in prune_kept_logs(tmp_path, limit=1)] == times[3:]
    assert elsewhere.is_dir()
