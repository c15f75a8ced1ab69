"""Pod contracts: what a cluster would break in a compiled workflow that Argo's schema allows.

Each rule returns one-line problems (empty: it holds). They come from reading the real
systems (argo-workflows v4.1.2, kubeflow/training-operator v1.9.0):

- **writable outputs**: the images run as a non-root uid, and Argo mounts only the input
  artifacts and the template's volumes. A path on no declared volume lies in the image's
  root-owned filesystem (or in a directory that runc made as root for an input mount), so
  the step cannot create it. Every output path must be on a declared, writable volume.
- **deadlines**: every step has ``activeDeadlineSeconds``, which the kubelet counts from the
  pod's start on the node, so a pod queued for room is never failed by it; not a template
  ``timeout``, which the controller counts from the node's start and fails while it is still
  Pending (v4.0.5 operator.go checkTemplateTimeout). A retry ``backoff.maxDuration``
  (counted by the controller from the first attempt's start, and enforced on later attempts)
  must leave room for every attempt to run to its deadline.
- **multi-node job**: the PyTorchJob's ``nprocPerNode`` is the step's ``--devices`` and its
  pod count the step's ``--nodes``; pods can fail (not ``OnFailure``/``Always``); the failure
  condition reads ``status.conditions`` (a job failed by ``backoffLimit`` or its deadline only
  gains a Failed condition); the job has a deadline; every path the step writes is on a
  volume.
- **memoized retries**: no template both memoizes and retries; a cache hit of such a template
  leaves the DAG Running forever on Argo v4 (``memoized_retries``, seen on a real controller).
- **references**: a Secret or ConfigMap that a pod needs must exist on every overlay of
  ``manifests/overlays``, or the pod never starts (``CreateContainerConfigError``); an
  optional ConfigMap reference must still name one that the overlays make, or a setting
  silently goes missing.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path, PurePosixPath
from typing import Iterator

import yaml

from workflows import durations

OVERLAYS = Path(__file__).resolve().parent.parent / "manifests" / "overlays"
WRITABLE_VOLUMES = ("emptyDir", "persistentVolumeClaim", "ephemeral")
_OUTPUT_PATH = re.compile(r"\{\{\s*outputs\.artifacts\.([\w-]+)\.path\s*\}\}")


def _templates(doc: dict) -> list[dict]:
    return doc["spec"]["templates"]


def pytorch_jobs(doc: dict) -> Iterator[tuple[dict, dict]]:
    """(resource template, its PyTorchJob) for every PyTorchJob the workflow creates."""
    for tmpl in _templates(doc):
        manifest = (tmpl.get("resource") or {}).get("manifest")
        if manifest:
            job = yaml.safe_load(manifest)
            if isinstance(job, dict) and job.get("kind") == "PyTorchJob":
                yield tmpl, job


def _replicas(job: dict) -> dict[str, dict]:
    return (job.get("spec") or {}).get("pytorchReplicaSpecs") or {}


def _job_containers(job: dict) -> Iterator[tuple[str, dict, dict]]:
    """(replica type, pod spec, container) of every container of the job's pods."""
    for replica, spec in _replicas(job).items():
        pod = (spec.get("template") or {}).get("spec") or {}
        for container in pod.get("containers") or []:
            yield replica, pod, container


# ---- writable outputs --------------------------------------------------------------------
def _not_writable(path: str, mounts: list[dict], volumes: dict[str, dict]) -> str:
    """Why ``path`` is not on a writable volume (empty: it is), by the longest mount holding
    it, as Argo's ``FindOverlappingVolume`` picks it."""
    holding = [m for m in mounts if PurePosixPath(path).is_relative_to(m["mountPath"])]
    if not holding:
        return "is on no declared volume"
    best = max(holding, key=lambda m: len(PurePosixPath(m["mountPath"]).parts))
    volume = volumes.get(best["name"], {})
    kind = next((k for k in volume if k != "name"), "")
    if best.get("readOnly"):
        return f"is on volume {best['name']!r}, mounted read-only"
    if kind not in WRITABLE_VOLUMES:
        return f"is on volume {best['name']!r} of kind {kind or 'unknown'}"
    return ""


def _output_paths(tmpl: dict) -> Iterator[tuple[str, str]]:
    outputs = tmpl.get("outputs") or {}
    paths = {a["name"]: a["path"] for a in outputs.get("artifacts") or []}
    resolve = lambda p: _OUTPUT_PATH.sub(lambda m: paths.get(m.group(1), m.group(0)), p)  # noqa
    for name, path in paths.items():
        yield f"output artifact {name}", resolve(path)
    for param in outputs.get("parameters") or []:
        path = (param.get("valueFrom") or {}).get("path")
        if path:
            yield f"output parameter {param['name']}", resolve(path)


def writable_outputs(doc: dict) -> list[str]:
    """Every output path of a container template lies on a declared, writable volume."""
    shared = {v["name"]: v for v in doc["spec"].get("volumes") or []}
    problems = []
    for tmpl in _templates(doc):
        if "container" not in tmpl:
            continue
        volumes = {**shared, **{v["name"]: v for v in tmpl.get("volumes") or []}}
        mounts = tmpl["container"].get("volumeMounts") or []
        for what, path in _output_paths(tmpl):
            why = _not_writable(path, mounts, volumes)
            if why:
                problems.append(f"pods: template {tmpl['name']} {what} at {path} {why}; a "
                                "non-root step cannot write it (mount a work volume there)")
    for tmpl, job in pytorch_jobs(doc):
        for replica, pod, container in _job_containers(job):
            volumes = {v["name"]: v for v in pod.get("volumes") or []}
            for path in _train_paths(container):
                why = _not_writable(path, container.get("volumeMounts") or [], volumes)
                if why:
                    problems.append(f"pods: template {tmpl['name']} PyTorchJob {replica} "
                                    f"writes {path}, which {why}")
    return problems


def _train_args(container: dict) -> list[str]:
    """The ``steps.train`` arguments inside a job container's command (a shell script)."""
    words = shlex.split(" ".join(container.get("command") or []
                                 + container.get("args") or []))
    for i, word in enumerate(words):
        if word == "steps.train" and i > 0 and words[i - 1] == "-m":
            end = next((j for j in range(i, len(words)) if words[j] in ("&&", ";", "||")),
                       len(words))
            return words[i + 1:end]
    return []


def _flag(args: list[str], name: str) -> str | None:
    for i, word in enumerate(args[:-1]):
        if word == name:
            return args[i + 1]
    return None


def _train_paths(container: dict) -> list[str]:
    args = _train_args(container)
    return [p for p in (_flag(args, "--dataset"), _flag(args, "--model")) if p]


# ---- deadlines ---------------------------------------------------------------------------
def _seconds(tmpl: dict, field: str, value) -> float:
    try:
        return durations.seconds(value)
    except ValueError as e:
        raise ValueError(f"spec.templates[{tmpl['name']}].{field}: {e}") from None


def _deadline(tmpl: dict) -> float | None:
    value = tmpl.get("activeDeadlineSeconds")
    if value in (None, "") or "{{" in str(value):
        return None
    return _seconds(tmpl, "activeDeadlineSeconds", value)


def _backoff_total(tmpl: dict, attempts: int) -> float:
    backoff = tmpl["retryStrategy"].get("backoff") or {}
    wait = _seconds(tmpl, "retryStrategy.backoff.duration", backoff.get("duration", 0) or 0)
    factor = float(backoff.get("factor", 1))
    cap = _seconds(tmpl, "retryStrategy.backoff.cap", backoff["cap"]) \
        if backoff.get("cap") else None
    return sum(min(wait * factor ** n, cap) if cap else wait * factor ** n
               for n in range(attempts - 1))


def deadlines(doc: dict) -> list[str]:
    """Every step has a deadline; no retry deadline cuts off an attempt that is in time."""
    problems = []
    for tmpl in _templates(doc):
        if not ({"container", "resource", "script"} & set(tmpl)):
            continue
        deadline = _deadline(tmpl)
        if deadline is None:
            problems.append(f"pods: template {tmpl['name']} has no activeDeadlineSeconds; a "
                            "hung step would hold its node forever")
        if tmpl.get("timeout"):
            problems.append(f"pods: template {tmpl['name']} has a timeout, which fails its "
                            "pod while it waits Pending for room; use activeDeadlineSeconds")
        retry = tmpl.get("retryStrategy") or {}
        cutoff = (retry.get("backoff") or {}).get("maxDuration")
        if not cutoff:
            continue
        attempts = int(retry.get("limit", 0)) + 1
        needed = (deadline or float("inf")) * attempts + _backoff_total(tmpl, attempts)
        if _seconds(tmpl, "retryStrategy.backoff.maxDuration", cutoff) < needed:
            problems.append(
                f"pods: template {tmpl['name']} retryStrategy.backoff.maxDuration {cutoff} is "
                f"shorter than its {attempts} attempts can run ("
                + (f"{needed:.0f} s" if deadline else "no step deadline")
                + "); Argo counts it from the first attempt and stops later ones, so a "
                "long step is never retried")
    return problems


# ---- multi-node job ----------------------------------------------------------------------
def multinode_job(doc: dict) -> list[str]:
    return [p for tmpl, job in pytorch_jobs(doc) for p in _job_problems(tmpl, job)]


def _job_problems(tmpl: dict, job: dict) -> list[str]:
    spec = job.get("spec") or {}
    replicas = _replicas(job)
    where = f"pods: template {tmpl['name']} PyTorchJob"
    problems = []
    if "Master" not in replicas:
        problems.append(f"{where} has no Master replica (no WORLD_SIZE, no rendezvous)")
    pods = sum(int(r.get("replicas", 1)) for r in replicas.values())
    nproc = str(spec.get("nprocPerNode", "auto"))
    for replica, rspec in replicas.items():
        policy = rspec.get("restartPolicy", "OnFailure")
        if policy in ("OnFailure", "Always"):
            problems.append(f"{where} {replica} restartPolicy {policy}: a failed container "
                            "restarts in place, its pod never fails and the job hangs "
                            "(use ExitCode or Never)")
    for replica, _, container in _job_containers(job):
        args = _train_args(container)
        if not args:
            continue
        devices, nodes = _flag(args, "--devices") or "1", _flag(args, "--nodes") or "1"
        if devices != nproc:
            problems.append(f"{where} {replica}: nprocPerNode {nproc!r} is not the step's "
                            f"--devices {devices!r}, so WORLD_SIZE is not what the step "
                            "expects")
        if nodes != str(pods):
            problems.append(f"{where} {replica}: {pods} pods but the step's --nodes is "
                            f"{nodes}")
    failure = tmpl["resource"].get("failureCondition", "")
    if "status.conditions" not in failure:
        problems.append(f"{where}: failureCondition {failure!r} cannot see a job failed by "
                        "backoffLimit or its deadline (only a Failed condition is added); "
                        "the node would wait forever")
    if not (spec.get("runPolicy") or {}).get("activeDeadlineSeconds"):
        problems.append(f"{where} has no runPolicy.activeDeadlineSeconds")
    return problems


# ---- references --------------------------------------------------------------------------
def overlay_objects(directory: Path) -> set[tuple[str, str]]:
    """(kind, name) of every object a kustomization creates from its local resources."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text()) or {}
    found: set[tuple[str, str]] = set()
    for resource in kustomization.get("resources") or []:
        if "://" in resource:  # a remote manifest (Habana's device plugin)
            continue
        path = directory / resource
        if path.is_dir():
            found |= overlay_objects(path)
            continue
        for item in yaml.safe_load_all(path.read_text()):
            if isinstance(item, dict) and item.get("kind"):
                found.add((item["kind"], item["metadata"]["name"]))
    return found


def _containers(doc: dict) -> Iterator[tuple[str, dict]]:
    """(template name, container) of every container template and every job pod."""
    for tmpl in _templates(doc):
        if "container" in tmpl:
            yield tmpl["name"], tmpl["container"]
    for tmpl, job in pytorch_jobs(doc):
        for _, _, container in _job_containers(job):
            yield tmpl["name"], container


def _env_refs(doc: dict) -> Iterator[tuple[str, str, str, str, bool]]:
    """(template, env var, kind, object name, optional) of every Secret/ConfigMap env ref."""
    for name, container in _containers(doc):
        for var in container.get("env") or []:
            source = var.get("valueFrom") or {}
            for key, kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
                if key in source:
                    ref = source[key]
                    yield (name, var["name"], kind, ref.get("name", ""),
                           bool(ref.get("optional")))


def references(doc: dict, overlays: Path = OVERLAYS) -> list[str] | None:
    """None where the overlays are not there (an installed package without manifests/)."""
    if not overlays.is_dir():
        return None
    made = {d.name: overlay_objects(d) for d in sorted(overlays.iterdir())
            if (d / "kustomization.yaml").is_file()}
    problems = []
    for template, var, kind, name, optional in _env_refs(doc):
        if optional and kind == "Secret":
            continue
        for overlay, objects in made.items():
            if (kind, name) not in objects:
                effect = ("the setting would silently be missing" if optional else
                          "its pods would never start")
                problems.append(f"references: template {template} env {var} needs {kind} "
                                f"{name!r}, which overlay {overlay} does not create; {effect}")
    return list(dict.fromkeys(problems))


def memoized_retries(doc: dict) -> list[str]:
    """No template both memoizes and retries. On a cache hit Argo's controller (v4.0.5, and
    v4.1.2 unchanged) makes a Retry node with no attempt; ``getOutboundNodes`` gives a Retry
    node's last attempt as its outbound node (none here), so the tasks that depend on it are
    never linked as its children, and ``assessDAGPhase`` (dag.go), which walks children, never
    reaches them: the DAG stays Running after every task has succeeded. Seen on the real
    controller (issue 23)."""
    return [f"pods: template {t['name']} has memoize and a retryStrategy; a cache hit leaves "
            "the DAG Running forever on Argo v4 (drop one of them)"
            for t in _templates(doc) if t.get("memoize") and t.get("retryStrategy")]


def pod_rules(doc: dict) -> tuple[list[str], list[str]]:
    """All pod contracts; returns (problems, notes)."""
    problems = (writable_outputs(doc) + deadlines(doc) + multinode_job(doc)
                + memoized_retries(doc))
    notes = []
    refs = references(doc)
    if refs is None:
        notes.append(f"references: skipped, {OVERLAYS} is absent")
    else:
        problems += refs
    return problems, notes
