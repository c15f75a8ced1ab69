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
- **Artifacts.** Keys follow the artifact repository's keyFormat (default
  ``{{workflow.name}}/{{pod.name}}``) as described in :mod:`workflows.local.transfer`.
  Inputs are downloaded into ``<run>/<pod>/<container path>`` before the step, outputs
  uploaded after it exits 0; container paths in the command are remapped there.
- **Parameters.** Output parameters are read from ``valueFrom.path`` with one trailing
  newline removed, as Argo's executor does.
- **Env.** The template's ``env``, with references resolved from a local store that stands
  in for the cluster's objects: a ``secretKeyRef`` from ``secrets`` or, for the S3
  credentials, the run's own S3; a ``configMapKeyRef`` from ``configmaps`` or, for
  ``AWS_ENDPOINT_URL``, the run's S3; an optional reference with no value is left unset. A
  template that receives S3 credentials talks to the run's S3 (endpoint and region), since
  locally that is the object store. The ``subprocess`` executor adds this machine's
  environment minus every ``AWS_*`` variable; a container gets the template's env alone.
- **Executors.** ``subprocess`` runs the command here with container paths remapped under
  the pod directory; ``podman`` and ``docker`` run the template in its image as its pod
  runs (:mod:`workflows.local.pods`).
- **Retries.** ``retryStrategy.limit`` more attempts, each a fresh pod directory, after
  ``backoff.duration * factor**n`` (capped by ``cap``, multiplied by ``backoff_scale``).
  ``backoff.maxDuration`` is a deadline from the first attempt's start, as Argo's
  ``processNodeRetries`` keeps it: no retry once it has passed ("Max duration limit
  exceeded") or when the wait would pass it, and an attempt after the first is killed when
  it passes (the wait container's ``ARGO_DEADLINE``). ``retryPolicy``: Always retries
  failures and errors, OnFailure (the default) a non-zero exit, OnError/OnTransientError an
  error of the runner (artifact transfer, missing output). An ``expression`` over
  ``lastRetry.*`` must also hold; ``lastRetry.exitCode`` is ``-1`` for an attempt whose
  step never ran (an input that failed to load), as in ``buildRetryStrategyLocalScope``.
- **Memoization.** See :mod:`workflows.local.memo`.
- **Deadlines.** ``timeout`` and ``activeDeadlineSeconds`` of a template, and the
  Workflow's ``activeDeadlineSeconds``, stop the step process.
"""
from __future__ import annotations

import os
import re
import secrets as _secrets
import shutil
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Mapping, TextIO

from steps.errors import StepError
from workflows.local import executors, memo, pods, transfer
from workflows.local.errors import LocalRunError
from workflows.local.expr import (depends_names, eval_depends, eval_retry, eval_when,
                                  substitute)
from workflows.local.results import ArtifactRef, ModelLink, NodeResult, RunResult
from workflows.local.s3target import S3Target, open_target, process_env
from workflows.local.spec import check_workflow, template_map

EXECUTORS = ("subprocess", *pods.ENGINES)
NAME_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"   # Kubernetes' generateName alphabet
DEFAULT_BUCKET = "unet-artifacts"
ECHO_STDERR = object()   # the default for run_workflow(echo=): sys.stderr at call time
CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
_FROM = re.compile(r"^\{\{\s*tasks\.([\w\-]+)\.outputs\.artifacts\.([\w\-]+)\s*\}\}$")
_TASK_REF = re.compile(r"\{\{\s*tasks\.([\w\-]+)\.")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1, "m": 60,
                   "h": 3600}
_MAX_POD_PREFIX = 253 - 10 - 1


# ---- names ----------------------------------------------------------------------------------
def fnv1a_32(text: str) -> int:
    value = 0x811C9DC5
    for byte in text.encode():
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return value


def pod_name(workflow_name: str, node_name: str, template_name: str) -> str:
    """Argo's v2 pod name (``workflow/util/pod_name.go``)."""
    if workflow_name == node_name:
        return workflow_name
    prefix = f"{workflow_name}-{template_name}" if template_name else workflow_name
    return f"{prefix[:_MAX_POD_PREFIX]}-{fnv1a_32(node_name)}"


def workflow_name(metadata: Mapping[str, Any]) -> str:
    if metadata.get("name"):
        return metadata["name"]
    suffix = "".join(_secrets.choice(NAME_SUFFIX_ALPHABET) for _ in range(5))
    return f"{metadata['generateName']}{suffix}"


def duration_seconds(value: Any, where: str) -> float:
    """A Go duration (``30s``, ``1h30m``) or a number of seconds."""
    text = str(value).strip()
    try:
        return float(text)
    except ValueError:
        pass
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise LocalRunError(f"{where}: {value!r} is not a duration (e.g. 30s, 10m, 720h)")
    return sum(float(n) * _DURATION_UNITS[u] for n, u in parts)


# ---- the run --------------------------------------------------------------------------------
class _Task:
    def __init__(self, spec: dict, templates: dict[str, dict], where: str):
        self.name: str = spec["name"]
        self.spec = spec
        self.where = where
        self.template_name: str = spec["template"]
        self.template = templates[self.template_name]
        deps = spec.get("dependencies") or []
        self.depends: str | None = spec.get("depends") or (" && ".join(deps) or None)
        self.upstream = depends_names(self.depends, f"{where}.depends") if self.depends else []
        self.ancestors: set[str] = set()


def _order(tasks: dict[str, _Task]) -> list[_Task]:
    """Topological order, stable in declaration order; refuses cycles and unknown names."""
    for task in tasks.values():
        for name in task.upstream:
            if name not in tasks:
                raise LocalRunError(f"{task.where}.depends: unknown task {name!r}")
    done: list[_Task] = []
    pending = list(tasks.values())
    while pending:
        ready = [t for t in pending if all(u in {d.name for d in done} for u in t.upstream)]
        if not ready:
            raise LocalRunError(f"dag: dependency cycle among {[t.name for t in pending]}")
        done.append(ready[0])
        pending.remove(ready[0])
    for task in done:  # as Argo validates: tasks.X only for X among the task's ancestors
        task.ancestors = set(task.upstream).union(*(tasks[u].ancestors for u in task.upstream))
        text = str(task.spec.get("arguments") or {}) + str(task.spec.get("when") or "")
        for name in _TASK_REF.findall(text):
            if name not in task.ancestors:
                raise LocalRunError(f"{task.where}.arguments: uses tasks.{name}, which is not "
                                    "among the tasks it depends on")
    return done


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
        self.bucket = bucket or self.env.get("UNET_ARTIFACT_BUCKET") or DEFAULT_BUCKET
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
        self.tasks = {t["name"]: _Task(t, self.templates, f"{where}[{t['name']}]")
                      for t in dag.get("tasks") or []}
        self.order = _order(self.tasks)
        self.globals = self._global_scope(parameters or {})
        self._static_check()
        self.target: S3Target | None = None
        self.nodes: dict[str, NodeResult] = {}
        self.paths: dict[tuple[str, str], str] = {}   # (task, artifact) → container path
        self.deadline: float | None = None
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
        if self.spec.get("activeDeadlineSeconds"):
            self.deadline = start + float(self.spec["activeDeadlineSeconds"])
        result = RunResult(self.name, run_dir=str(self.root), bucket=self.bucket)
        for text in _grouped(self.notes):
            self.note(text)
        self.log(f"workflow {self.name}: {len(self.order)} tasks, executor {self.executor}")
        with open_target(self.env, self.bucket, self.run_dir, self.log) as target, \
                process_env(target):
            self.target = target
            result.endpoint = target.endpoint
            self._run_dag()
            result.nodes = [self.nodes[t.name] for t in self.order]
            failed = [n for n in result.nodes if n.failed]
            result.phase = "Failed" if failed else "Succeeded"
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
    def _run_task(self, task: _Task) -> NodeResult:
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
            node.phase, node.message = "Error", self._scrub(str(exc))
            self.log(f"{task.name}: Error: {node.message}")
        node.seconds = time.monotonic() - start
        return node

    def _inputs(self, task: _Task) -> tuple[dict[str, str], dict[str, ArtifactRef | str]]:
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
    def _memo(self, task: _Task, inputs: dict[str, str]) -> tuple[str, str, float] | None:
        spec = task.template.get("memoize")
        if not spec:
            return None
        where = f"spec.templates[{task.template_name}].memoize"
        scope = {**self.globals, **{f"inputs.parameters.{k}": v for k, v in inputs.items()}}
        key = memo.check_key(substitute(spec["key"], scope, f"{where}.key"), f"{where}.key")
        max_age = duration_seconds(spec["maxAge"], f"{where}.maxAge") if spec.get("maxAge") \
            else memo.DEFAULT_MAX_AGE_S
        return spec["cache"]["configMap"]["name"], key, max_age

    def _memo_load(self, task: _Task, inputs: dict[str, str], node: NodeResult) -> dict | None:
        memo_spec = self._memo(task, inputs)
        if memo_spec is None:
            return None
        configmap, key, max_age = memo_spec
        hit = memo.load(self.bucket, configmap, key, max_age)
        if hit is None:
            self.log(f"{task.name}: memoization miss ({configmap}/{key})")
            return None
        node.phase, node.memoized = "Succeeded", True
        node.parameters, node.artifacts = dict(hit["parameters"]), dict(hit["artifacts"])
        node.message = f"memoized: {configmap}/{key}"
        self.log(f"{task.name}: Succeeded from cache ({configmap}/{key}), not run")
        self._log_outputs(node)
        return hit

    def _memo_save(self, task: _Task, inputs: dict[str, str], node: NodeResult) -> None:
        memo_spec = self._memo(task, inputs)
        if memo_spec is not None:
            configmap, key, _ = memo_spec
            memo.save(self.bucket, configmap, key, f"{self.name}.{task.name}",
                      node.parameters, node.artifacts)

    # -- attempts -------------------------------------------------------------------------
    def _retry_plan(self, task: _Task, inputs: dict[str, str]) -> dict[str, Any]:
        spec = task.template.get("retryStrategy")
        where = f"spec.templates[{task.template_name}].retryStrategy"
        if spec is None:
            return {"limit": 0, "retrying": False}
        scope = {**self.globals, **{f"inputs.parameters.{k}": v for k, v in inputs.items()}}
        raw = substitute(str(spec.get("limit", 0)), scope, f"{where}.limit")
        try:
            limit = int(raw)
        except ValueError:
            raise LocalRunError(f"{where}.limit: {raw!r} is not an integer") from None
        backoff = spec.get("backoff") or {}
        policy = spec.get("retryPolicy") or ("Always" if spec.get("expression") else "OnFailure")
        get = lambda k: duration_seconds(backoff[k], f"{where}.backoff.{k}") \
            if k in backoff else None  # noqa: E731
        return {"limit": max(limit, 0), "retrying": True, "policy": policy,
                "expression": spec.get("expression"), "where": where,
                "duration": get("duration") or 0.0, "cap": get("cap"),
                "max_duration": get("maxDuration"),
                "factor": float(backoff.get("factor", 1) or 1)}

    def _attempts(self, task: _Task, inputs: dict[str, str],
                  artifacts: dict[str, ArtifactRef | str], node: NodeResult) -> None:
        plan = self._retry_plan(task, inputs)
        first = time.monotonic()
        # Argo: the StartedAt of attempt (0) plus maxDuration (operator.go processNodeRetries)
        cutoff = first + plan["max_duration"] if plan.get("max_duration") else None
        for attempt in range(plan["limit"] + 1):
            node_name = f"{self.name}.{task.name}" + (f"({attempt})" if plan["retrying"] else "")
            node.pod_name = pod_name(self.name, node_name, task.template_name)
            node.attempts = attempt + 1
            total = plan["limit"] + 1
            self.log(f"{task.name}: Running (pod {node.pod_name}, attempt {attempt + 1}/{total})")
            exit_code = self._attempt(task, inputs, artifacts, node, node_name, attempt,
                                      cutoff if attempt else None)
            if node.phase == "Succeeded":
                self.log(f"{task.name}: Succeeded in {time.monotonic() - first:.1f} s "
                         f"(the step itself {node.step_seconds:.1f} s)")
                self._log_outputs(node)
                return
            self.log(f"{task.name}: {node.phase}: {node.message}")
            if attempt == plan["limit"] or not self._should_retry(plan, node, exit_code):
                return
            wait = plan["duration"] * plan["factor"] ** attempt
            if plan["cap"] is not None:
                wait = min(wait, plan["cap"])
            if cutoff is not None and time.monotonic() >= cutoff:
                node.message += "; Max duration limit exceeded"
                self.log(f"{task.name}: not retried: Max duration limit exceeded "
                         f"(backoff maxDuration {plan['max_duration']:.0f} s)")
                return
            if cutoff is not None and time.monotonic() + wait > cutoff:
                node.message += "; Backoff would exceed max duration limit"
                self.log(f"{task.name}: not retried: Backoff would exceed max duration limit "
                         f"(backoff maxDuration {plan['max_duration']:.0f} s)")
                return
            wait *= self.backoff_scale
            self.log(f"{task.name}: retrying in {wait:.1f} s")
            time.sleep(wait)

    def _should_retry(self, plan: dict, node: NodeResult, exit_code: int | None) -> bool:
        policy = plan["policy"]
        ok = (policy == "Always" or (policy == "OnFailure" and node.phase == "Failed")
              or (policy in ("OnError", "OnTransientError") and node.phase == "Error"))
        if ok and plan["expression"]:
            last = {"exitCode": "-1" if exit_code is None else str(exit_code),
                    "status": node.phase, "message": node.message,
                    "duration": f"{node.seconds:.0f}"}
            ok = eval_retry(plan["expression"], last, f"{plan['where']}.expression")
        return ok

    def _attempt(self, task: _Task, inputs: dict[str, str],
                 artifacts: dict[str, ArtifactRef | str], node: NodeResult,
                 node_name: str, attempt: int, cutoff: float | None) -> int | None:
        """One pod's worth: inputs in, the step, outputs out. Sets node.phase; returns rc
        (None when the step never ran). ``cutoff``: the retry deadline (monotonic)."""
        pod_dir = self.root / node.pod_name
        if pod_dir.exists():
            shutil.rmtree(pod_dir)
        pod_dir.mkdir(parents=True)
        node.log_path = str(pod_dir / "main.log")
        try:
            plan = self._plan(task, inputs, node, node_name, attempt, pod_dir, cutoff)
            for name, ref in artifacts.items():
                dest = plan["host"](plan["inputs"][name])
                if isinstance(ref, str):
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_text(ref)
                else:
                    try:
                        transfer.download_input(ref, dest)
                    except StepError as exc:  # Argo's init container: the node is an Error
                        raise LocalRunError(f"artifact {name} failed to load: {exc}") from None
                    self.log(f"{task.name}:   {name} ← {ref.uri}")
            if self.engine is None:
                outcome = executors.run(plan["launch"], self.echo)
            else:
                outcome = pods.run(self.engine, plan["pod"], plan["host"], pod_dir / "main.log",
                                   plan["timeout"], self.echo)
        except StepError as exc:
            node.phase, node.message = "Error", self._scrub(str(exc))
            return None
        node.step_seconds += outcome.seconds
        if outcome.timed_out:
            why = ("Step exceeded its deadline (retry maxDuration)"
                   if cutoff is not None and time.monotonic() >= cutoff else "timed out")
            node.phase, node.message = "Failed", f"{why} after {outcome.seconds:.0f} s"
            return outcome.returncode
        if outcome.returncode != 0:
            node.phase = "Failed"
            node.message = f"exit code {outcome.returncode} (log: {node.log_path})"
            return outcome.returncode
        try:
            self._collect(task, node, plan)
        except StepError as exc:
            node.phase, node.message = "Error", self._scrub(str(exc))
            return 0
        node.phase, node.message = "Succeeded", ""
        return 0

    def _plan(self, task: _Task, inputs: dict[str, str], node: NodeResult, node_name: str,
              attempt: int, pod_dir: Path, cutoff: float | None) -> dict[str, Any]:
        """Resolve the template for one attempt: container paths, command, env, launch.
        Its deadline runs from here, as a pod's does from its start (inputs included)."""
        tname = task.template_name
        where = f"spec.templates[{tname}]"
        template = task.template
        scope = {**self.globals, **{f"inputs.parameters.{k}": v for k, v in inputs.items()},
                 "pod.name": node.pod_name, "node.name": node_name, "retries": str(attempt)}
        paths = self._container_paths(template, scope, where)
        host = lambda p: pod_dir / p.lstrip("/")  # noqa: E731
        in_image = self.engine is not None
        local = {k: (v if in_image else str(host(v))) for k, v in paths["scope"].items()}
        scope.update(local)
        container = template["container"]
        command, args = container.get("command") or [], container.get("args") or []
        if not in_image:  # literal container paths first; placeholders resolve to host paths
            known = sorted(paths["all"], key=len, reverse=True)
            command, args = (self._remap(x, known, host) for x in (command, args))
        command = substitute(command, scope, f"{where}.container.command")
        args = substitute(args, scope, f"{where}.container.args")
        if not in_image:  # a container's outputs are copied out of it after the step
            for path in paths["outputs"].values():
                host(path).parent.mkdir(parents=True, exist_ok=True)
        env = self._env(template, scope, where)
        key_prefix = substitute(self.key_format, scope, "artifact repository keyFormat")
        plan = {"host": host, "inputs": paths["inputs"], "outputs": paths["outputs"],
                "params": paths["params"], "scope": scope, "key_prefix": key_prefix,
                "timeout": self._timeout(template, scope, where, cutoff)}
        if in_image:
            plan["pod"] = self._pod(template, scope, command, args, env, paths, host, where)
            stale = self.engine.stale(plan["pod"].image)
            if stale:
                self.note(stale)
        else:
            base = {k: v for k, v in self.env.items() if not k.startswith("AWS_")}
            plan["launch"] = executors.Launch(
                executors.subprocess_argv(command + args),
                executors.with_project_path({**base, **env}), pod_dir, pod_dir / "main.log",
                plan["timeout"])
        return plan

    def _container_paths(self, template: dict, scope: dict, where: str) -> dict[str, Any]:
        """Container paths of input/output artifacts and output parameters, resolved."""
        inputs = {a["name"]: substitute(a["path"], scope, f"{where}.inputs.artifacts"
                                                          f"[{a['name']}].path")
                  for a in (template.get("inputs") or {}).get("artifacts") or []}
        outs = {a["name"]: a["path"] for a in (template.get("outputs") or {}).get("artifacts")
                or []}
        view = {**scope, **{f"inputs.artifacts.{k}.path": v for k, v in inputs.items()}}
        for _ in range(len(outs) + 1):  # output paths may refer to each other
            view.update({f"outputs.artifacts.{k}.path": v for k, v in outs.items()})
            pending = {k: v for k, v in outs.items() if "{{" in v}
            if not pending:
                break
            for k, v in pending.items():
                refs = re.findall(r"\{\{\s*outputs\.artifacts\.([\w\-]+)\.path\s*\}\}", v)
                if all("{{" not in outs.get(r, "") for r in refs):
                    outs[k] = substitute(v, view, f"{where}.outputs.artifacts[{k}].path")
        view.update({f"outputs.artifacts.{k}.path": v for k, v in outs.items()})
        params = {p["name"]: substitute(p["valueFrom"]["path"], view,
                                        f"{where}.outputs.parameters[{p['name']}].valueFrom.path")
                  for p in (template.get("outputs") or {}).get("parameters") or []}
        for kind, table in (("inputs.artifacts", inputs), ("outputs.artifacts", outs),
                            ("outputs.parameters", params)):
            for name, path in table.items():
                if not PurePosixPath(path).is_absolute() or ".." in PurePosixPath(path).parts:
                    raise LocalRunError(f"{where}.{kind}[{name}].path: {path!r} is not an "
                                        "absolute container path")
        path_scope = {**{f"inputs.artifacts.{k}.path": v for k, v in inputs.items()},
                      **{f"outputs.artifacts.{k}.path": v for k, v in outs.items()},
                      **{f"outputs.parameters.{k}.path": v for k, v in params.items()}}
        return {"inputs": inputs, "outputs": outs, "params": params, "scope": path_scope,
                "all": [*inputs.values(), *outs.values(), *params.values()]}

    @staticmethod
    def _remap(items: list[str], known: list[str], host: Callable[[str], Path]) -> list[str]:
        """Literal container paths in a command (``/data/raw``, ``--x=/data/raw/a``)."""
        def one(text: str) -> str:
            flag, eq, value = text.partition("=") if text.startswith("-") else ("", "", text)
            for path in known:
                if value == path or value.startswith(path.rstrip("/") + "/"):
                    return flag + eq + str(host(path)) + value[len(path):]
            return text
        return [one(item) for item in items]

    def _env(self, template: dict, scope: dict, where: str) -> dict[str, str]:
        """The template's env, references resolved; S3 users get the run's endpoint/region."""
        env: dict[str, str] = {}
        for item in template["container"].get("env") or []:
            name = item["name"]
            ewhere = f"{where}.container.env[{name}]"
            if "valueFrom" in item:
                value = self._reference(name, item["valueFrom"], ewhere)
                if value is not None:
                    env[name] = value
            else:
                env[name] = substitute(str(item.get("value", "")), scope, ewhere)
        if any(name in env for name in CREDENTIAL_VARS):
            env.pop("AWS_ENDPOINT_URL_S3", None)
            env.update(AWS_ENDPOINT_URL=self.target.endpoint, AWS_REGION=self.target.region)
            self.note(f"{where}: receives S3 credentials, so its AWS_ENDPOINT_URL and "
                      "AWS_REGION point at this run's S3")
        return env

    def _reference(self, env_name: str, source: dict, where: str) -> str | None:
        """A secretKeyRef or configMapKeyRef from the local store; the run's S3 stands in for
        the cluster's credentials Secret and storage ConfigMap."""
        if "secretKeyRef" in source:
            kind, ref, store, arg = "Secret", source["secretKeyRef"], self.secrets, "secrets="
            own = {"AWS_ACCESS_KEY_ID": self.target.access_key,
                   "AWS_SECRET_ACCESS_KEY": self.target.secret_key}
        else:
            kind, ref, store, arg = ("ConfigMap", source["configMapKeyRef"], self.configmaps,
                                     "configmaps=")
            own = {"AWS_ENDPOINT_URL": self.target.endpoint}
        name, key = ref.get("name", ""), ref.get("key", "")
        if key in (store.get(name) or {}):
            return str(store[name][key])
        if env_name in own:
            return own[env_name]
        if ref.get("optional"):
            return None
        raise LocalRunError(f"{where}: {kind} {name!r} key {key!r} has no local value "
                            f"(pass it in {arg})")

    def _pod(self, template: dict, scope: dict, command: list[str], args: list[str],
             env: dict[str, str], paths: dict, host, where: str) -> pods.Pod:
        container = template["container"]
        limits = {**((container.get("resources") or {}).get("requests") or {}),
                  **((container.get("resources") or {}).get("limits") or {})}
        user, groups = pods.security(self.spec, template, where)
        optional = {paths["outputs"][a["name"]] for a in (template.get("outputs") or {}).get(
            "artifacts") or [] if a.get("optional")}
        return pods.Pod(
            name=scope["pod.name"],
            image=substitute(container["image"], scope, f"{where}.container.image"),
            pull_policy=container.get("imagePullPolicy", "IfNotPresent"),
            command=command, args=args, env=env,
            volumes=pods.volumes(self.spec, template, where),
            inputs={path: host(path) for path in paths["inputs"].values()},
            outputs=[*paths["outputs"].values(), *paths["params"].values()],
            optional_outputs=optional, user=user, groups=groups,
            workdir=container.get("workingDir"),
            gpus=int(limits.get("nvidia.com/gpu", 0) or 0),
            hpus=int(limits.get("habana.ai/gaudi", 0) or 0),
            network=self.container.get("network", "host"))

    def _timeout(self, template: dict, scope: dict, where: str,
                 cutoff: float | None) -> float | None:
        """Seconds this attempt may run: its template's deadlines, the Workflow's, and the
        retry deadline ``cutoff`` (monotonic) when one applies to it."""
        limits = []
        if template.get("timeout"):
            limits.append(duration_seconds(substitute(str(template["timeout"]), scope,
                                                      f"{where}.timeout"), f"{where}.timeout"))
        if template.get("activeDeadlineSeconds"):
            limits.append(duration_seconds(template["activeDeadlineSeconds"],
                                           f"{where}.activeDeadlineSeconds"))
        for until in (self.deadline, cutoff):
            if until is not None:
                limits.append(max(until - time.monotonic(), 0.001))
        return min(limits) if limits else None

    def _collect(self, task: _Task, node: NodeResult, plan: dict) -> None:
        """Upload the output artifacts and read the output parameters."""
        host = plan["host"]
        template = task.template
        for spec in (template.get("outputs") or {}).get("artifacts") or []:
            name = spec["name"]
            local = host(plan["outputs"][name])
            if not local.exists():
                if spec.get("optional"):
                    continue
                raise LocalRunError(f"output artifact {name!r}: {plan['outputs'][name]} was "
                                    "not written by the step")
            explicit = (spec.get("s3") or {}).get("key")
            if explicit:
                explicit = substitute(explicit, plan["scope"],
                                      f"spec.templates[{task.template_name}].outputs"
                                      f".artifacts[{name}].s3.key")
            key = transfer.output_key({**spec, "path": plan["outputs"][name]},
                                      plan["key_prefix"], explicit)
            node.artifacts[name] = transfer.upload_output(spec, local, self.bucket, key)
            self.paths[(task.name, name)] = plan["outputs"][name]
        for spec in (template.get("outputs") or {}).get("parameters") or []:
            name = spec["name"]
            path = host(plan["params"][name])
            if path.is_file():
                text = path.read_text(errors="replace")
                node.parameters[name] = text[:-1] if text.endswith("\n") else text
            elif "default" in spec["valueFrom"]:
                node.parameters[name] = str(spec["valueFrom"]["default"])
            else:
                raise LocalRunError(f"output parameter {name!r}: {plan['params'][name]} was "
                                    "not written by the step")

    def _log_outputs(self, node: NodeResult) -> None:
        for name, ref in node.artifacts.items():
            self.log(f"{node.task}:   {name} → {ref.uri}")
        for name, value in node.parameters.items():
            self.log(f"{node.task}:   {name} = {value}")

    def _scrub(self, text: str) -> str:
        secrets = [self.target.secret_key] if self.target else []
        secrets += [str(v) for keys in self.secrets.values() for v in keys.values()]
        for secret in secrets:
            if secret:
                text = text.replace(secret, "***")
        return " ".join(text.split())

    # -- the end of a run -----------------------------------------------------------------
    def _leaves(self) -> list[NodeResult]:
        used = {name for task in self.tasks.values() for name in task.upstream}
        return [self.nodes[t.name] for t in self.order
                if t.name not in used and self.nodes[t.name].phase == "Succeeded"]

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
                    url = "" if self.target.embedded else self.target.presign(key)
                    result.models.append(ModelLink(self.target.uri(key), url))
        # Stable keys (an explicit s3.key, outside <workflow>/) before per-pod copies.
        result.models.sort(key=lambda m: m.uri.startswith(self.target.uri(self.name + "/")))
        if self.output_dir is None:
            return
        copied: list[str] = []
        for node in self._leaves():
            for name, ref in node.artifacts.items():
                path = self.paths.get((node.task, name), "")
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


def storage_keys(ref: ArtifactRef) -> list[str]:
    from steps import storage
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
