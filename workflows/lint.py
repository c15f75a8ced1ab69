"""Checks on the compiled workflow: Hera round-trip, Argo's JSON schema, the Kubeflow CRD of
the multi-node job, project rules and pod contracts (:mod:`workflows.pod_rules`).

Each check returns a list of one-line problems; an empty list means it passed.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Iterable, Iterator

import yaml
from hera.workflows import Workflow, WorkflowTemplate
from jsonschema import Draft7Validator

from steps.storage import CREDENTIAL_VARS
from workflows.config import SECRET_NAME, SECRET_PATTERNS
from workflows.pod_rules import pod_rules, pytorch_jobs
from workflows.versions import module_file, pin

REPO_ROOT = Path(__file__).resolve().parent.parent
VALIDATOR = REPO_ROOT.parent / "shared" / "tools" / "validate_argo.py"
# What lint checks against: the JSON schema and the PyTorchJob CRD of the versions that ran
# (cluster/lib.sh), from their modules; where cluster/build.sh has not downloaded those, the
# copies in ../shared (Argo v4.1.2, training operator v1.9.0), named in a note.
try:
    ARGO_VERSION, OPERATOR_VERSION = pin("ARGO_VERSION"), pin("TRAINING_OPERATOR_VERSION")
except LookupError:     # the package installed without the repository: no pins, no modules
    ARGO_VERSION = OPERATOR_VERSION = "unpinned"
ARGO_SCHEMAS = (module_file("github.com/argoproj/argo-workflows/v4", ARGO_VERSION,
                            "api/jsonschema/schema.json"),
                REPO_ROOT.parent / "shared" / "argo" / "workflow-schema-v4.1.2.json")
PYTORCHJOB_CRDS = (module_file("github.com/kubeflow/training-operator", OPERATOR_VERSION,
                               "manifests/base/crds/kubeflow.org_pytorchjobs.yaml"),
                   REPO_ROOT.parent / "shared" / "kubeflow" / "pytorchjob-crd-v1.9.0.yaml")
REFERENCES = {"schema": (f"Argo {ARGO_VERSION}", ARGO_SCHEMAS),
              "crd": (f"training operator {OPERATOR_VERSION}", PYTORCHJOB_CRDS)}
CREDENTIAL_ENV = CREDENTIAL_VARS + ("ARGO_TOKEN", "MINIO_ROOT_PASSWORD", "MINIO_ROOT_USER")
CHECKS = ("round-trip", "schema", "crd", "artifacts", "parameters", "secrets", "images",
          "pods", "references")
_PARAM = re.compile(r"\{\{\s*workflow\.parameters\.([\w-]+)\s*\}\}")


def round_trip(doc: dict) -> list[str]:
    """Hera must read back exactly what it wrote: build -> to_dict -> from_dict -> to_dict."""
    cls = WorkflowTemplate if doc.get("kind") == "WorkflowTemplate" else Workflow
    again = cls.from_dict(json.loads(json.dumps(doc))).to_dict()
    return [f"round-trip: {path} {why}" for path, why in _diff(doc, again, "")]


def _diff(a, b, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            where = f"{path}.{key}" if path else key
            if key not in b:
                yield where, "dropped"
            elif key not in a:
                yield where, "added"
            else:
                yield from _diff(a[key], b[key], where)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _diff(x, y, f"{path}[{i}]")
    elif a != b:
        yield path, "changed"


def first_file(paths: Iterable[Path]) -> Path | None:
    return next((p for p in paths if p.is_file()), None)


@functools.lru_cache(maxsize=1)
def _validators():
    module, source = load_validator(), first_file(ARGO_SCHEMAS)
    if module is None or source is None:
        return None
    module.SCHEMA = source       # its load_schema() corrects whichever file it reads
    return module.validators(module.load_schema())


def load_validator():
    """``../shared/tools/validate_argo.py`` as a module, or None where it is absent."""
    if not VALIDATOR.is_file():
        return None
    spec = importlib.util.spec_from_file_location("validate_argo", VALIDATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def schema(doc: dict) -> list[str] | None:
    """Argo's JSON schema problems (the first of ARGO_SCHEMAS found); None when neither the
    validator nor a schema is available."""
    validators = _validators()
    if validators is None:
        return None
    check = validators[doc["kind"]]
    return [f"schema: at {'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message[:160]}"
            for e in sorted(check.iter_errors(doc), key=lambda e: list(e.absolute_path))]


@functools.lru_cache(maxsize=1)
def _crd_validator():
    source = first_file(PYTORCHJOB_CRDS)
    if source is None:
        return None
    crd = yaml.safe_load(source.read_text())
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    return Draft7Validator(version["schema"]["openAPIV3Schema"])


def crd(doc: dict) -> list[str] | None:
    """Every PyTorchJob a resource template creates, against the operator's CRD (the first of
    PYTORCHJOB_CRDS found); None when none is available."""
    validator = _crd_validator()
    if validator is None:
        return None
    problems = []
    for tmpl, job in pytorch_jobs(doc):
        for e in sorted(validator.iter_errors(job), key=lambda e: list(e.absolute_path)):
            where = "/".join(map(str, e.absolute_path)) or "<root>"
            problems.append(f"crd: template {tmpl['name']} PyTorchJob at {where}: "
                            f"{e.message[:160]}")
    return problems


def _source_note(name: str, found: list[str] | None) -> list[str]:
    """A note when check ``name`` did not run against the reference of the version that ran:
    skipped (nothing to check against), or checked against the copy in ../shared."""
    version, paths = REFERENCES[name]
    if found is None:
        return [f"{name}: skipped, none of {', '.join(map(str, paths))} is there"
                + ("" if name == "crd" or VALIDATOR.is_file() else f" (nor {VALIDATOR})")]
    used = first_file(paths)
    if used != paths[0]:
        return [f"{name}: checked against {used.name}, not {version}'s own ({paths[0]} is "
                f"missing: bash cluster/build.sh argo training-operator downloads it)"]
    return []


def _templates(doc: dict) -> dict[str, dict]:
    return {t["name"]: t for t in doc["spec"]["templates"]}


def _inputs(templates: dict[str, dict], task: dict, kind: str) -> tuple[dict, dict]:
    """({name: declaration} of ``task``'s template's input ``kind`` (parameters, artifacts),
    {name: argument} of those the task supplies)."""
    declared = (templates.get(task["template"], {}).get("inputs") or {}).get(kind, [])
    supplied = (task.get("arguments") or {}).get(kind, [])
    return {d["name"]: d for d in declared}, {a["name"]: a for a in supplied}


def artifacts_wired(doc: dict) -> list[str]:
    """Every artifact a task consumes is produced by a task it depends on, and every input
    artifact a template declares is supplied."""
    problems: list[str] = []
    templates = _templates(doc)
    for dag in (t for t in templates.values() if "dag" in t):
        tasks = {t["name"]: t for t in dag["dag"]["tasks"]}
        for task in tasks.values():
            wanted, supplied = _inputs(templates, task, "artifacts")
            for art in wanted.values():
                if art["name"] not in supplied and not art.get("optional") and "s3" not in art:
                    problems.append(f"artifacts: task {task['name']} does not supply input "
                                    f"artifact '{art['name']}'")
            for name, art in supplied.items():
                match = re.fullmatch(r"\{\{tasks\.([\w-]+)\.outputs\.artifacts\.([\w-]+)\}\}",
                                     art.get("from", ""))
                if not match:
                    problems.append(f"artifacts: task {task['name']} artifact '{name}' is not "
                                    "taken from a task output")
                    continue
                producer, output = match.groups()
                if producer not in tasks:
                    problems.append(f"artifacts: task {task['name']} reads '{output}' from "
                                    f"unknown task {producer}")
                    continue
                outputs = (templates[tasks[producer]["template"]].get("outputs") or {})
                if output not in {a["name"] for a in outputs.get("artifacts", [])}:
                    problems.append(f"artifacts: task {producer} does not produce '{output}' "
                                    f"(consumed by {task['name']})")
                if not _reaches(tasks, task["name"], producer):
                    problems.append(f"artifacts: task {task['name']} reads '{output}' from "
                                    f"{producer} but does not depend on it")
    return problems


def parameters_wired(doc: dict) -> list[str]:
    """Every DAG task supplies each input parameter its template declares without a value, a
    default or a ConfigMap (Argo v4.0.5 refuses the run otherwise, "inputs.parameters.X was
    not supplied": workflow/common/util.go ProcessArgs), and supplies none that its template
    does not declare (ProcessArgs looks up only the declared names: a misspelt argument is
    dropped and the template's default used, silently)."""
    problems: list[str] = []
    templates = _templates(doc)
    for dag in (t for t in templates.values() if "dag" in t):
        for task in dag["dag"]["tasks"]:
            declared, supplied = _inputs(templates, task, "parameters")
            for name, param in declared.items():
                if name not in supplied and "value" not in param and "default" not in param \
                        and "configMapKeyRef" not in (param.get("valueFrom") or {}):
                    problems.append(f"parameters: task {task['name']} does not supply input "
                                    f"parameter '{name}'")
            for name in sorted(supplied.keys() - declared.keys()):
                problems.append(f"parameters: task {task['name']} supplies '{name}', which "
                                f"template {task['template']} does not declare")
    return problems


def _reaches(tasks: dict, start: str, target: str) -> bool:
    stack, seen = [start], set()
    while stack:
        name = stack.pop()
        for dep in re.findall(r"[\w-]+", tasks[name].get("depends", "")):
            if dep == target:
                return True
            if dep in tasks and dep not in seen:
                seen.add(dep)
                stack.append(dep)
    return False


def _walk(node, path: str = "") -> Iterator[tuple[str, object]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _walk(value, f"{path}.{key}" if path else key)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")
    else:
        yield path, node


def no_literal_secrets(doc: dict, env: dict | None = None) -> list[str]:
    """No credential value from the environment, no key-shaped string, and no credential-
    named env var with a literal value. Messages name the place, never the value."""
    env = os.environ if env is None else env
    values = {name: env[name] for name in CREDENTIAL_ENV if len(env.get(name, "")) >= 4}
    problems = []
    for path, value in _walk(doc):
        if not isinstance(value, str):
            continue
        for name, secret in values.items():
            if secret in value:
                problems.append(f"secrets: {path} contains the value of ${name}")
        for what, pattern in SECRET_PATTERNS.items():
            if pattern.search(value):
                problems.append(f"secrets: {path} contains {what}")
    for tmpl in doc["spec"]["templates"]:
        for var in (tmpl.get("container") or {}).get("env", []):
            if "value" in var and SECRET_NAME.search(var["name"]):
                problems.append(f"secrets: template {tmpl['name']} sets {var['name']} to a "
                                "literal value (use valueFrom.secretKeyRef)")
    return problems


def images_pinned(doc: dict) -> list[str]:
    """Every image has a tag or digest (workflow parameter defaults resolved), not latest."""
    defaults = {p["name"]: str(p.get("value", ""))
                for p in (doc["spec"].get("arguments") or {}).get("parameters", [])}
    sources = _param_sources(doc)
    problems = []
    for tmpl in doc["spec"]["templates"]:
        for where, image in _images(tmpl):
            resolved = _resolve(image, sources.get(tmpl["name"], {}), defaults)
            name = resolved.rsplit("/", 1)[-1]
            if "@sha256:" in resolved:
                continue
            tag = name.split(":", 1)[1] if ":" in name else ""
            if not tag:
                problems.append(f"images: template {tmpl['name']} {where} '{resolved}' has no tag")
            elif tag == "latest":
                problems.append(f"images: template {tmpl['name']} {where} '{resolved}' uses "
                                ":latest")
    return problems


def _images(tmpl: dict) -> Iterable[tuple[str, str]]:
    if "container" in tmpl:
        yield "container", tmpl["container"]["image"]
    manifest = (tmpl.get("resource") or {}).get("manifest", "")
    for image in re.findall(r"image:\s*['\"]?([^\s'\"]+)", manifest):
        yield "resource", image


def _param_sources(doc: dict) -> dict[str, dict[str, str]]:
    """For each template, the value each input parameter gets from its DAG task."""
    templates = _templates(doc)
    sources: dict[str, dict[str, str]] = {}
    for dag in (t for t in templates.values() if "dag" in t):
        for task in dag["dag"]["tasks"]:
            for p in (task.get("arguments") or {}).get("parameters", []):
                sources.setdefault(task["template"], {})[p["name"]] = str(p.get("value", ""))
    return sources


def _resolve(text: str, inputs: dict[str, str], defaults: dict[str, str]) -> str:
    """``{{inputs.parameters.X}}`` -> the task's argument -> the workflow parameter default."""
    text = re.sub(r"\{\{\s*inputs\.parameters\.([\w-]+)\s*\}\}",
                  lambda mt: inputs.get(mt.group(1), mt.group(0)), text)
    return _PARAM.sub(lambda mt: defaults.get(mt.group(1), ""), text)


def project_rules(doc: dict, env: dict | None = None) -> list[str]:
    found = (artifacts_wired(doc) + parameters_wired(doc) + no_literal_secrets(doc, env)
             + images_pinned(doc))
    return list(dict.fromkeys(found))


def lint(doc: dict, env: dict | None = None) -> tuple[list[str], list[str]]:
    """All checks; returns (problems, notes)."""
    problems, notes = round_trip(doc), []
    for name, found in (("schema", schema(doc)), ("crd", crd(doc))):
        problems += found or []
        notes += _source_note(name, found)
    problems += project_rules(doc, env)
    found, more = pod_rules(doc)
    return problems + found, notes + more
