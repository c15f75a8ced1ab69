"""torch.compile's caches kept beside the checkpoints, so a retry or resume does not compile
again.

After the first compiled step, :meth:`CompileCache.save` writes what Inductor and
AOTAutograd produced in this process (``torch.compiler.save_cache_artifacts``: the FX graph,
autograd and Triton kernel caches in one blob) to the checkpoint store as
``compile-cache-<key>.bin``; the next process of the same run calls :meth:`CompileCache.load`
before its first step (``torch.compiler.load_cache_artifacts`` fills the local caches), and
its compilation then finds every graph and kernel cached. Dynamo still traces the code.

``<key>`` digests everything a cached kernel depends on beyond the graph (torch, CUDA and
the card, the network, batch and patch, mode, layout, precision), so a store shared by a
changed run finds no file rather than a wrong one; torch's own cache keys check the graphs.

The blob holds generated code that the process will run, like the image's own: it is read
only from ``--checkpoint-uri``, the run's own store (never from ``--resume-from``, another
run's), with a size bound, and a blob that cannot be loaded is ignored with a line saying
so: the run compiles as if it were absent.
"""
from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from typing import Any

import torch

from steps.errors import StepError

PREFIX = "compile-cache-"
MAX_BYTES = 512 * 2 ** 20     # a blob for the anchors' network is a few MiB


def cache_key(info, settings: dict[str, Any]) -> str:
    """16 hex digits over the software, the card and ``settings``."""
    card = torch.cuda.get_device_name(info.device) if info.kind == "cuda" else info.kind
    facts = {"torch": torch.__version__, "cuda": torch.version.cuda, "card": card,
             "precision": info.precision, "channels_last": info.channels_last, **settings}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


class CompileCache:
    """The compile cache of one run in its checkpoint ``store``."""

    def __init__(self, store, info, settings: dict[str, Any]):
        self.store = store
        self.name = f"{PREFIX}{cache_key(info, settings)}.bin"
        self.restored = False
        self.saved = False
        self.load_s = 0.0             # reading the blob and filling the local caches

    def load(self) -> bool:
        """Fill torch's local caches from the store's blob; whether one was used."""
        started = time.monotonic()
        try:
            return self._load()
        finally:
            self.load_s = time.monotonic() - started

    def _load(self) -> bool:
        try:
            data = self.store.read_bytes(self.name, limit=MAX_BYTES)
        except StepError as exc:
            return self._ignored(str(exc))
        if data is None:
            return False
        quiet = logging.getLogger("torch.compiler._cache")   # it logs a traceback for a bad blob
        was, quiet.disabled = quiet.disabled, True
        try:
            info = torch.compiler.load_cache_artifacts(data)
        except Exception as exc:  # noqa: BLE001 - a blob torch cannot read is only unused
            return self._ignored(f"{type(exc).__name__}: {str(exc)[:200]}")
        finally:
            quiet.disabled = was
        if info is None:
            return self._ignored("torch cannot read it")
        self.restored = True
        print(f"train: compile cache {self.store.uri}/{self.name} loaded ({len(data)} bytes)",
              file=sys.stderr)
        return True

    def save(self) -> bool:
        """Write what this process compiled so far; whether there was anything."""
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None or not artifacts[0] or len(artifacts[0]) > MAX_BYTES:
            return False
        self.store.write_bytes(self.name, artifacts[0])
        self.saved = True
        return True

    def _ignored(self, why: str) -> bool:
        print(f"train: compile cache {self.name} not used ({why}); compiling",
              file=sys.stderr)
        return False


# Dynamo's timers (``dynamo_timed`` in torch/_dynamo/utils.py) for the phases of a first
# compiled step, in the order they run; nested: tracing and the forward's compilation sit
# inside "trace+compile", Triton's wait inside both compilations.
PHASES = {"_compile.compile_inner": "trace+compile", "bytecode_tracing": "tracing",
          "create_aot_dispatcher_function": "aot", "compile_fx.<locals>.fw_compiler_base":
          "forward", "compile_fx.<locals>.bw_compiler": "backward",
          "async_compile.wait": "triton wait"}


def phase_seconds() -> dict[str, float]:
    """Seconds this process spent in each of :data:`PHASES` so far (absent: not run)."""
    from torch._dynamo.utils import compile_times  # loaded by torch.compile, not at import

    names, values = compile_times(repr="csv", aggregate=True)
    seconds = dict(zip(names, values))
    return {label: round(float(seconds[name]), 1) for name, label in PHASES.items()
            if name in seconds}
