"""Run a compiled Argo Workflow on this machine: the DAG, its artifacts, retries and cache.

What Argo does, and what this does in its place:

- **Names.** ``generateName`` gets a 5-character suffix as Kubernetes adds it. Node names are
  ``<workflow>.<task>`` (with ``(N)`` per attempt under a retryStrategy) and pod names are
  Argo's v2 format ``<workflow>-<template>-<fnv32a(node name)>``.
- **Order.** Tasks run one at a time in a topological order of ``depends``/``dependencies``
  (Argo may start independent tasks together; the results are the same). A task whose
  ``depends`` is false is Omitted, one whose ``when`` is false is Skipped. After a failure
  no new task starts unless the DAG sets ``failFast: false``. The run fails when any node
  fails or errors.
- **A pod.** Each attempt runs as :mod:`emulator.lifecycle` describes (inputs in,
  the step as a process or in its image, outputs out), with artifact keys following the
  artifact repository's keyFormat (:mod:`emulator.transfer`).
- **Retries.** As :mod:`emulator.retries` describes; each attempt is a fresh pod
  directory, and waits are multiplied by ``backoff_scale``.
- **Memoization.** See :mod:`emulator.memo`.
- **Deadlines.** The Workflow's ``activeDeadlineSeconds`` bounds every attempt.
"""
from __future__ import annotations

import os
import re
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Mapping, TextIO

from emulator import memo, pods, transfer
from emulator.dag import Task, order, pod_name, workflow_name
from emulator.errors import LocalRunError
from emulator.expr import eval_depends, eval_when, substitute
from emulator.lifecycle import Lifecycle
from emulator.results import ArtifactRef, ModelLink, NodeResult, RunResult
from emulator.retries import RetryPlan
from emulator.s3target import open_target, process_env
from emulator.spec import check_workflow, template_map
from steps import storage
from steps.errors import StepError

EXECUTORS = ("subprocess", *pods.ENGINES)
ECHO_STDERR = object()   # the default for run_workflow(echo=): sys.stderr at call time
_FROM = re.compile(r"^\{\{\s*tasks\.([\w\-]+)\.outputs\.artifacts\.([\w\-]+)\s*\}\}$")


# ---- the run --------------------------------------------------------------------------------
class LocalRun:
    """One execution of a compiled Workflow; :func:`run_workflow` is the entry point."""

    def __init__(self, workflow: dict, *, executor: str, run_dir: Path,
                 output_dir: Path | None, env: Mapping[str, str] | None,
                 log: Callable[[str], None], bucket: str | None,
                 parameters: Mapping[str, str] | None,
                 secrets: Mapping[str, Mapping[str, str]] | None,
                 configmaps: Mapping[str, Mapping[str, str]] | None,
                 key_format: str, backoff_scale: float, echo: TextIO | None,
                 container: Mapping[str, Any] | None):
        if executor not in EXECUTORS:
            raise LocalRunError(f"executor: {executor!r} is not one of {', '.join(EXECUTORS)}")
        self.notes = check_workflow(workflow, containers=executor != "subprocess")
        self.workflow = workflow
        self.spec = workflow["spec"]
        self.executor = executor
        self.run_dir = Path(run_dir)
        self.output_dir = Path(output_dir) if output_dir else None
        self.env = {**os.environ, **(env or {})}
        self.log = log
        self.bucket = bucket or self.env.get("UNET_ARTIFACT_BUCKET") or storage.DEFAULT_BUCKET
        self.secrets = secrets or {}
        self.configmaps = configmaps or {}
        self.key_format = key_format
        self.backoff_scale = backoff_scale
        self.echo = echo
        self.container = dict(container or {})
        self.engine = pods.Engine(self.container.get("binary", executor)) \
            if executor != "subprocess" else None
        self.name = workflow_name(workflow.get("metadata") or {})
        self.root = self.run_dir / "runs" / self.name
        self.templates = template_map(workflow)
        dag = self.templates[self.spec["entrypoint"]]["dag"]
        self.fail_fast = dag.get("failFast", True)
        where = f"spec.templates[{self.spec['entrypoint']}].dag.tasks"
        self.tasks = {t["name"]: Task(t, self.templates, f"{where}[{t['name']}]")
                      for t in dag.get("tasks") or []}
        self.order = order(self.tasks)
        self.globals = self._global_scope(parameters or {})
        self._static_check()
        self.pods: Lifecycle | None = None     # once the run's S3 is open
        self.nodes: dict[str, NodeResult] = {}
        self._noted: set[str] = set()

    # -- scopes ---------------------------------------------------------------------------
    def _global_scope(self, overrides: Mapping[str, str]) -> dict[str, str]:
        metadata = self.workflow.get("metadata") or {}
        scope = {"workflow.name": self.name, "workflow.uid": str(uuid.uuid4()),
                 "workflow.namespace": metadata.get("namespace") or "default",
                 "workflow.creationTimestamp":
                     datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                 "workflow.serviceAccountName": self.spec.get("serviceAccountName", "")}
        declared = (self.spec.get("arguments") or {}).get("parameters") or []
        names = {p["name"] for p in declared}
        for name in overrides:
            if name not in names:
                raise LocalRunError(f"parameter {name!r}: not a workflow parameter "
                                    f"(known: {', '.join(sorted(names))})")
        for param in declared:
            where = f"spec.arguments.parameters[{param['name']}]"
            value = overrides.get(param["name"], param.get("value", param.get("default")))
            if value is None:
                raise LocalRunError(f"{where}: no value")
            value = str(value)
            if param.get("enum") and value not in [str(v) for v in param["enum"]]:
                raise LocalRunError(f"{where}: {value!r} is not one of {param['enum']}")
            scope[f"workflow.parameters.{param['name']}"] = value
        for key, value in list(scope.items()):  # parameters may refer to workflow.name
            scope[key] = substitute(value, scope, key)
        return scope

    def _static_check(self) -> None:
        """Resolve every field the runner will use with placeholder values, before any run,
        so an unknown variable or a bad expression is refused up front."""
        for task in self.tasks.values():
            if task.depends:
                eval_depends(task.depends, {t: "Succeeded" for t in self.tasks},
                             f"{task.where}.depends")
            scope = dict(self.globals)
            for up in task.ancestors:
                scope.update({f"tasks.{up}.outputs.parameters.{p}": "x"
                              for p in self._declared(up)[0]})
                scope[f"tasks.{up}.status"] = "Succeeded"
            args = task.spec.get("arguments") or {}
            for param in args.get("parameters") or []:
                substitute(param.get("value", ""), scope,
                           f"{task.where}.arguments.parameters[{param['name']}]")
            for art in args.get("artifacts") or []:
                match = _FROM.match(str(art.get("from", "")))
                if "from" in art and not (match and match.group(2) in
                                          self._declared(match.group(1))[1]):
                    raise LocalRunError(f"{task.where}.arguments.artifacts[{art['name']}].from:"
                                        f" {art['from']!r} is not an output artifact of an "
                                        "upstream task")
        for name, template in self.templates.items():
            if "container" in template:
                self._check_template_variables(name, template)

    def _declared(self, task: str) -> tuple[set[str], set[str]]:
        declared = (self.tasks[task].template.get("outputs") or {}) if task in self.tasks else {}
        return ({p["name"] for p in declared.get("parameters") or []},
                {a["name"] for a in declared.get("artifacts") or []})

    def _check_template_variables(self, name: str, template: dict) -> None:
        inputs, outputs = template.get("inputs") or {}, template.get("outputs") or {}
        known = dict.fromkeys(self.globals, "x")
        known.update({f"inputs.parameters.{p['name']}": "x" for p in inputs.get("parameters")
                      or []})
        known.update({f"inputs.artifacts.{a['name']}.path": "/x" for a in
                      inputs.get("artifacts") or []})
        known.update({f"outputs.artifacts.{a['name']}.path": "/x" for a in
                      outputs.get("artifacts") or []})
        known.update({f"outputs.parameters.{p['name']}.path": "/x" for p in
                      outputs.get("parameters") or []})
        known.update({"pod.name": "x", "node.name": "x", "retries": "0"})
        container = template["container"]
        fields = {"container.command": container.get("command"),
                  "container.args": container.get("args"), "container.image": container["image"],
                  "container.workingDir": container.get("workingDir"),
                  "container.env": [e.get("value", "") for e in container.get("env") or []],
                  "inputs.artifacts": [[a.get("path"), (a.get("s3") or {}).get("key")]
                                       for a in inputs.get("artifacts") or []],
                  "outputs.artifacts": [[a.get("path"), (a.get("s3") or {}).get("key")]
                                        for a in outputs.get("artifacts") or []],
                  "outputs.parameters": [p["valueFrom"]["path"]
                                         for p in outputs.get("parameters") or []],
                  "memoize.key": (template.get("memoize") or {}).get("key"),
                  "retryStrategy.limit": str((template.get("retryStrategy") or {})
                                             .get("limit", "")),
                  "timeout": str(template.get("timeout", ""))}
        for field, value in fields.items():
            substitute(value, known, f"spec.templates[{name}].{field}")

    def _dag_scope(self) -> dict[str, str]:
        scope = dict(self.globals)
        for task, node in self.nodes.items():
            for name, value in node.parameters.items():
                scope[f"tasks.{task}.outputs.parameters.{name}"] = value
            scope[f"tasks.{task}.status"] = node.phase
        return scope

    def note(self, text: str) -> None:
        if text not in self._noted:
            self._noted.add(text)
            self.log(f"note: {text}")

    # -- the whole run --------------------------------------------------------------------
    def run(self) -> RunResult:
        start = time.monotonic()
        result = RunResult(self.name, run_dir=str(self.root), bucket=self.bucket)
        for text in _grouped(self.notes):
            self.note(text)
        self.log(f"workflow {self.name}: {len(self.order)} tasks, executor {self.executor}")
        with open_target(self.env, self.bucket, self.run_dir, self.log) as target, \
                process_env(target):
            self.pods = Lifecycle(
                self.name, self.spec, self.globals, self.root, self.env, self.bucket, target,
                self.secrets, self.configmaps, self.key_format, self.engine, self.echo,
                self.container.get("network", "host"), self.log, self.note,
                deadline=start + float(self.spec["activeDeadlineSeconds"])
                if self.spec.get("activeDeadlineSeconds") else None)
            result.endpoint = target.endpoint
            self._run_dag()
            result.nodes = [self.nodes[t.name] for t in self.order]
            failed = [n for n in result.nodes if n.failed]
            # As Argo's assessDAGPhase (dag.go): the phase of the first failed branch, so a
            # node's Error makes the workflow Error (seen on the real v4.0.5 controller).
            result.phase = failed[0].phase if failed else "Succeeded"
            if failed:
                result.message = f"{failed[0].task} {failed[0].phase}: {failed[0].message}"
            else:
                self._finish(result)
        result.wall_seconds = time.monotonic() - start
        self.root.mkdir(parents=True, exist_ok=True)
        result.write(self.root / "result.json")
        self._summary(result)
        return result

    def _run_dag(self) -> None:
        stopped = ""
        for task in self.order:
            phases = {name: node.phase for name, node in self.nodes.items()}
            if stopped:
                node = NodeResult(task.name, task.template_name, "Omitted",
                                  message=f"not started: {stopped} (failFast)")
            elif task.depends and not eval_depends(task.depends, phases,
                                                   f"{task.where}.depends"):
                node = NodeResult(task.name, task.template_name, "Omitted",
                                  message=f"depends {task.depends!r} is false")
            elif task.spec.get("when") and not eval_when(
                    substitute(task.spec["when"], self._dag_scope(), f"{task.where}.when"),
                    f"{task.where}.when"):
                node = NodeResult(task.name, task.template_name, "Skipped",
                                  message=f"when {task.spec['when']!r} is false")
            else:
                node = self._run_task(task)
            if node.phase in ("Omitted", "Skipped"):
                self.log(f"{task.name}: {node.phase} ({node.message})")
            self.nodes[task.name] = node
            if node.failed and self.fail_fast and not stopped:
                stopped = f"{task.name} {node.phase}"

    # -- one task -------------------------------------------------------------------------
    def _run_task(self, task: Task) -> NodeResult:
        node = NodeResult(task.name, task.template_name)
        start = time.monotonic()
        try:
            inputs, artifacts = self._inputs(task)
            hit = self._memo_load(task, inputs, node)
            if hit is None:
                self._attempts(task, inputs, artifacts, node)
                if node.phase == "Succeeded":
                    self._memo_save(task, inputs, node)
        except StepError as exc:
            node.phase, node.message = "Error", self.pods.scrub(str(exc))
            self.log(f"{task.name}: Error: {node.message}")
        node.seconds = time.monotonic() - start
        return node

    def _inputs(self, task: Task) -> tuple[dict[str, str], dict[str, ArtifactRef | str]]:
        """The template's input parameters and artifacts (a ref, or raw data as text)."""
        where = task.where
        scope = self._dag_scope()
        args = task.spec.get("arguments") or {}
        given = {p["name"]: substitute(p.get("value", ""), scope,
                                       f"{where}.arguments.parameters[{p['name']}]")
                 for p in args.get("parameters") or []}
        params: dict[str, str] = {}
        for param in (task.template.get("inputs") or {}).get("parameters") or []:
            name = param["name"]
            pwhere = f"spec.templates[{task.template_name}].inputs.parameters[{name}]"
            value = given.pop(name, param.get("value", param.get("default")))
            if value is None:
                raise LocalRunError(f"{where}.arguments.parameters: {name!r} is required by "
                                    f"template {task.template_name!r} and not given")
            value = substitute(str(value), scope, pwhere)
            if param.get("enum") and value not in [str(v) for v in param["enum"]]:
                raise LocalRunError(f"{pwhere}: {value!r} is not one of {param['enum']}")
            params[name] = value
        if given:
            raise LocalRunError(f"{where}.arguments.parameters[{next(iter(given))}]: template "
                                f"{task.template_name!r} has no such input")
        supplied = {a["name"]: a for a in args.get("artifacts") or []}
        artifacts: dict[str, ArtifactRef | str] = {}
        for spec in (task.template.get("inputs") or {}).get("artifacts") or []:
            source = {**spec, **supplied.pop(spec["name"], {})}
            ref = self._artifact_source(source, scope, f"{where}.arguments.artifacts"
                                                       f"[{spec['name']}]")
            if ref is None and not spec.get("optional"):
                raise LocalRunError(f"{where}.arguments.artifacts: input artifact "
                                    f"{spec['name']!r} of {task.template_name!r} has no source")
            if ref is not None:
                artifacts[spec["name"]] = ref
        if supplied:
            raise LocalRunError(f"{where}.arguments.artifacts[{next(iter(supplied))}]: "
                                f"template {task.template_name!r} has no such input")
        return params, artifacts

    def _artifact_source(self, source: dict, scope: dict, where: str) -> ArtifactRef | str | None:
        if "from" in source:
            match = _FROM.match(str(source["from"]))
            if not match:
                raise LocalRunError(f"{where}.from: expected "
                                    "{{tasks.<task>.outputs.artifacts.<name>}}")
            task, name = match.groups()
            node = self.nodes.get(task)
            if node is None or name not in node.artifacts:
                raise LocalRunError(f"{where}.from: task {task!r} produced no artifact {name!r}")
            return node.artifacts[name]
        if "s3" in source:
            key = substitute(source["s3"]["key"], scope, f"{where}.s3.key").strip("/")
            return transfer.probe(source["name"], self.bucket, key)
        if "raw" in source:
            return str(source["raw"].get("data", ""))
        return None

    # -- memoization ----------------------------------------------------------------------
    def _memo(self, task: Task, inputs: dict[str, str]) -> memo.Memo | None:
        return memo.Memo.of(task.template, task.template_name, self._input_scope(inputs))

    def _input_scope(self, inputs: dict[str, str]) -> dict[str, str]:
        return {**self.globals, **{f"inputs.parameters.{k}": v for k, v in inputs.items()}}

    def _memo_load(self, task: Task, inputs: dict[str, str], node: NodeResult) -> dict | None:
        spec = self._memo(task, inputs)
        if spec is None:
            return None
        hit = memo.load(self.bucket, spec.configmap, spec.key, spec.max_age)
        if hit is None:
            self.log(f"{task.name}: memoization miss ({spec.configmap}/{spec.key})")
            return None
        node.phase, node.memoized = "Succeeded", True
        node.parameters, node.artifacts = dict(hit["parameters"]), dict(hit["artifacts"])
        node.message = f"memoized: {spec.configmap}/{spec.key}"
        self.log(f"{task.name}: Succeeded from cache ({spec.configmap}/{spec.key}), not run")
        self._log_outputs(node)
        return hit

    def _memo_save(self, task: Task, inputs: dict[str, str], node: NodeResult) -> None:
        spec = self._memo(task, inputs)
        if spec is not None:
            memo.save(self.bucket, spec.configmap, spec.key, f"{self.name}.{task.name}",
                      node.parameters, node.artifacts)

    # -- attempts -------------------------------------------------------------------------
    def _attempts(self, task: Task, inputs: dict[str, str],
                  artifacts: dict[str, ArtifactRef | str], node: NodeResult) -> None:
        plan = RetryPlan.of(task.template, task.template_name, self._input_scope(inputs))
        first = time.monotonic()
        # Argo: the StartedAt of attempt (0) plus maxDuration (operator.go processNodeRetries)
        cutoff = first + plan.max_duration if plan.max_duration else None
        for attempt in range(plan.limit + 1):
            node_name = f"{self.name}.{task.name}" + (f"({attempt})" if plan.retrying else "")
            node.pod_name = pod_name(self.name, node_name, task.template_name)
            node.attempts = attempt + 1
            self.log(f"{task.name}: Running (pod {node.pod_name}, attempt {attempt + 1}/"
                     f"{plan.limit + 1})")
            exit_code = self.pods.attempt(task, inputs, artifacts, node, node_name, attempt,
                                          cutoff if attempt else None)
            node.exit_codes.append(exit_code)
            if node.phase == "Succeeded":
                usage = ("" if node.cpu_seconds is None else
                         f", CPU {node.cpu_seconds:.1f} s, peak RSS "
                         f"{node.max_rss_bytes / 2**20:.0f} MiB, peak disk "
                         f"{node.max_disk_bytes / 2**20:.0f} MiB")
                self.log(f"{task.name}: Succeeded in {time.monotonic() - first:.1f} s "
                         f"(the step itself {node.step_seconds:.1f} s{usage})")
                self._log_outputs(node)
                return
            self.log(f"{task.name}: {node.phase}: {node.message}")
            if attempt == plan.limit or not plan.allows(node, exit_code):
                return
            wait = plan.wait(attempt)
            late = self._past_cutoff(cutoff, wait)
            if late:
                node.message += f"; {late}"
                self.log(f"{task.name}: not retried: {late} (backoff maxDuration "
                         f"{plan.max_duration:.0f} s)")
                return
            wait *= self.backoff_scale
            self.log(f"{task.name}: retrying in {wait:.1f} s")
            time.sleep(wait)

    @staticmethod
    def _past_cutoff(cutoff: float | None, wait: float) -> str:
        """Argo's two refusals of a retry past ``maxDuration`` (empty: no refusal)."""
        if cutoff is not None and time.monotonic() >= cutoff:
            return "Max duration limit exceeded"
        if cutoff is not None and time.monotonic() + wait > cutoff:
            return "Backoff would exceed max duration limit"
        return ""

    def _log_outputs(self, node: NodeResult) -> None:
        for name, ref in node.artifacts.items():
            self.log(f"{node.task}:   {name} → {ref.uri}")
        for name, value in node.parameters.items():
            self.log(f"{node.task}:   {name} = {value}")

    # -- the end of a run -----------------------------------------------------------------
    def _products(self) -> list[NodeResult]:
        """Succeeded nodes whose outputs are the run's products: those no succeeded task
        depends on, and those that release an artifact to a stable key (an explicit
        ``s3.key`` outside ``{{workflow.name}}/``, e.g. ``models/``)."""
        ok = {name for name, node in self.nodes.items() if node.phase == "Succeeded"}
        used = {u for task in self.tasks.values() if task.name in ok for u in task.upstream}
        return [self.nodes[t.name] for t in self.order
                if t.name in ok and (t.name not in used or _releases(t.template))]

    def _finish(self, result: RunResult) -> None:
        """Find the ONNX models, presign links, copy the final outputs to output_dir."""
        for node in result.nodes:
            for ref in node.artifacts.values():
                if ref.kind == "file" and ref.key.endswith(".onnx"):
                    keys = [ref.key]
                elif ref.kind == "dir" and ref.archive == "none":
                    keys = [k for k in storage_keys(ref) if k.endswith(".onnx")]
                else:
                    keys = []
                for key in keys:
                    if any(m.uri.endswith("/" + key) for m in result.models):
                        continue
                    target = self.pods.target
                    url = "" if target.embedded else target.presign(key)
                    result.models.append(ModelLink(target.uri(key), url))
        # Stable keys (an explicit s3.key, outside <workflow>/) before per-pod copies, the
        # shallowest first (the FP32 release before its int8/ beside it).
        per_pod = self.pods.target.uri(self.name + "/")
        result.models.sort(key=lambda m: (m.uri.startswith(per_pod), m.uri.count("/")))
        if self.output_dir is None:
            return
        copied: list[str] = []
        for node in self._products():
            for name, ref in node.artifacts.items():
                path = self.pods.paths.get((node.task, name), "")
                if path and any(PurePosixPath(path).is_relative_to(c) for c in copied):
                    continue  # the same files as an artifact already copied
                label = name if name not in result.outputs else f"{node.task}-{name}"
                dest = transfer.fetch(ref, self.output_dir / label)
                result.outputs[label] = str(dest)
                if path:
                    copied.append(path)

    def _summary(self, result: RunResult) -> None:
        self.log(f"workflow {result.workflow_name} {result.phase} in "
                 f"{result.wall_seconds:.1f} s (steps {result.step_seconds:.1f} s, "
                 f"orchestration {result.overhead_seconds:.1f} s)")
        if result.message:
            self.log(f"  {result.message}")
        for i, model in enumerate(result.models):
            if i:
                self.log(f"  also at {model.uri}")
                continue
            self.log(f"ONNX model: {model.uri}")
            if model.url:
                self.log(f"  download link (presigned, 7 days): {model.url}")
            else:
                self.log("  (no download link: the embedded S3 stops with this run; use the "
                         "docker-compose MinIO for links that outlive it)")
        for label, path in result.outputs.items():
            self.log(f"output {label}: {path}")
        self.log(f"run record: {self.root / 'result.json'}")


def _grouped(notes: list[str]) -> list[str]:
    """``ignoring A (why)``, ``ignoring B (why)`` → ``ignoring A, B (why)``."""
    groups: dict[str, list[str]] = {}
    others = []
    for text in notes:
        match = re.fullmatch(r"ignoring (\S+) \((.+)\)", text)
        if match:
            groups.setdefault(match.group(2), []).append(match.group(1))
        else:
            others.append(text)
    return [f"ignoring {', '.join(fields)} ({why})" for why, fields in groups.items()] + others


def _releases(template: dict) -> bool:
    return any(not str((a.get("s3") or {}).get("key", "{{workflow.name}}")).startswith(
        "{{workflow.name}}") for a in (template.get("outputs") or {}).get("artifacts") or [])


def storage_keys(ref: ArtifactRef) -> list[str]:
    return storage.list_keys(ref.uri)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def validate_workflow(workflow: dict, parameters: Mapping[str, str] | None = None) -> list[str]:
    """Every check ``run_workflow`` makes before it starts anything (no S3, no step).

    Raises :class:`LocalRunError` naming the first unsupported field or unresolvable
    variable; returns the notes about ignored, Kubernetes-only fields.
    """
    run = LocalRun(workflow, executor="subprocess", run_dir=Path("."), output_dir=None,
                   env={}, log=lambda _: None, bucket=None, parameters=parameters,
                   secrets=None, configmaps=None, key_format=transfer.DEFAULT_KEY_FORMAT,
                   backoff_scale=1.0, echo=None, container=None)
    return _grouped(run.notes)


def run_workflow(workflow: dict, *, executor: str = "subprocess",
                 run_dir: Path | str = ".unet-local", output_dir: Path | str | None = None,
                 env: Mapping[str, str] | None = None,
                 log: Callable[[str], None] = _stderr, bucket: str | None = None,
                 parameters: Mapping[str, str] | None = None,
                 secrets: Mapping[str, Mapping[str, str]] | None = None,
                 configmaps: Mapping[str, Mapping[str, str]] | None = None,
                 key_format: str = transfer.DEFAULT_KEY_FORMAT, backoff_scale: float = 1.0,
                 echo: TextIO | None | object = ECHO_STDERR,
                 container: Mapping[str, Any] | None = None) -> RunResult:
    """Run the compiled Workflow ``workflow`` (the dict ``render`` prints) on this machine.

    ``run_dir`` holds ``runs/<workflow>/<pod>/`` (each pod's files and ``main.log``),
    ``runs/<workflow>/result.json``, and the embedded S3's data (``s3/``) when
    ``AWS_ENDPOINT_URL`` is not set in ``env`` (default: this process's environment).
    ``bucket`` is the artifact bucket (default $UNET_ARTIFACT_BUCKET or unet-artifacts),
    created if missing. ``parameters`` override workflow parameters as ``argo submit -p``
    does. ``secrets`` maps Secret name → key → value for ``secretKeyRef``, ``configmaps`` the
    same for ``configMapKeyRef``. ``executor`` is ``subprocess``, ``podman`` or ``docker``;
    ``container`` tunes the last two (``network``, default host; ``binary``). ``echo`` gets
    the steps' output (default: stderr; None: only the pod logs). Anything in the Workflow
    the runner cannot honour raises :class:`LocalRunError` before a step runs; a failed step
    gives a RunResult with ``phase == "Failed"`` and ``exit_code == 1``. While it runs, this process's ``AWS_*``
    variables point at the run's S3 (for :mod:`steps.storage`); they are restored after.
    """
    if echo is ECHO_STDERR:
        echo = sys.stderr
    run = LocalRun(workflow, executor=executor, run_dir=Path(run_dir),
                   output_dir=Path(output_dir) if output_dir else None, env=env, log=log,
                   bucket=bucket, parameters=parameters, secrets=secrets,
                   configmaps=configmaps, key_format=key_format,
                   backoff_scale=backoff_scale, echo=echo, container=container)
    return run.run()
