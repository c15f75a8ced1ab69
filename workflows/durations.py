"""Durations as Argo and Kubernetes write them (Go's ``time.ParseDuration``: ``30s``,
``1h30m``, ``500ms``), or a plain number of seconds: the one parser of the compiler
(``workflows.config``, ``workflows.pod_rules``) and the emulator (``emulator.spec``)."""
from __future__ import annotations

import re
from typing import Any

_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}


def seconds(value: Any) -> float:
    """``value`` in seconds; ValueError naming it when it is not a duration."""
    text = str(value).strip()
    try:
        return float(text)
    except ValueError:
        pass
    parts = _PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"{value!r} is not a duration (e.g. 30s, 10m, 720h)")
    return sum(float(n) * _UNIT_S[u] for n, u in parts)
