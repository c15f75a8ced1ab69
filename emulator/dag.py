"""The DAG of a compiled Workflow: its tasks in order, and Argo's names for runs and pods."""
from __future__ import annotations

import re
import secrets
from typing import Any, Mapping

from emulator.errors import LocalRunError
from emulator.expr import depends_names

NAME_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"   # Kubernetes' generateName alphabet
_MAX_POD_PREFIX = 253 - 10 - 1
_TASK_REF = re.compile(r"\{\{\s*tasks\.([\w\-]+)\.")


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
    """``metadata.name``, or ``generateName`` with a 5-character suffix as Kubernetes adds."""
    if metadata.get("name"):
        return metadata["name"]
    suffix = "".join(secrets.choice(NAME_SUFFIX_ALPHABET) for _ in range(5))
    return f"{metadata['generateName']}{suffix}"


class Task:
    """One DAG task: its spec, its template, and the tasks it depends on."""

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


def order(tasks: dict[str, Task]) -> list[Task]:
    """Topological order, stable in declaration order; refuses cycles and unknown names."""
    for task in tasks.values():
        for name in task.upstream:
            if name not in tasks:
                raise LocalRunError(f"{task.where}.depends: unknown task {name!r}")
    done: list[Task] = []
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
