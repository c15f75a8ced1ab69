"""Hand an artifact across a boundary Argo's artifacts do not reach (multi-node training).

    python -m steps.handoff verify --artifact dataset DIR
    python -m steps.handoff fetch  --artifact dataset s3://BUCKET/PREFIX DIR
    python -m steps.handoff push   --artifact model   DIR s3://BUCKET/PREFIX
    python -m steps.handoff refuse --artifact model   ERROR_FILE s3://BUCKET/PREFIX

The Kubeflow job that trains on several nodes is not an Argo pod, so its workers fetch the
``dataset`` from, and rank 0 pushes the ``model`` to, fixed keys under the workflow's name;
Argo container tasks on either side re-enter them as ordinary artifacts. Every direction
checks ``MANIFEST.json`` (sizes and sha256); a failure is one line naming the artifact.

``refuse`` stores a job's input-error line in place of the artifact (``INPUT_ERROR``, no
manifest); ``verify`` of that folder fails with the line itself and exit 2, so the Argo step
after the job reports the bad input once instead of the job being retried.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from steps.artifacts import require
from steps.errors import MAX_LINE, OneLineArgumentParser, StepError, run_main
from steps.storage import download_dir, put_bytes, upload_dir

REFUSAL = "INPUT_ERROR"


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineArgumentParser(prog="python -m steps.handoff", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    for action, places in (("verify", ["directory"]), ("fetch", ["uri", "directory"]),
                           ("push", ["directory", "uri"]), ("refuse", ["error_file", "uri"])):
        p = sub.add_parser(action, help=f"{action} an artifact")
        p.add_argument("--artifact", required=True,
                       help="artifact name its MANIFEST.json must carry (dataset, model, ...)")
        for place in places:
            p.add_argument(place, help={"uri": "s3://bucket/prefix",
                                        "error_file": "the step's error line"}.get(
                                            place, "the artifact directory"))
    args = parser.parse_args(argv)
    if args.action == "refuse":
        line = Path(args.error_file).read_text(encoding="utf-8").strip()
        put_bytes(line.encode() + b"\n", f"{args.uri.rstrip('/')}/{REFUSAL}")
        print(f"{args.artifact}: refused: {line}", file=sys.stderr)
        return 0
    if args.action == "fetch":
        download_dir(args.uri, args.directory, artifact=args.artifact)
    elif args.action == "push":
        require(args.directory, args.artifact)
        upload_dir(args.directory, args.uri)
    refusal = Path(args.directory, REFUSAL)
    if refusal.is_file():  # the job's verdict on its input, in the step's own words
        with open(refusal, "rb") as handle:   # one error line: no more is ever read
            line = handle.read(4 * MAX_LINE).decode("utf-8", errors="replace").strip()
        raise StepError(line.removeprefix("error: "))
    manifest = require(args.directory, args.artifact)
    print(f"{args.artifact}: {len(manifest['files'])} files verified", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
