"""One container template run in its image as Argo runs its pod, with podman or docker.

What Argo and the kubelet do (argo-workflows v4.1.2 ``workflow/controller/workflowpod.go``,
``workflow/executor/executor.go``, ``cmd/argoexec/commands/emissary.go``), and what this does
in their place. No host path is mounted into the container:

- **Volumes.** Only the template's declared volumes exist. A disk ``emptyDir`` is a named
  volume that the kubelet makes writable for the pod (mode 2777, group ``fsGroup``); an
  ``emptyDir`` at ``/dev/shm`` is ``--shm-size``; a ``HugePages`` one is left out (no huge
  pages here). An input artifact that is on no volume gets a volume of its own at its path,
  as Argo's ``input-artifacts`` subPath mounts do; the runtime then creates the missing
  parent directories as root, exactly as runc does in a pod.
- **User.** ``runAsUser``/``runAsGroup`` of the container, else the template's, else the
  Workflow's securityContext, plus ``fsGroup`` and ``supplementalGroups`` as extra groups; a
  uid 0 under ``runAsNonRoot`` is refused as the kubelet refuses it.
- **Inputs** (the init container): each artifact is copied to its path, under a volume when
  it lies on one, owned by the pod's user.
- **Env**: the template's variables only (Secret and ConfigMap references already resolved
  by the runner from its local store), passed by name so no value is on a command line.
- **Outputs** (the wait container, or the emissary's copy for paths on no volume): after
  the main container exits 0, each output path is copied out of the stopped container; a
  path the step did not write is an error, as in the wait container.
- **Deadline**: past it the container is killed, as the kubelet does for
  ``activeDeadlineSeconds``.
- **Cleanup**: the container and its volumes are removed afterwards (the pod's GC); its log
  stays in the run directory.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable, TextIO

from emulator import executors
from emulator.errors import LocalRunError

ENGINES = ("podman", "docker")
PROJECT_ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", ".ci/constraints.txt", "steps")  # what a step runs, at which versions
SOURCES_LABEL = "unet-argo.sources"
PULL = {"Always": "always", "IfNotPresent": "missing", "Never": "never"}
SHM = "/dev/shm"
ENGINE_ENV = ("PATH", "HOME", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME", "CONTAINERS_CONF",
              "CONTAINERS_STORAGE_CONF", "CONTAINER_HOST", "DOCKER_HOST", "DOCKER_CONFIG",
              "TMPDIR")


@dataclass
class Volume:
    name: str
    mount_path: str
    medium: str = ""              # "", "Memory" or "HugePages"
    size_bytes: int | None = None
    read_only: bool = False


@dataclass
class Pod:
    """Everything about one attempt's pod that the engine needs."""
    name: str
    image: str
    pull_policy: str
    command: list[str]
    args: list[str]
    env: dict[str, str]
    volumes: list[Volume]
    inputs: dict[str, Path]        # container path -> host copy, downloaded by the runner
    outputs: list[str]             # container paths to bring back (optional ones marked)
    optional_outputs: set[str] = field(default_factory=set)
    user: str | None = None        # "uid[:gid]"
    groups: list[int] = field(default_factory=list)
    workdir: str | None = None
    gpus: int = 0
    hpus: int = 0
    network: str = "host"


def security(spec: dict, template: dict, where: str) -> tuple[str | None, list[int]]:
    """``--user`` and extra groups from the pod and container securityContexts."""
    layers = [spec.get("securityContext") or {}, template.get("securityContext") or {},
              template["container"].get("securityContext") or {}]
    merged: dict = {}
    for layer in layers:
        merged.update({k: v for k, v in layer.items() if v is not None})
    uid, gid = merged.get("runAsUser"), merged.get("runAsGroup")
    if merged.get("runAsNonRoot") and uid == 0:
        raise LocalRunError(f"{where}.securityContext: runAsUser 0 with runAsNonRoot: the "
                            "kubelet would refuse to start this container")
    user = None if uid is None else (f"{uid}:{gid}" if gid is not None else str(uid))
    pod = {**layers[0], **layers[1]}
    groups = [g for g in [pod.get("fsGroup"), *(pod.get("supplementalGroups") or [])]
              if g is not None]
    return user, list(dict.fromkeys(int(g) for g in groups))


def volumes(spec: dict, template: dict, where: str) -> list[Volume]:
    """The template's mounted volumes (every one an emptyDir: the spec check refused others)."""
    declared = {v["name"]: v for v in (spec.get("volumes") or []) + (template.get("volumes")
                                                                     or [])}
    found = []
    for mount in template["container"].get("volumeMounts") or []:
        empty = declared[mount["name"]].get("emptyDir") or {}
        size = empty.get("sizeLimit")
        found.append(Volume(mount["name"], mount["mountPath"], empty.get("medium", ""),
                            executors.quantity_bytes(size, f"{where}.volumes[{mount['name']}]")
                            if size else None, bool(mount.get("readOnly"))))
    return found


def source_digest(root: Path = PROJECT_ROOT) -> str:
    """sha256 over the files an image installs (``containers/podman/build.sh`` labels the
    image with it), so a run can tell an image built from other sources."""
    digest = hashlib.sha256()
    for top in SOURCES:
        base = root / top
        files = [base] if base.is_file() else sorted(
            p for p in base.rglob("*") if p.is_file() and "__pycache__" not in p.parts
            and p.suffix != ".pyc")
        for path in files:
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


class Engine:
    """The podman or docker command line."""

    def __init__(self, binary: str):
        if Path(binary).name not in ENGINES:
            raise LocalRunError(f"container engine {binary!r}: expected podman or docker")
        self.binary = binary
        self.env = {k: v for k, v in os.environ.items() if k in ENGINE_ENV}
        self._stale: dict[str, str] = {}    # image -> stale(), asked once per image

    def __call__(self, *args: str, check: bool = True,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """``env``: variables that ``-e NAME`` arguments take their values from."""
        try:
            done = subprocess.run([self.binary, *args], env={**self.env, **(env or {})},
                                  capture_output=True, text=True, timeout=600)
        except FileNotFoundError:
            raise LocalRunError(f"{self.binary} is not installed (containers/podman/setup.sh "
                                "installs podman)") from None
        if check and done.returncode != 0:
            message = " ".join((done.stderr or done.stdout).split())[-400:]
            raise LocalRunError(f"{self.binary} {args[0]}: {message}")
        return done

    def labels(self, image: str) -> dict[str, str] | None:
        """The image's labels, or None when the image is not here."""
        done = self("image", "inspect", "--format", "{{json .Labels}}", image, check=False)
        if done.returncode != 0:
            return None
        return json.loads(done.stdout or "null") or {}

    def stale(self, image: str) -> str:
        """Why ``image`` may not run this checkout's code (empty: it does, or cannot tell)."""
        if image not in self._stale:
            built = (self.labels(image) or {}).get(SOURCES_LABEL)
            fresh = built is None or built == source_digest()
            self._stale[image] = "" if fresh else (
                f"image {image} was built from other sources than this checkout's steps/ "
                "(rebuild: containers/podman/build.sh)")
        return self._stale[image]


def run(engine: Engine, pod: Pod, host: Callable[[str], Path], log_path: Path,
        timeout: float | None, echo: TextIO | None) -> executors.Outcome:
    """Create the pod's volumes and container, place inputs, run, copy outputs, clean up."""
    made: list[str] = []
    try:
        mounts = _make_volumes(engine, pod, made)
        engine("create", *_create_args(pod, mounts), env=pod.env)
        for path, source in pod.inputs.items():
            own_volume = any(target == path for _, target, _ in mounts)
            engine("cp", f"{source}/." if own_volume and source.is_dir() else str(source),
                   f"{pod.name}:{path}")
        launch = executors.Launch([engine.binary, "start", "--attach", pod.name],
                                  engine.env, log_path.parent, log_path, timeout,
                                  stop=[engine.binary, "kill", pod.name])
        outcome = executors.run(launch, echo)
        # the engine client's, not the step's
        outcome.cpu_seconds = outcome.max_rss_bytes = outcome.max_anon_bytes = None
        outcome.max_disk_bytes = None
        if outcome.returncode == 0 and not outcome.timed_out:
            _copy_outputs(engine, pod, host)
        return outcome
    finally:
        engine("rm", "--force", pod.name, check=False)
        for volume in made:
            engine("volume", "rm", "--force", volume, check=False)


def _make_volumes(engine: Engine, pod: Pod, made: list[str]) -> list[tuple[str, str, str]]:
    """(engine volume, container path, ":ro" or "") for every mount; the kubelet's emptyDir
    permissions."""
    mounts, writable = [], []
    for volume in pod.volumes:
        if volume.mount_path == SHM or volume.medium == "HugePages":
            continue  # --shm-size; no huge pages here (the spec check refused other media)
        name = f"{pod.name}-{volume.name}"
        engine("volume", "create", name)
        made.append(name)
        mounts.append((name, volume.mount_path, ":ro" if volume.read_only else ""))
        writable.append(name)
    for i, path in enumerate(sorted(pod.inputs)):
        if not any(PurePosixPath(path).is_relative_to(target) for _, target, _ in mounts):
            name = f"{pod.name}-input-{i}"
            engine("volume", "create", name)
            made.append(name)
            mounts.append((name, path, ""))
    if writable:
        group = str(pod.groups[0]) if pod.groups else "0"
        targets = [f"/volumes/{i}" for i in range(len(writable))]
        engine("run", "--rm", "--network", "none", "--user", "0:0", "--pull", "never",
               *[a for i, n in enumerate(writable) for a in ("-v", f"{n}:{targets[i]}")],
               "--entrypoint", "sh", pod.image, "-c",
               f"chgrp {group} {' '.join(targets)} && chmod 2777 {' '.join(targets)}")
    return mounts


def _create_args(pod: Pod, mounts: list[tuple[str, str, str]]) -> list[str]:
    args = ["--name", pod.name, "--pull", PULL.get(pod.pull_policy, "missing"),
            "--network", pod.network]
    if pod.user:
        args += ["--user", pod.user]
    for group in pod.groups:
        args += ["--group-add", str(group)]
    shm = next((v.size_bytes for v in pod.volumes if v.mount_path == SHM and v.size_bytes),
               None)
    if shm:
        args += ["--shm-size", str(shm)]
    if pod.gpus:
        args += ["--gpus", str(pod.gpus)]
    if pod.hpus:  # Habana's documented container flags for Gaudi
        args += ["--runtime", "habana", "-e", "HABANA_VISIBLE_DEVICES=all",
                 "--cap-add", "sys_nice", "--ipc", "host"]
    for name, target, options in mounts:
        args += ["-v", f"{name}:{target}{options}"]
    for env_name in sorted(pod.env):
        args += ["-e", env_name]
    if pod.workdir:
        args += ["-w", pod.workdir]
    if pod.command:
        return args + ["--entrypoint", pod.command[0], pod.image, *pod.command[1:], *pod.args]
    return args + [pod.image, *pod.args]


def _copy_outputs(engine: Engine, pod: Pod, host: Callable[[str], Path]) -> None:
    copied: list[str] = []
    for path in sorted(pod.outputs, key=len):
        if any(PurePosixPath(path).is_relative_to(done) for done in copied):
            continue  # inside an output already copied (a file of a directory artifact)
        dest = host(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        done = engine("cp", f"{pod.name}:{path}", str(dest), check=False)
        if done.returncode == 0:
            copied.append(path)
        elif path not in pod.optional_outputs:
            raise LocalRunError(f"output {path} was not written by the step (the wait "
                                f"container would fail: {' '.join(done.stderr.split())[-200:]})")
