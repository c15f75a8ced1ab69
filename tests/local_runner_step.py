"""A tiny step for the local-runner tests: ``python tests/local_runner_step.py <action> ...``.

produce  --out DIR --text T [--param FILE]   publish DIR (text.txt + MANIFEST.json); FILE=T
consume  --inp DIR --out DIR [--param FILE]  require DIR, publish its text upper-cased
flaky    --marker PATH --out DIR             exit 1 the first time (creates PATH), then produce
fail     --code N                            exit N
secret   --out FILE                          FILE = sha256 of $AWS_SECRET_ACCESS_KEY
count    --counter PATH                      append a line to PATH (counts executions)
sleepy   --marker PATH --code N              exit N the first time (creates PATH), then sleep
env      --text NAME --out FILE              FILE = $NAME, or "<unset>"
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

from steps.artifacts import publish, require


def _produce(out: str, text: str, param: str | None) -> None:
    with publish(out, "text", "local_runner_step", {"text": text}) as stage:
        (stage / "text.txt").write_text(text)
        (stage / "nested").mkdir()
        (stage / "nested" / "model.onnx").write_bytes(text.encode() * 3)
    if param:
        Path(param).parent.mkdir(parents=True, exist_ok=True)
        Path(param).write_text(text + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("action")
    for flag in ("--out", "--inp", "--text", "--param", "--marker", "--counter"):
        parser.add_argument(flag)
    parser.add_argument("--code", type=int, default=1)
    args = parser.parse_args(argv)
    if args.counter:
        with open(args.counter, "a") as handle:
            handle.write("ran\n")
    if args.action == "produce":
        _produce(args.out, args.text, args.param)
    elif args.action == "consume":
        require(args.inp, "text")
        _produce(args.out, (Path(args.inp) / "text.txt").read_text().upper(), args.param)
    elif args.action == "flaky":
        marker = Path(args.marker)
        if not marker.exists():
            marker.write_text("failed once\n")
            print("flaky: failing the first attempt", file=sys.stderr)
            return 1
        _produce(args.out, "second try", None)
    elif args.action == "fail":
        print(f"fail: exiting {args.code}", file=sys.stderr)
        return args.code
    elif args.action == "secret":
        digest = hashlib.sha256(os.environ.get("AWS_SECRET_ACCESS_KEY", "").encode())
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(digest.hexdigest())
    elif args.action == "sleepy":
        marker = Path(args.marker)
        if not marker.exists():
            marker.write_text("failed once\n")
            return args.code
        time.sleep(120)
    elif args.action == "env":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(os.environ.get(args.text, "<unset>"))
    elif args.action != "count":
        print(f"unknown action {args.action}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
