"""``python -m benchmarks {all|NAME...} [--smoke] [--out FILE] [--workdir DIR]``."""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks import common

# name -> module, imported when that benchmark runs, so that running one never needs another's
# dependencies (hera and the emulator for orchestration, monai for loader and train, ...).
BENCHMARKS = {"preprocess": "preprocess", "loader": "loader", "train": "trainstep",
              "handoff": "handoff", "onnx": "onnxrt", "orchestration": "orchestration",
              "growth": "growth", "allocator": "allocator", "precision": "precision",
              "quantize": "quantize", "gpu": "gpu", "quota": "quota",
              "contention": "contention", "scale": "scale", "footprint": "footprint"}
RESULTS = Path(__file__).parent / "results"


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description="Ours vs the anchors' algorithms, same run.")
    parser.add_argument("names", nargs="+", choices=["all", *BENCHMARKS],
                        help="benchmarks to run ('all' = every one, in order)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes: proves the code runs, measures nothing useful")
    parser.add_argument("--out", type=Path, default=None,
                        help="results JSON (default benchmarks/results/<machine>.json; "
                             "with --smoke, nothing is written unless given)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="scratch directory (default: a temporary one, removed after)")
    return parser.parse_args(argv)


def _fmt(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def table(rows: list[dict]) -> str:
    head = ["benchmark", "metric", "ours", "baseline", "ratio", "target", "verdict"]
    lines = [head] + [[r["benchmark"], f"{r['metric']} [{r['unit']}]", _fmt(r["ours"]),
                       _fmt(r["baseline"]), _fmt(r["ratio"]), r["target"] or "-",
                       r["verdict"]] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    names = list(BENCHMARKS) if "all" in args.names else list(dict.fromkeys(args.names))
    info = common.machine()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="unet-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    settings = common.Settings.make(args.smoke, workdir)
    common.INLINE = args.smoke
    report = {"command": "python -m benchmarks " + " ".join(sys.argv[1:] if argv is None
                                                              else argv),
              "machine": info, "smoke": args.smoke, "benchmarks": {}, "rows": []}
    failed = []
    try:
        for name in names:
            print(f"== {name}", file=sys.stderr, flush=True)
            start = time.perf_counter()
            try:
                module = importlib.import_module(f"benchmarks.{BENCHMARKS[name]}")
                result = module.run(settings)
            except Exception as exc:
                traceback.print_exc()
                failed.append(name)
                report["benchmarks"][name] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            rows = [row.to_dict() for row in result["rows"]]
            report["rows"] += rows
            report["benchmarks"][name] = {"seconds": time.perf_counter() - start,
                                          "details": result["details"], "rows": rows}
            print(table(rows), file=sys.stderr, flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    info["load_average_end"] = list(os.getloadavg())
    print(table(report["rows"]))
    out = args.out or (None if args.smoke else RESULTS / f"{common.slug(info)}.json")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    if failed:
        print(f"error: benchmarks failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
