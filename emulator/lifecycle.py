"""One attempt of a container template, as a pod's life runs on a cluster.

The same four stages for both executors: resolve the template (paths, command, env,
deadline), put the input artifacts in place (Argo's init container), run the step
(:mod:`emulator.executors` as a process here, or :mod:`emulator.pods` in its
image), and collect the outputs (the wait container). What differs between the executors
is only where the container paths live: under the pod directory for a process, inside the
container for an image.

- **Paths.** A process sees every container path remapped under ``<run>/<pod>/``, literal
  paths in its command included; a container sees its own paths.
- **Env.** The template's ``env``, with references resolved from a local store that stands
  in for the cluster's objects: a ``secretKeyRef`` from ``secrets`` or, for the S3
  credentials, the run's own S3; a ``configMapKeyRef`` from ``configmaps`` or, for
  ``AWS_ENDPOINT_URL``, the run's S3; an optional reference with no value is left unset. A
  template that receives S3 credentials talks to the run's S3 (endpoint and region), since
  locally that is the object store. A process also gets this machine's environment minus
  every ``AWS_*`` variable; a container gets the template's env alone.
- **Deadlines.** ``timeout`` and ``activeDeadlineSeconds`` of the template, the Workflow's
  ``activeDeadlineSeconds`` and a retry's ``maxDuration`` stop the step.
- **Outputs.** Artifacts are uploaded under the artifact repository's key format
  (:mod:`emulator.transfer`); output parameters are read from ``valueFrom.path`` with
  one trailing newline removed, as Argo's executor does.
"""
from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable, Mapping, TextIO

from emulator import executors, pods, transfer
from emulator.dag import Task
from emulator.errors import LocalRunError
from emulator.expr import substitute
from emulator.results import ArtifactRef, NodeResult
from emulator.s3target import S3Target
from emulator.spec import cpu_field, duration_seconds
from steps.errors import StepError
from steps.storage import KEY_VARS

_OUTPUT_PATH_REF = re.compile(r"\{\{\s*outputs\.artifacts\.([\w\-]+)\.path\s*\}\}")


_PEAKS = ("max_rss_bytes", "max_anon_bytes", "max_disk_bytes")


def _add_usage(node: NodeResult, outcome: executors.Outcome) -> None:
    """Fold an attempt's CPU time (summed), peak memories and peak disk (the largest) into
    ``node``; each unknown for the node once any attempt's is unknown."""
    first = node.attempts <= 1
    node.cpu_seconds = _fold(first, node.cpu_seconds, outcome.cpu_seconds, lambda a, b: a + b)
    for name in _PEAKS:
        setattr(node, name, _fold(first, getattr(node, name), getattr(outcome, name), max))


def _fold(first: bool, total, value, combine):
    if first:
        return value
    return None if total is None or value is None else combine(total, value)


@dataclass(frozen=True)
class ContainerPaths:
    """Container paths of a template's input and output artifacts and output parameters."""
    inputs: dict[str, str]
    outputs: dict[str, str]
    params: dict[str, str]

    @property
    def scope(self) -> dict[str, str]:
        return {**{f"inputs.artifacts.{k}.path": v for k, v in self.inputs.items()},
                **{f"outputs.artifacts.{k}.path": v for k, v in self.outputs.items()},
                **{f"outputs.parameters.{k}.path": v for k, v in self.params.items()}}

    @property
    def every(self) -> list[str]:
        return [*self.inputs.values(), *self.outputs.values(), *self.params.values()]


def container_paths(template: dict, scope: dict, where: str) -> ContainerPaths:
    """The template's artifact and parameter paths, resolved (outputs may name each other)."""
    inputs = {a["name"]: substitute(a["path"], scope, f"{where}.inputs.artifacts"
                                                      f"[{a['name']}].path")
              for a in (template.get("inputs") or {}).get("artifacts") or []}
    outs = {a["name"]: a["path"] for a in (template.get("outputs") or {}).get("artifacts")
            or []}
    view = {**scope, **{f"inputs.artifacts.{k}.path": v for k, v in inputs.items()}}
    for _ in range(len(outs) + 1):
        view.update({f"outputs.artifacts.{k}.path": v for k, v in outs.items()})
        pending = {k: v for k, v in outs.items() if "{{" in v}
        if not pending:
            break
        for k, v in pending.items():
            if all("{{" not in outs.get(r, "") for r in _OUTPUT_PATH_REF.findall(v)):
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
    return ContainerPaths(inputs, outs, params)


def remap(items: list[str], known: list[str], host: Callable[[str], Path]) -> list[str]:
    """Literal container paths in a command (``/data/raw``, ``--x=/data/raw/a``) on the host."""
    def one(text: str) -> str:
        flag, eq, value = text.partition("=") if text.startswith("-") else ("", "", text)
        for path in known:
            if value == path or value.startswith(path.rstrip("/") + "/"):
                return flag + eq + str(host(path)) + value[len(path):]
        return text
    return [one(item) for item in items]


def free_volumes(pod_dir: Path) -> None:
    """What the kubelet does with a finished pod's volumes: everything in its folder but its
    log goes. Kubernetes v1.35.4's volume manager drops a pod's volumes from its desired state
    once the pod worker reports it terminated, deleted or not
    (``findAndRemoveDeletedPods`` in pkg/kubelet/volumemanager/populator/
    desired_state_of_world_populator.go, ``ShouldPodRuntimeBeRemoved`` in
    pkg/kubelet/pod_workers.go), and tearing an emptyDir down removes its folder
    (``teardownDefault`` in pkg/volume/emptydir/empty_dir.go). The log stays, as Argo
    archives it (``archiveLogs``)."""
    for entry in pod_dir.iterdir():
        if entry.name == "main.log":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


@dataclass
class AttemptPlan:
    """One attempt, resolved: where its files live and what runs (a process or a pod)."""
    pod_dir: Path
    paths: ContainerPaths
    scope: dict[str, str]
    key_prefix: str
    timeout: float | None
    launch: executors.Launch | None = None
    pod: pods.Pod | None = None

    def host(self, path: str) -> Path:
        """Where a container path's files are on this machine."""
        return self.pod_dir / path.lstrip("/")


@dataclass
class Lifecycle:
    """What every pod of one run shares; :meth:`attempt` runs one."""
    workflow: str
    spec: dict
    globals: dict[str, str]
    root: Path
    env: Mapping[str, str]
    bucket: str
    target: S3Target
    secrets: Mapping[str, Mapping[str, str]]
    configmaps: Mapping[str, Mapping[str, str]]
    key_format: str
    engine: pods.Engine | None
    echo: TextIO | None
    network: str
    log: Callable[[str], None]
    note: Callable[[str], None]
    deadline: float | None = None
    paths: dict[tuple[str, str], str] = field(default_factory=dict)  # (task, artifact) → path

    def attempt(self, task: Task, inputs: dict[str, str],
                artifacts: dict[str, ArtifactRef | str], node: NodeResult,
                node_name: str, attempt: int, cutoff: float | None) -> int | None:
        """Inputs in, the step, outputs out. Sets node.phase; returns the exit code (None
        when the step never ran). ``cutoff``: the retry deadline (monotonic)."""
        pod_dir = self.root / node.pod_name
        if pod_dir.exists():
            shutil.rmtree(pod_dir)
        pod_dir.mkdir(parents=True)
        node.log_path = str(pod_dir / "main.log")
        try:
            return self._attempt(task, inputs, artifacts, node, node_name, attempt, cutoff,
                                 pod_dir)
        finally:
            free_volumes(pod_dir)

    def _attempt(self, task: Task, inputs: dict[str, str],
                 artifacts: dict[str, ArtifactRef | str], node: NodeResult, node_name: str,
                 attempt: int, cutoff: float | None, pod_dir: Path) -> int | None:
        try:
            plan = self.plan(task, inputs, node, node_name, attempt, pod_dir, cutoff)
            self._place_inputs(task, plan, artifacts)
            if plan.launch is not None:
                outcome = executors.run(plan.launch, self.echo)
            else:
                outcome = pods.run(self.engine, plan.pod, plan.host, pod_dir / "main.log",
                                   plan.timeout, self.echo)
        except StepError as exc:
            node.phase, node.message = "Error", self.scrub(str(exc))
            return None
        node.step_seconds += outcome.seconds
        _add_usage(node, outcome)
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
            node.phase, node.message = "Error", self.scrub(str(exc))
            return 0
        node.phase, node.message = "Succeeded", ""
        return 0

    def _place_inputs(self, task: Task, plan: AttemptPlan,
                      artifacts: dict[str, ArtifactRef | str]) -> None:
        """Argo's init container: each input at its path; a failed load makes the node an
        Error before the step runs."""
        for name, ref in artifacts.items():
            dest = plan.host(plan.paths.inputs[name])
            if isinstance(ref, str):
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(ref)
                continue
            try:
                transfer.download_input(ref, dest)
            except StepError as exc:
                raise LocalRunError(f"artifact {name} failed to load: {exc}") from None
            self.log(f"{task.name}:   {name} ← {ref.uri}")

    def plan(self, task: Task, inputs: dict[str, str], node: NodeResult, node_name: str,
             attempt: int, pod_dir: Path, cutoff: float | None) -> AttemptPlan:
        """Resolve the template for one attempt. Its deadline runs from here, as a pod's
        does from its start (inputs included)."""
        where = f"spec.templates[{task.template_name}]"
        template = task.template
        scope = {**self.globals, **{f"inputs.parameters.{k}": v for k, v in inputs.items()},
                 "pod.name": node.pod_name, "node.name": node_name, "retries": str(attempt)}
        paths = container_paths(template, scope, where)
        plan = AttemptPlan(pod_dir, paths, scope, "", None)
        in_image = self.engine is not None
        scope.update({k: (v if in_image else str(plan.host(v)))
                      for k, v in paths.scope.items()})
        container = template["container"]
        command, args = container.get("command") or [], container.get("args") or []
        if not in_image:  # literal container paths first; placeholders resolve to host paths
            known = sorted(paths.every, key=len, reverse=True)
            command, args = (remap(x, known, plan.host) for x in (command, args))
        command = substitute(command, scope, f"{where}.container.command")
        args = substitute(args, scope, f"{where}.container.args")
        env = self._env(template, scope, where)
        plan.key_prefix = substitute(self.key_format, scope, "artifact repository keyFormat")
        plan.timeout = self._timeout(template, scope, where, cutoff)
        if in_image:
            plan.pod = self._pod(template, scope, command, args, env, plan, where)
            stale = self.engine.stale(plan.pod.image)
            if stale:
                self.note(stale)
            return plan
        for path in paths.outputs.values():   # a container's outputs are copied out after
            plan.host(path).parent.mkdir(parents=True, exist_ok=True)
        base = {k: v for k, v in self.env.items() if not k.startswith("AWS_")}
        plan.launch = executors.Launch(
            executors.subprocess_argv(command + args),
            executors.with_project_path({**base, **env}), pod_dir, pod_dir / "main.log",
            plan.timeout)
        return plan

    def _env(self, template: dict, scope: dict, where: str) -> dict[str, str]:
        """The template's env, references resolved; S3 users get the run's endpoint/region."""
        env: dict[str, str] = {}
        for item in template["container"].get("env") or []:
            name = item["name"]
            ewhere = f"{where}.container.env[{name}]"
            if "resourceFieldRef" in (item.get("valueFrom") or {}):
                env[name] = cpu_field(template["container"].get("resources") or {},
                                      item["valueFrom"]["resourceFieldRef"], ewhere)
            elif "valueFrom" in item:
                value = self._reference(name, item["valueFrom"], ewhere)
                if value is not None:
                    env[name] = value
            else:
                env[name] = substitute(str(item.get("value", "")), scope, ewhere)
        if any(name in env for name in KEY_VARS):
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
             env: dict[str, str], plan: AttemptPlan, where: str) -> pods.Pod:
        container = template["container"]
        limits = {**((container.get("resources") or {}).get("requests") or {}),
                  **((container.get("resources") or {}).get("limits") or {})}
        user, groups = pods.security(self.spec, template, where)
        outputs = plan.paths.outputs
        optional = {outputs[a["name"]] for a in (template.get("outputs") or {}).get(
            "artifacts") or [] if a.get("optional")}
        return pods.Pod(
            name=scope["pod.name"],
            image=substitute(container["image"], scope, f"{where}.container.image"),
            pull_policy=container.get("imagePullPolicy", "IfNotPresent"),
            command=command, args=args, env=env,
            volumes=pods.volumes(self.spec, template, where),
            inputs={path: plan.host(path) for path in plan.paths.inputs.values()},
            outputs=[*outputs.values(), *plan.paths.params.values()],
            optional_outputs=optional, user=user, groups=groups,
            workdir=container.get("workingDir"),
            gpus=int(limits.get("nvidia.com/gpu", 0) or 0),
            hpus=int(limits.get("habana.ai/gaudi", 0) or 0),
            network=self.network)

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

    def _collect(self, task: Task, node: NodeResult, plan: AttemptPlan) -> None:
        """The wait container: upload the output artifacts, read the output parameters."""
        outputs = task.template.get("outputs") or {}
        for spec in outputs.get("artifacts") or []:
            name = spec["name"]
            path = plan.paths.outputs[name]
            local = plan.host(path)
            if not local.exists():
                if spec.get("optional"):
                    continue
                raise LocalRunError(f"output artifact {name!r}: {path} was not written by "
                                    "the step")
            explicit = (spec.get("s3") or {}).get("key")
            if explicit:
                explicit = substitute(explicit, plan.scope,
                                      f"spec.templates[{task.template_name}].outputs"
                                      f".artifacts[{name}].s3.key")
            key = transfer.output_key({**spec, "path": path}, plan.key_prefix, explicit)
            node.artifacts[name] = transfer.upload_output(spec, local, self.bucket, key)
            self.paths[(task.name, name)] = path
        for spec in outputs.get("parameters") or []:
            name = spec["name"]
            path = plan.host(plan.paths.params[name])
            if path.is_file():
                text = path.read_text(errors="replace")
                node.parameters[name] = text[:-1] if text.endswith("\n") else text
            elif "default" in spec["valueFrom"]:
                # rendered with the pod's own scope, pod.name too, as the controller renders
                # the whole template before the pod exists (v4.0.5 operator.go executeTemplate)
                node.parameters[name] = substitute(
                    str(spec["valueFrom"]["default"]), plan.scope,
                    f"spec.templates[{task.template_name}].outputs.parameters[{name}]"
                    ".valueFrom.default")
            else:
                raise LocalRunError(f"output parameter {name!r}: {plan.paths.params[name]} "
                                    "was not written by the step")

    def scrub(self, text: str) -> str:
        """``text`` on one line with every secret value of this run masked."""
        secrets = [self.target.secret_key]
        secrets += [str(v) for keys in self.secrets.values() for v in keys.values()]
        for secret in secrets:
            if secret:
                text = text.replace(secret, "***")
        return " ".join(text.split())
