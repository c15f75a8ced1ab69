"""The pipeline's command line: render, lint, submit, publish, run --local.

``python workflows/unet.py <command>``, ``unet-pipeline <command>`` (installed) and
``python -m workflows.cli <command>`` are the same program.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from steps.errors import OneLineArgumentParser, StepError, run_main
from workflows.argo import ArgoServer
from workflows.config import DEFAULT_CONFIG, Config, load_config
from workflows.lint import CHECKS, lint
from workflows.unet import GOLDEN, build, render

# nnU-Net's five folds side by side, each evaluated, pooled and ensembled (workflows.unet)
FOLDS = ["pipeline.folds=[0,1,2,3,4]",
         "pipeline.stages=[download,preprocess,train,convert,quantize,evaluate]"]
GOLDEN_FILES = {
    "unet-workflow.yaml": ("workflow", []),
    "unet-workflowtemplate.yaml": ("template", []),
    "unet-workflow-multinode.yaml": ("workflow", ["resources.train.nodes=2"]),
    "unet-workflow-folds.yaml": ("workflow", FOLDS),
}


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=str(DEFAULT_CONFIG),
                        help="pipeline config file (default: config/pipeline.yaml)")
    common.add_argument("--profile", default=None,
                        help="named profile from the config's 'profiles' section")
    common.add_argument("-p", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="override a config key, e.g. -p train.max_epochs=5 (repeatable)")
    return common


def parser() -> argparse.ArgumentParser:
    common = _common()
    top = OneLineArgumentParser(prog="python workflows/unet.py",
                                description="Brain-tumour U-Net pipeline on Argo Workflows.")
    sub = top.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", parents=[common], help="print the compiled YAML")
    r.add_argument("--kind", choices=("workflow", "template"), default="workflow")
    r.add_argument("-o", "--output", help="write to FILE instead of stdout")
    r.add_argument("--golden", action="store_true",
                   help="regenerate workflows/golden/*.yaml from the base config")
    lint = sub.add_parser("lint", parents=[common],
                          help="round-trip, Argo schema and project rules for workflow and "
                               "template")
    lint.add_argument("--strict", action="store_true",
                      help="a check that could not run (its schema or CRD file is absent) "
                           "fails lint instead of being reported as skipped")
    s = sub.add_parser("submit", parents=[common], help="create a Workflow on the Argo Server")
    s.add_argument("--from-template", action="store_true",
                   help="submit from the published WorkflowTemplate with this config's "
                        "parameters")
    s.add_argument("--watch", action="store_true", help="follow node status to the end")
    s.add_argument("--poll", type=float, default=5.0, help="seconds between status polls")
    s.add_argument("--timeout", type=float, default=None, help="give up watching after S s")
    sub.add_parser("publish", parents=[common],
                   help="create or update the WorkflowTemplate on the Argo Server")
    run = sub.add_parser("run", parents=[common], help="run the compiled Workflow locally")
    run.add_argument("--local", action="store_true", required=True,
                     help="run on this machine (the only mode)")
    run.add_argument("--executor", choices=("subprocess", "podman", "docker"),
                     default="subprocess",
                     help="subprocess: each step in this Python environment; podman/docker: "
                          "each step in its image, as its pod runs on a cluster")
    run.add_argument("--output-dir", default="outputs", help="where final outputs are copied")
    run.add_argument("--run-dir", default=".unet-local",
                     help="per-run files and the embedded S3 server's data")
    return top


def _config(args) -> Config:
    return load_config(args.config, args.profile, args.overrides,
                       local=args.command == "run")


def _write(path: Path, text: str, flag: str) -> None:
    try:
        path.write_text(text)
    except OSError as exc:
        raise StepError(f"{flag} {path}: cannot write it ({exc.strerror or exc})") from None


def cmd_render(args) -> int:
    if args.golden:
        GOLDEN.mkdir(exist_ok=True)
        for name, (kind, overrides) in GOLDEN_FILES.items():
            cfg = load_config(args.config, None, overrides)
            _write(GOLDEN / name, render(cfg, kind), "--golden")
            print(f"wrote {GOLDEN / name}", file=sys.stderr)
        return 0
    text = render(_config(args), args.kind)
    if args.output:
        _write(Path(args.output), text, "-o")
    else:
        sys.stdout.write(text)
    return 0


def cmd_lint(args) -> int:
    """Each kind: its problems, then ``ok (checks run)`` and ``skipped: ...`` naming every
    check that did not run and why. Under ``--strict`` a skipped check fails."""
    cfg = _config(args)
    failed = False
    for kind in ("workflow", "template"):
        problems, notes = lint(build(cfg, kind).to_dict())
        for line in problems:
            print(f"{kind}: {line}")
        skipped = {line.split(":")[0] for line in notes}
        if not problems and not (args.strict and notes):
            print(f"{kind}: ok ({', '.join(c for c in CHECKS if c not in skipped)})")
        for line in notes:
            print(f"{kind}: {'error: ' if args.strict else ''}{line}")
        failed |= bool(problems) or (args.strict and bool(notes))
    return 1 if failed else 0


def _parameters(doc: dict) -> list[str]:
    return [f"{p['name']}={p.get('value', '')}" for p in doc["spec"]["arguments"]["parameters"]]


def cmd_submit(args) -> int:
    cfg = _config(args)
    server = ArgoServer.from_env()
    if args.from_template:
        doc = build(cfg, "template").to_dict()
        created = server.submit_from_template(doc["metadata"]["name"], _parameters(doc))
    else:
        created = server.create_workflow(build(cfg, "workflow").to_dict())
    name = (created.get("metadata") or {}).get("name")
    if not name:
        raise StepError(f"argo server {server.base_url}: the reply names no workflow")
    print(name)
    print(server.ui_link(name))
    if not args.watch:
        return 0
    phase = server.watch(name, poll=args.poll, timeout=args.timeout)
    print(f"{name}: {phase}")
    return 0 if phase == "Succeeded" else 1


def cmd_publish(args) -> int:
    server = ArgoServer.from_env()
    action, body = server.publish_template(build(_config(args), "template").to_dict())
    name = (body.get("metadata") or {}).get("name", "")
    print(f"{action} WorkflowTemplate {server.namespace}/{name}")
    print(f"{server.base_url}/workflow-templates/{server.namespace}/{name}")
    return 0


def cmd_run(args) -> int:
    # Only here: compiling, linting and submitting never load the emulator (a test checks).
    from emulator.runner import run_workflow
    cfg = _config(args)
    result = run_workflow(build(cfg, "workflow").to_dict(), executor=args.executor,
                          output_dir=Path(args.output_dir).resolve(),
                          run_dir=Path(args.run_dir).resolve(), bucket=cfg.storage.bucket)
    return result.exit_code


COMMANDS = {"render": cmd_render, "lint": cmd_lint, "submit": cmd_submit,
            "publish": cmd_publish, "run": cmd_run}


def _main(argv: Sequence[str] | None) -> int:
    args = parser().parse_args(argv)
    return COMMANDS[args.command](args)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
