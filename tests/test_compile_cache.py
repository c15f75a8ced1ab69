"""steps.compile_cache: torch.compile's caches saved to a checkpoint store after the first
compiled step and loaded by the next process (an Argo retry: a new pod, empty local caches),
which then compiles from them; a blob that cannot be used is ignored with one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from steps import compile_cache, devices
from steps.checkpoints import CheckpointStore

ROOT = Path(__file__).resolve().parents[1]

# One process of a run: load what the store holds, compile and run a function (the CPU
# backend of Inductor stands in for CUDA's: the cache API is the same), save if it compiled.
_PROCESS = textwrap.dedent("""
    import json, sys
    import torch
    from torch._dynamo.utils import counters
    from steps import compile_cache, devices
    from steps.checkpoints import CheckpointStore

    cache = compile_cache.CompileCache(CheckpointStore(sys.argv[1]),
                                       devices.select_device("cpu"), {"batch": 4})
    restored = cache.load()
    step = torch.compile(lambda x: (x * 2 + 1).relu().sum(), dynamic=False)
    value = float(step(torch.arange(8.0) - 3))
    saved = False if restored else cache.save()
    print(json.dumps({"restored": restored, "saved": saved, "value": value,
                      "load_s": cache.load_s,
                      "hits": counters["inductor"]["fxgraph_cache_hit"],
                      "misses": counters["inductor"]["fxgraph_cache_miss"],
                      "phases": compile_cache.phase_seconds()}))
""")


def _process(store: Path, inductor: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor),
           "TRITON_CACHE_DIR": str(inductor / "triton")}
    done = subprocess.run([sys.executable, "-c", _PROCESS, str(store)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"stderr": done.stderr}


@pytest.mark.slow   # two processes that compile on the CPU
def test_a_retry_in_a_new_pod_compiles_from_the_saved_cache(tmp_path):
    store = tmp_path / "checkpoints"
    cold = _process(store, tmp_path / "pod-1")
    assert cold["saved"] and not cold["restored"] and cold["misses"] >= 1
    blobs = list(store.glob(f"{compile_cache.PREFIX}*.bin"))
    assert len(blobs) == 1 and blobs[0].stat().st_size > 0
    retry = _process(store, tmp_path / "pod-2")          # empty local caches
    assert retry["restored"] and retry["hits"] >= 1 and retry["misses"] == 0
    assert 0 < retry["load_s"] < 60     # timed: a retry's first step counts it (issue 36)
    assert retry["value"] == cold["value"] == 25.0
    assert "compile cache" in retry["stderr"] and "loaded" in retry["stderr"]
    # the compilation's phases, as train logs them after its first step
    assert {"trace+compile", "tracing", "forward"} <= set(cold["phases"])
    assert cold["phases"]["trace+compile"] >= cold["phases"]["forward"] > 0


def test_a_blob_that_cannot_be_used_is_ignored_with_one_line(tmp_path, capsys, monkeypatch):
    store = CheckpointStore(str(tmp_path / "ck"))
    cache = compile_cache.CompileCache(store, devices.select_device("cpu"), {"batch": 4})
    assert cache.load() is False and capsys.readouterr().err == ""      # none yet
    store.write_bytes(cache.name, b"not a cache")
    assert cache.load() is False and not cache.restored
    err = capsys.readouterr().err
    assert err.startswith(f"train: compile cache {cache.name} not used (") and \
        err.endswith("); compiling\n") and err.count("\n") == 1
    monkeypatch.setattr(compile_cache, "MAX_BYTES", 4)
    assert cache.load() is False
    assert "more than the 4 allowed" in capsys.readouterr().err


def test_the_cache_key_names_what_the_kernels_depend_on():
    info = devices.select_device("cpu")
    key = compile_cache.cache_key(info, {"batch": 64, "mode": "reduce-overhead"})
    assert len(key) == 16 and key == compile_cache.cache_key(
        info, {"mode": "reduce-overhead", "batch": 64})
    assert key != compile_cache.cache_key(info, {"batch": 128, "mode": "reduce-overhead"})
    assert key != compile_cache.cache_key(info, {"batch": 64, "mode": "default"})


def test_checkpoint_store_reads_are_bounded_before_reading(tmp_path):
    store = CheckpointStore(str(tmp_path / "ck"))
    store.write_bytes("blob", b"x" * 100)
    assert store.read_bytes("blob", limit=100) == b"x" * 100
    with pytest.raises(Exception, match="100 bytes, more than the 99 allowed"):
        store.read_bytes("blob", limit=99)
    assert store.read_bytes("absent", limit=1) is None
