"""The versions this project ran on, read from the one place that states them,
``cluster/lib.sh``, and where the Go module cache keeps what those versions published (Argo's
JSON schema, the training operator's CRDs) once ``cluster/build.sh`` has downloaded them."""
from __future__ import annotations

import os
import re
from pathlib import Path

LIB_SH = Path(__file__).resolve().parent.parent / "cluster" / "lib.sh"


def _assignment(name: str, pattern: str, group: int = 1) -> str:
    """LookupError when cluster/lib.sh does not set ``name``, or is not there (an install of
    the package without this repository)."""
    try:
        found = re.search(rf"^{name}={pattern}", LIB_SH.read_text(), re.M)
    except OSError as exc:
        raise LookupError(f"cannot read {LIB_SH}: {exc.strerror}") from None
    if found is None:
        raise LookupError(f"cluster/lib.sh sets no {name}")
    return found.group(group)


def pin(name: str) -> str:
    """A version pinned in cluster/lib.sh as ``NAME="${NAME:-vX.Y.Z}"``."""
    return _assignment(name, rf'"\$\{{{name}:-(v[0-9.]+)\}}"')


def setting(name: str) -> str:
    """A plain setting of cluster/lib.sh, ``NAME=value`` or ``NAME="value"``, as the shell reads
    it (the quotes are not the value's)."""
    return _assignment(name, r'("?)([^"\s]+)\1(?:\s+#.*)?$', group=2)


def module_file(module: str, version: str, path: str) -> Path:
    """``path`` inside ``module@version`` in the Go module cache (``go env GOMODCACHE``:
    $GOMODCACHE, else $GOPATH/pkg/mod, else ~/go/pkg/mod); it may not exist. The cache spells
    an upper-case letter as ``!`` and its lower case; the modules used here have none."""
    cache = os.environ.get("GOMODCACHE") or str(
        Path(os.environ.get("GOPATH") or Path.home() / "go").expanduser() / "pkg" / "mod")
    return Path(cache) / f"{module}@{version}" / path
