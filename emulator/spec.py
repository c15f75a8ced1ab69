"""What of a compiled Workflow the local runner runs, ignores, or refuses.

The runner executes a Workflow whose entrypoint is one ``dag`` template of ``container``
templates. :func:`check_workflow` walks every key before anything runs:

- **handled** keys are run as Argo would (see :mod:`emulator.runner`);
- **ignored** keys only steer Kubernetes or the Argo controller and change nothing about
  what a step computes or which artifacts it exchanges. Each one yields a logged note:
  scheduling (``nodeSelector``, ``tolerations``, ``affinity``, ``priorityClassName``,
  ``schedulerName``), identity and pod security (``serviceAccountName``,
  ``securityContext`` under the subprocess executor, ``imagePullSecrets``), ``resources``
  (a subprocess takes what the machine has; the container executors map GPU/HPU requests and
  /dev/shm), cleanup of cluster objects (``podGC``, ``ttlStrategy``, ``artifactGC``),
  controller observability (``metrics``, ``archiveLogs``: logs stay in the run directory),
  ``parallelism`` and ``synchronization`` (tasks run one at a time here anyway), labels and
  annotations, an ``emptyDir`` at ``/dev/shm`` under the subprocess executor (the host's own
  /dev/shm serves) and a ``HugePages`` ``emptyDir`` (the host's huge pages serve);
- a disk ``emptyDir`` at any path is handled: a folder of the pod directory for a
  subprocess, a volume of the container's for podman and docker, which also honour the
  ``securityContext`` users;
- **everything else is refused** with one line naming the field, e.g. ``script``,
  ``steps`` and ``resource`` templates, ``sidecars``, ``podSpecPatch``, exit handlers,
  loops, other volume kinds, ``envFrom``, ``continueOn``, workflow-level artifacts,
  zip archives. Nothing is silently dropped.
"""
from __future__ import annotations

import math
import os
import re
from typing import Any, Iterable, Mapping

from emulator.errors import LocalRunError
from workflows import durations


def duration_seconds(value: Any, where: str) -> float:
    """A Go duration (``30s``, ``1h30m``) or a number of seconds (``workflows.durations``)."""
    try:
        return durations.seconds(value)
    except ValueError as e:
        raise LocalRunError(f"{where}: {e}") from None


RESOURCE_FIELD_KEYS = {"resource", "divisor", "containerName"}
_CPU = re.compile(r"(\d+(?:\.\d+)?)(m?)")


def cpu_cores(value: Any, where: str) -> float:
    """A Kubernetes CPU quantity ("2", "1.5", "500m") in cores."""
    match = _CPU.fullmatch(str(value).strip())
    if not match:
        raise LocalRunError(f"{where}: {value!r} is not a CPU quantity (e.g. 2, 1.5, 500m)")
    return float(match[1]) / (1000 if match[2] else 1)


def cpu_field(resources: dict, ref: dict, where: str) -> str:
    """What the downward API's ``resourceFieldRef`` gives a container for ``requests.cpu``
    or ``limits.cpu``: the quantity over ``divisor``, rounded up. An unset request is the
    limit, else 0; an unset limit is the node's CPUs (here: this machine's)."""
    kind = ref.get("resource", "requests.cpu").split(".")[0]
    value = (resources.get(kind) or {}).get("cpu")
    if value is None and kind == "requests":
        value = (resources.get("limits") or {}).get("cpu", 0)
    cores = cpu_cores(value, where) if value is not None else float(os.cpu_count() or 1)
    return str(math.ceil(cores / cpu_cores(ref.get("divisor", "1"), f"{where}.divisor")))


SHM = "/dev/shm"

_WHY = {
    "scheduling": "Kubernetes scheduling",
    "identity": "Kubernetes identity and pod security",
    "cleanup": "cleanup of cluster objects",
    "observability": "controller observability; logs and results stay in the run directory",
    "concurrency": "concurrency limits; the local runner runs one task at a time",
    "labels": "labels and annotations on cluster objects",
    "resources": "pod cpu and memory; a step uses what this machine has",
}

# Ignored keys and why ignoring them is safe locally.
_IGNORED_META = {"labels": "labels", "annotations": "labels", "namespace": "labels",
                 "uid": "labels", "resourceVersion": "labels", "creationTimestamp": "labels"}
_IGNORED_SPEC = {
    "serviceAccountName": "identity", "automountServiceAccountToken": "identity",
    "securityContext": "identity", "imagePullSecrets": "identity",
    "executor": "identity",
    "nodeSelector": "scheduling", "tolerations": "scheduling", "affinity": "scheduling",
    "priorityClassName": "scheduling", "podPriorityClassName": "scheduling",
    "schedulerName": "scheduling", "podDisruptionBudget": "scheduling",
    "hostNetwork": "scheduling", "dnsPolicy": "scheduling", "dnsConfig": "scheduling",
    "podGC": "cleanup", "ttlStrategy": "cleanup", "artifactGC": "cleanup",
    "volumeClaimGC": "cleanup",
    "metrics": "observability", "archiveLogs": "observability",
    "parallelism": "concurrency", "synchronization": "concurrency",
    "podMetadata": "labels", "workflowMetadata": "labels",
}
_HANDLED_SPEC = {"entrypoint", "arguments", "templates", "artifactRepositoryRef",
                 "activeDeadlineSeconds", "volumes", "volumeClaimTemplates"}
_REFUSED = {
    "onExit": "exit handlers are not run locally",
    "hooks": "lifecycle hooks are not run locally",
    "templateDefaults": "templateDefaults are not merged by the local runner",
    "workflowTemplateRef": "the local runner needs the compiled Workflow, not a reference",
    "podSpecPatch": "a pod spec patch cannot be applied to a local process",
    "script": "script templates are not supported (use a container template)",
    "steps": "steps templates are not supported (use one dag template)",
    "resource": "resource templates create Kubernetes objects; not run locally",
    "suspend": "suspend templates are not supported",
    "sidecars": "sidecars are not run locally",
    "initContainers": "init containers are not run locally",
    "containerSet": "containerSet templates are not supported",
    "http": "http templates are not supported", "plugin": "plugin templates are not supported",
    "data": "data templates are not supported",
    "daemon": "daemon containers are not supported",
    "withItems": "loops are not supported", "withParam": "loops are not supported",
    "withSequence": "loops are not supported",
    "templateRef": "templateRef needs the referenced template; render a full Workflow",
    "continueOn": "continueOn is not supported",
    "envFrom": "envFrom is not supported (list each variable in env)",
    "fromExpression": "fromExpression is not evaluated locally",
    "valueFrom": "parameters from valueFrom are not resolved locally",
}

_TEMPLATE_HANDLED = {"name", "inputs", "outputs", "container", "dag", "retryStrategy",
                     "memoize", "timeout", "activeDeadlineSeconds", "volumes"}
_TEMPLATE_IGNORED = {
    "metadata": "labels", "nodeSelector": "scheduling", "tolerations": "scheduling",
    "affinity": "scheduling", "priorityClassName": "scheduling", "priority": "scheduling",
    "schedulerName": "scheduling", "securityContext": "identity",
    "serviceAccountName": "identity", "automountServiceAccountToken": "identity",
    "executor": "identity", "metrics": "observability", "parallelism": "concurrency",
    "synchronization": "concurrency",
}
_CONTAINER_HANDLED = {"image", "command", "args", "env", "volumeMounts", "workingDir"}
_CONTAINER_IGNORED = {"name": "labels", "resources": "resources",
                      "imagePullPolicy": "identity", "securityContext": "identity",
                      "terminationMessagePath": "observability",
                      "terminationMessagePolicy": "observability"}
_TASK_KEYS = {"name", "template", "arguments", "depends", "dependencies", "when"}
_RETRY_KEYS = {"limit", "retryPolicy", "backoff", "expression"}
_BACKOFF_KEYS = {"duration", "factor", "maxDuration", "cap"}
RETRY_POLICIES = ("Always", "OnFailure", "OnError", "OnTransientError")


def _reject(path: str, key: str, why: str | None = None) -> LocalRunError:
    why = why or _REFUSED.get(key) or "not supported by the local runner"
    return LocalRunError(f"{path}.{key}: {why}")


def _check_keys(node: Any, path: str, handled: Iterable[str],
                ignored: Mapping[str, str] | None = None, notes: list[str] | None = None) -> None:
    """Refuse every key of ``node`` that is neither handled nor ignored; note ignored ones."""
    if not isinstance(node, dict):
        raise LocalRunError(f"{path}: expected a mapping, got {type(node).__name__}")
    for key in node:
        if key in handled:
            continue
        reason = (ignored or {}).get(key)
        if not reason:
            raise _reject(path, key)
        if notes is not None:
            notes.append(f"ignoring {path}.{key} ({_WHY[reason]})")


def template_map(workflow: dict) -> dict[str, dict]:
    templates = workflow.get("spec", {}).get("templates") or []
    by_name: dict[str, dict] = {}
    for i, template in enumerate(templates):
        name = template.get("name") if isinstance(template, dict) else None
        if not name:
            raise LocalRunError(f"spec.templates[{i}].name: missing")
        if name in by_name:
            raise LocalRunError(f"spec.templates[{name}]: defined twice")
        by_name[name] = template
    return by_name


def check_workflow(workflow: Any, containers: bool = False) -> list[str]:
    """Refuse anything the runner cannot run; return notes about what it ignores.

    ``containers``: the run uses a container executor, which honours securityContext."""
    if not isinstance(workflow, dict):
        raise LocalRunError("workflow: expected the compiled Workflow as a mapping")
    if workflow.get("apiVersion") != "argoproj.io/v1alpha1" or workflow.get("kind") != "Workflow":
        raise LocalRunError("workflow: expected apiVersion argoproj.io/v1alpha1 and kind "
                            f"Workflow, got {workflow.get('apiVersion')!r} "
                            f"{workflow.get('kind')!r} (render --kind workflow)")
    notes: list[str] = []
    _check_keys(workflow, "workflow", {"apiVersion", "kind", "metadata", "spec", "status"})
    metadata = workflow.get("metadata") or {}
    _check_keys(metadata, "metadata", {"name", "generateName"}, _IGNORED_META)
    if not (metadata.get("name") or metadata.get("generateName")):
        raise LocalRunError("metadata: needs name or generateName")
    spec = workflow.get("spec")
    honoured = {"securityContext"} if containers else set()
    _check_keys(spec, "spec", _HANDLED_SPEC | honoured, _IGNORED_SPEC, notes)
    _check_parameters(spec.get("arguments") or {}, "spec.arguments", notes)
    templates = template_map(workflow)
    entry = spec.get("entrypoint")
    if entry not in templates:
        raise LocalRunError(f"spec.entrypoint: template {entry!r} is not defined")
    if "dag" not in templates[entry]:
        raise LocalRunError(f"spec.templates[{entry}]: the entrypoint must be a dag template")
    volumes = _volume_kinds(spec, "spec", notes)
    for name, template in templates.items():
        path = f"spec.templates[{name}]"
        _check_keys(template, path, _TEMPLATE_HANDLED | honoured, _TEMPLATE_IGNORED, notes)
        if "dag" in template:
            if name != entry:
                raise LocalRunError(f"{path}.dag: only the entrypoint may be a dag "
                                    "(nested DAGs are not supported)")
            _check_dag(template["dag"], f"{path}.dag", templates, entry)
        elif "container" in template:
            _check_container(template, path, {**volumes, **_volume_kinds(template, path, notes)},
                             notes, containers)
        else:
            raise LocalRunError(f"{path}: neither a container nor a dag template")
    return list(dict.fromkeys(notes))


def _check_parameters(arguments: dict, path: str, notes: list[str]) -> None:
    _check_keys(arguments, path, {"parameters"})
    for i, param in enumerate(arguments.get("parameters") or []):
        where = f"{path}.parameters[{param.get('name', i)}]"
        _check_keys(param, where, {"name", "value", "default", "enum", "description"})


def _volume_kinds(owner: dict, path: str, notes: list[str]) -> dict[str, str]:
    """Volume name → kind. Declaring a volume is harmless; mounting one is checked later."""
    kinds = {}
    for volume in owner.get("volumes") or []:
        kinds[volume["name"]] = next((k for k in volume if k != "name"), "unknown")
        kinds[f"{volume['name']}:medium"] = (volume.get("emptyDir") or {}).get("medium", "")
    for claim in owner.get("volumeClaimTemplates") or []:
        kinds[claim.get("metadata", {}).get("name", "")] = "persistentVolumeClaim"
        notes.append(f"ignoring {path}.volumeClaimTemplates (no claim is created locally; "
                     "mounting one is refused)")
    return kinds


def _check_dag(dag: dict, path: str, templates: dict[str, dict], entry: str) -> None:
    _check_keys(dag, path, {"tasks", "failFast"})
    seen = set()
    for task in dag.get("tasks") or []:
        name = task.get("name")
        where = f"{path}.tasks[{name}]"
        if not name or name in seen:
            raise LocalRunError(f"{where}: missing or duplicate task name")
        seen.add(name)
        _check_keys(task, where, _TASK_KEYS)
        target = task.get("template")
        if target not in templates:
            raise LocalRunError(f"{where}.template: template {target!r} is not defined")
        if "container" not in templates[target]:
            raise LocalRunError(f"{where}.template: {target!r} is not a container template "
                                "(nested DAGs are not supported)")
        arguments = task.get("arguments") or {}
        _check_keys(arguments, f"{where}.arguments", {"parameters", "artifacts"})
        for param in arguments.get("parameters") or []:
            _check_keys(param, f"{where}.arguments.parameters[{param.get('name')}]",
                        {"name", "value", "description"})
        for art in arguments.get("artifacts") or []:
            _check_keys(art, f"{where}.arguments.artifacts[{art.get('name')}]",
                        {"name", "from", "s3", "raw"})


def _check_container(template: dict, path: str, volumes: dict[str, str],
                     notes: list[str], containers: bool) -> None:
    container = template["container"]
    cpath = f"{path}.container"
    honoured = {"securityContext", "imagePullPolicy"} if containers else set()
    _check_keys(container, cpath, _CONTAINER_HANDLED | honoured, _CONTAINER_IGNORED, notes)
    if not container.get("image"):
        raise LocalRunError(f"{cpath}.image: missing")
    if not container.get("command") and not container.get("args"):
        raise LocalRunError(f"{cpath}.command: missing (the local runner cannot use an "
                            "image's entrypoint)")
    if "workingDir" in container:
        notes.append(f"{cpath}.workingDir: a subprocess runs in the node directory with the "
                     "project on PYTHONPATH; the container executors use workingDir")
    for env in container.get("env") or []:
        where = f"{cpath}.env[{env.get('name')}]"
        _check_keys(env, where, {"name", "value", "valueFrom"})
        if "valueFrom" in env:
            source = env["valueFrom"]
            _check_keys(source, f"{where}.valueFrom",
                        {"secretKeyRef", "configMapKeyRef", "resourceFieldRef"})
            if len(source) != 1:
                raise LocalRunError(f"{where}.valueFrom: expected exactly one reference")
            for kind, ref in source.items():
                _check_keys(ref, f"{where}.valueFrom.{kind}", RESOURCE_FIELD_KEYS
                            if kind == "resourceFieldRef" else {"name", "key", "optional"})
            resource = (source.get("resourceFieldRef") or {}).get("resource", "requests.cpu")
            if resource not in ("requests.cpu", "limits.cpu"):
                raise LocalRunError(f"{where}.valueFrom.resourceFieldRef.resource: "
                                    f"{resource!r} is not resolved locally (requests.cpu and "
                                    "limits.cpu are)")
    for mount in container.get("volumeMounts") or []:
        where = f"{cpath}.volumeMounts[{mount.get('name')}]"
        kind = volumes.get(mount.get("name"))
        if kind is None:
            raise LocalRunError(f"{where}: volume {mount.get('name')!r} is not declared")
        medium = (volumes.get(f"{mount.get('name')}:medium") or "")
        if kind == "emptyDir" and mount.get("mountPath") == SHM:
            if not containers:
                notes.append(f"ignoring {where} (an emptyDir at {SHM}: the host's {SHM} "
                             "serves)")
        elif kind == "emptyDir" and medium == "HugePages":
            notes.append(f"ignoring {where} (a HugePages emptyDir: the host's huge pages "
                         "serve)")
        elif kind != "emptyDir" or medium:
            raise LocalRunError(f"{where}: only emptyDir volumes can be made locally (on disk "
                                f"anywhere, Memory at {SHM}, or HugePages); got "
                                f"{kind}{' ' + medium if medium else ''} at "
                                f"{mount.get('mountPath')}")
        _check_keys(mount, where, {"name", "mountPath", "readOnly"})
    _check_io(template, path, notes)
    if "retryStrategy" in template:
        retry = template["retryStrategy"]
        _check_keys(retry, f"{path}.retryStrategy", _RETRY_KEYS, {"affinity": "scheduling"},
                    notes)
        _check_keys(retry.get("backoff") or {}, f"{path}.retryStrategy.backoff", _BACKOFF_KEYS)
        policy = retry.get("retryPolicy", "OnFailure")
        if policy not in RETRY_POLICIES:
            raise LocalRunError(f"{path}.retryStrategy.retryPolicy: {policy!r} is not one of "
                                f"{', '.join(RETRY_POLICIES)}")
    if "memoize" in template:
        memo = template["memoize"]
        _check_keys(memo, f"{path}.memoize", {"key", "maxAge", "cache"})
        cache = memo.get("cache") or {}
        _check_keys(cache, f"{path}.memoize.cache", {"configMap"})
        if not (cache.get("configMap") or {}).get("name"):
            raise LocalRunError(f"{path}.memoize.cache.configMap.name: missing")
        if not memo.get("key"):
            raise LocalRunError(f"{path}.memoize.key: missing")


def _check_io(template: dict, path: str, notes: list[str]) -> None:
    inputs = template.get("inputs") or {}
    _check_keys(inputs, f"{path}.inputs", {"parameters", "artifacts"})
    for param in inputs.get("parameters") or []:
        _check_keys(param, f"{path}.inputs.parameters[{param.get('name')}]",
                    {"name", "value", "default", "enum", "description"})
    for art in inputs.get("artifacts") or []:
        where = f"{path}.inputs.artifacts[{art.get('name')}]"
        _check_keys(art, where, {"name", "path", "from", "s3", "raw", "optional", "archive",
                                 "description"})
        if not art.get("path"):
            raise LocalRunError(f"{where}.path: missing")
        if "s3" in art:
            _check_keys(art["s3"], f"{where}.s3", {"key"})
    outputs = template.get("outputs") or {}
    _check_keys(outputs, f"{path}.outputs", {"parameters", "artifacts"})
    for param in outputs.get("parameters") or []:
        where = f"{path}.outputs.parameters[{param.get('name')}]"
        _check_keys(param, where, {"name", "valueFrom", "description", "globalName"})
        _check_keys(param.get("valueFrom") or {}, f"{where}.valueFrom", {"path", "default"})
        if not (param.get("valueFrom") or {}).get("path"):
            raise LocalRunError(f"{where}.valueFrom.path: missing")
        if "globalName" in param:
            notes.append(f"ignoring {where}.globalName (workflow-level outputs are an Argo "
                         "UI view; the task's own output is used)")
    for art in outputs.get("artifacts") or []:
        where = f"{path}.outputs.artifacts[{art.get('name')}]"
        _check_keys(art, where, {"name", "path", "archive", "s3", "optional", "description"},
                    {"globalName": "labels", "artifactGC": "cleanup", "deleted": "cleanup"},
                    notes)
        if not art.get("path"):
            raise LocalRunError(f"{where}.path: missing")
        archive = art.get("archive")
        if archive is not None:
            _check_keys(archive, f"{where}.archive", {"none", "tar"})
            if "tar" in archive:
                _check_keys(archive["tar"] or {}, f"{where}.archive.tar", {"compressionLevel"})
        if "s3" in art:
            _check_keys(art["s3"], f"{where}.s3", {"key"})
            if not art["s3"].get("key"):
                raise LocalRunError(f"{where}.s3.key: missing")
