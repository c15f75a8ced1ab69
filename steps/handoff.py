"""Hand an artifact across a boundary Argo's artifacts do not reach (multi-node training).

    python -m steps.handoff verify --artifact dataset DIR
    python -m steps.handoff fetch  --artifact dataset s3://BUCKET/PREFIX DIR
    python -m steps.handoff push   --artifact model   DIR s3://BUCKET/PREFIX

The Kubeflow job that trains on several nodes is not an Argo pod, so its workers fetch the
``dataset`` from, and rank 0 pushes the ``model`` to, fixed keys under the workflow's name;
Argo container tasks on either side re-enter them as ordinary artifacts. Every direction
checks ``MANIFEST.json`` (sizes and sha256); a failure is one line naming the artifact.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from steps.artifacts import require
from steps.errors import OneLineArgumentParser, run_main


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineArgumentParser(prog="python -m steps.handoff", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    for action, places in (("verify", ["directory"]), ("fetch", ["uri", "directory"]),
                           ("push", ["directory", "uri"])):
        p = sub.add_parser(action, help=f"{action} an artifact")
        p.add_argument("--artifact", required=True,
                       help="artifact name its MANIFEST.json must carry (dataset, model, ...)")
        for place in places:
            p.add_argument(place, help="s3://bucket/prefix" if place == "uri"
                           else "the artifact directory")
    args = parser.parse_args(argv)
    if args.action == "fetch":
        from steps.storage import download_dir
        download_dir(args.uri, args.directory, artifact=args.artifact)
    elif args.action == "push":
        require(args.directory, args.artifact)
        from steps.storage import upload_dir
        upload_dir(args.directory, args.uri)
    manifest = require(args.directory, args.artifact)
    print(f"{args.artifact}: {len(manifest['files'])} files verified", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
