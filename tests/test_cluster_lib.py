"""cluster/lib.sh's host-side helpers, on files of the test's own (no cluster, no root)."""
from __future__ import annotations

import subprocess
from pathlib import Path

LIB = Path(__file__).resolve().parents[1] / "cluster" / "lib.sh"


def restore(saved: Path, root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f'source "{LIB}"; restore_sysctls "$0" "$1"',
                           str(saved), str(root)], capture_output=True, text=True, timeout=30)


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
    done = restore(saved, root)
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
    done = restore(saved, root)
    assert (done.returncode, done.stdout) == (0, "")
    assert (root / "kernel/panic").read_text() == "0\n"
