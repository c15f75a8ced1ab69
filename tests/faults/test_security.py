"""Pods run as non-root and the cluster side grants namespaced Roles only.

The Dockerfiles' USER and the kustomize-built RBAC are checked in tests/test_containers.py and
tests/test_manifests.py (the latter needs kubectl); this adds the compiled Workflow of every
profile (and the multi-node PyTorchJob) and a kubectl-free scan of every manifest file.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import REPO
from workflows.config import ConfigError, load_config
from workflows.unet import build

pytestmark = pytest.mark.faults
VARIANTS = [(None, []), ("local", []), ("cpu_quick", []), ("cuda_1gpu", []),
            ("fp32_8hpu_training", []), ("bf16_8hpu_training", []),
            (None, ["resources.train.nodes=2"])]


def _pod_contexts(doc: dict):
    """Every (where, securityContext) a pod of this Workflow gets, including PyTorchJob pods."""
    yield "spec", doc["spec"].get("securityContext") or {}
    for template in doc["spec"]["templates"]:
        if template.get("securityContext") is not None:
            yield f"templates[{template['name']}]", template["securityContext"]
        manifest = (template.get("resource") or {}).get("manifest")
        if manifest:
            job = yaml.safe_load(manifest)
            for role, spec in job["spec"]["pytorchReplicaSpecs"].items():
                yield f"{template['name']}.{role}", spec["template"]["spec"]["securityContext"]


def _containers(doc: dict):
    for template in doc["spec"]["templates"]:
        for key in ("container", "script"):
            if template.get(key):
                yield template["name"], template[key].get("securityContext") or {}


@pytest.mark.parametrize("profile, overrides", VARIANTS)
def test_every_pod_runs_as_non_root(profile, overrides):
    doc = build(load_config(None, profile, overrides), "workflow").to_dict()
    contexts = dict(_pod_contexts(doc))
    assert contexts["spec"].get("runAsNonRoot") is True
    if overrides:
        assert any("." in where for where in contexts), "no PyTorchJob pod was checked"
    for where, context in contexts.items():
        if context:
            assert context.get("runAsNonRoot") is True, where
            assert context.get("runAsUser", 1) != 0 and context.get("runAsGroup", 1) != 0, where
    for name, context in _containers(doc):
        assert context.get("privileged") is not True, name
        assert context.get("runAsUser", 1) != 0 and context.get("runAsNonRoot") is not False


def test_root_uid_is_refused_by_the_config():
    with pytest.raises(ConfigError, match="pipeline.run_as_user"):
        load_config(None, None, ["pipeline.run_as_user=0"])


def test_no_manifest_file_grants_cluster_wide_rights():
    files = sorted((REPO / "manifests").rglob("*.yaml")) + sorted(
        (REPO / "manifests").rglob("*.yml"))
    assert files
    kinds = {}
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and "kind" in doc:
                kinds.setdefault(doc["kind"], []).append(str(Path(path).relative_to(REPO)))
    assert "Role" in kinds and "RoleBinding" in kinds
    assert not {"ClusterRole", "ClusterRoleBinding"} & set(kinds), {
        k: kinds[k] for k in ("ClusterRole", "ClusterRoleBinding") if k in kinds}
