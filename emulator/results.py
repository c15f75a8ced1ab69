"""What a local run reports: per node and for the whole run (also written as result.json)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FAILED_PHASES = ("Failed", "Error")


@dataclass
class ArtifactRef:
    """One stored artifact: where it is and how it was stored (Argo's archive strategy)."""
    name: str
    bucket: str
    key: str
    archive: str = "none"          # "none" (plain objects) or "tar" (one .tgz object)
    kind: str = "dir"              # "dir" (a key prefix) or "file" (one object)
    manifest: bool = False         # a directory that carries MANIFEST.json

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ArtifactRef":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass
class NodeResult:
    """One DAG task. ``step_seconds`` is the step process's own wall time (all attempts);
    ``seconds`` adds artifact transfers and retry waits. ``cpu_seconds`` and the ``max_*``
    peaks are None where a container engine ran the step. ``exit_codes`` has
    one entry per attempt, as Argo's attempt nodes report ``outputs.exitCode`` (None: the
    step never ran)."""
    task: str
    template: str
    phase: str = "Pending"         # Argo NodePhase: Succeeded, Failed, Error, Skipped, Omitted
    pod_name: str = ""
    attempts: int = 0
    seconds: float = 0.0
    step_seconds: float = 0.0
    cpu_seconds: float | None = None       # the step process's CPU time, all attempts
    max_rss_bytes: int | None = None       # its largest resident set over the attempts
    max_anon_bytes: int | None = None      # of that, the most not in file pages
    max_disk_bytes: int | None = None      # the most its pod's folder held, any attempt
    memoized: bool = False
    exit_codes: list[int | None] = field(default_factory=list)
    message: str = ""
    parameters: dict[str, str] = field(default_factory=dict)
    artifacts: dict[str, ArtifactRef] = field(default_factory=dict)
    log_path: str = ""

    @property
    def failed(self) -> bool:
        return self.phase in FAILED_PHASES


@dataclass
class ModelLink:
    uri: str
    url: str = ""                  # presigned GET link ("" when it could not be made)


@dataclass
class RunResult:
    workflow_name: str
    phase: str = "Running"
    wall_seconds: float = 0.0
    endpoint: str = ""
    bucket: str = ""
    run_dir: str = ""
    nodes: list[NodeResult] = field(default_factory=list)
    models: list[ModelLink] = field(default_factory=list)
    outputs: dict[str, str] = field(default_factory=dict)   # artifact name → local copy
    message: str = ""

    @property
    def succeeded(self) -> bool:
        return self.phase == "Succeeded"

    @property
    def exit_code(self) -> int:
        return 0 if self.succeeded else 1

    @property
    def step_seconds(self) -> float:
        return sum(node.step_seconds for node in self.nodes)

    @property
    def overhead_seconds(self) -> float:
        """Orchestration overhead: run wall time minus the steps' own wall time."""
        return self.wall_seconds - self.step_seconds

    def node(self, task: str) -> NodeResult:
        for node in self.nodes:
            if node.task == task:
                return node
        raise KeyError(task)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(step_seconds=self.step_seconds, overhead_seconds=self.overhead_seconds)
        return data

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path
