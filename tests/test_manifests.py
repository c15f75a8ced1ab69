"""The kustomize tree under manifests/: every overlay builds offline and every built resource
validates (core kinds against Kubernetes' schemas with ``kubernetes-validate``, Argo kinds
with ``../shared/tools/validate_argo.py``), and the pieces agree with config/pipeline.yaml.
"""
from __future__ import annotations

import copy
import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from emulator.spec import cpu_field
from workflows.config import load_config

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "manifests"
OVERLAYS = sorted(p.parent.name for p in (MANIFESTS / "overlays").glob("*/kustomization.yaml"))
SHARED_TOOLS = REPO.parent / "shared" / "tools"
NAMESPACE = "unet"
K8S_VERSION = "1.32.0"     # the newest Kubernetes release that Gaudi software 1.21-1.23 lists
KUBECTL = shutil.which("kubectl")

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e '.[dev]')")
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl not found; manifests/install-kubectl.sh installs it")


def config() -> dict:
    """The pipeline config with its defaults (config/pipeline.yaml states departures only)."""
    return load_config().model_dump(exclude_none=True)


def kustomize(path: Path) -> list[dict]:
    run = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, f"kubectl kustomize {path} failed:\n{run.stderr}"
    return [d for d in yaml.safe_load_all(run.stdout) if d]


_BUILT: dict[str, list[dict]] = {}


def built(overlay: str) -> list[dict]:
    if overlay not in _BUILT:
        _BUILT[overlay] = kustomize(MANIFESTS / "overlays" / overlay)
    return copy.deepcopy(_BUILT[overlay])


def find(docs: list[dict], kind: str, name: str) -> dict:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind}/{name}, found {len(hits)}"
    return hits[0]


def artifact_repository(docs: list[dict]) -> dict:
    cm = find(docs, "ConfigMap", config()["storage"]["artifact_repository_configmap"])
    key = cm["metadata"]["annotations"]["workflows.argoproj.io/default-artifact-repository"]
    return yaml.safe_load(cm["data"][key])


def validate_argo_module():
    script = SHARED_TOOLS / "validate_argo.py"
    if not script.exists():
        pytest.skip("../shared/tools/validate_argo.py is absent")
    spec = importlib.util.spec_from_file_location("validate_argo", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def validate_core(doc: dict) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def validate_argo_kind(doc: dict) -> None:
    module = validate_argo_module()
    validator = module.validators(module.load_schema())[doc["kind"]]
    errors = sorted(validator.iter_errors(doc), key=str)
    assert not errors, f"{doc['kind']}/{doc['metadata'].get('name')}: {errors[0].message}"


def validate(doc: dict) -> None:
    group = doc["apiVersion"].rpartition("/")[0]
    if group == "argoproj.io":
        validate_argo_kind(doc)
    elif group in ("", "apps", "batch", "rbac.authorization.k8s.io", "policy",
                   "networking.k8s.io", "scheduling.k8s.io", "storage.k8s.io"):
        validate_core(doc)
    else:
        pytest.fail(f"{doc['kind']} ({doc['apiVersion']}): no schema to validate it against")


# ---- building and validating -------------------------------------------------------------

def test_overlays_present():
    assert {"local-minio", "aws-s3", "gaudi"} <= set(OVERLAYS)


def test_kustomizations_are_local_only():
    """`kubectl kustomize` must build offline: no remote bases, resources or components
    (manifests/addons/ is the one place that applies a vendor's published URL)."""
    for path in [*(MANIFESTS / "base").rglob("kustomization.yaml"),
                 *(MANIFESTS / "overlays").rglob("kustomization.yaml")]:
        body = yaml.safe_load(path.read_text())
        for field in ("resources", "components", "bases"):
            for entry in body.get(field) or []:
                assert "://" not in entry and not entry.startswith("github.com"), (path, entry)
                assert (path.parent / entry).exists(), f"{path}: {entry} does not exist"


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_builds_and_validates(overlay):
    docs = built(overlay)
    assert docs, f"{overlay} built nothing"
    for doc in docs:
        validate(doc)


@needs_kubectl
def test_validator_rejects_a_misspelt_field():
    """The strict schema check is live: a typo in a built Deployment is caught."""
    deployment = find(built("local-minio"), "Deployment", "minio")
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_core(deployment)


@needs_kubectl
def test_gaudi_on_aws_s3_builds(tmp_path):
    """The README's recipe for AWS dl1 (first-gen Gaudi): aws-s3 plus the habana-system namespace."""
    tree = tmp_path / "manifests"
    shutil.copytree(MANIFESTS, tree)
    overlay = tree / "overlays" / "dl1"
    overlay.mkdir()
    shutil.copy(tree / "overlays" / "gaudi" / "habana-system.yaml", overlay)
    (overlay / "kustomization.yaml").write_text(
        "resources: [../aws-s3, habana-system.yaml]\n")
    docs = kustomize(overlay)
    for doc in docs:
        validate(doc)
    assert find(docs, "Namespace", "habana-system")
    assert artifact_repository(docs)["s3"]["useSDKCreds"] is True


HABANA_PLUGIN_URL = ("https://vault.habana.ai/artifactory/docker-k8s-device-plugin/"
                     "habana-k8s-device-plugin.yaml")


@needs_kubectl
def test_gaudi_device_plugin_addon_targets_the_training_nodes(tmp_path):
    """The add-on applies Habana's published manifest (by URL, not a copy) plus our node
    selector and toleration. Offline, a minimal stand-in DaemonSet takes the URL's place to
    check that the patch applies and matches config/pipeline.yaml."""
    addon = MANIFESTS / "addons" / "gaudi-device-plugin"
    body = yaml.safe_load((addon / "kustomization.yaml").read_text())
    assert body["resources"] == [HABANA_PLUGIN_URL]
    work = tmp_path / "addon"
    shutil.copytree(addon, work)
    stand_in = {
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "habanalabs-device-plugin-daemonset", "namespace": "habana-system"},
        "spec": {"selector": {"matchLabels": {"name": "plugin"}},
                 "template": {"metadata": {"labels": {"name": "plugin"}},
                              "spec": {"containers": [{"name": "plugin", "image": "stand-in:1"}]}}},
    }
    namespace = {"apiVersion": "v1", "kind": "Namespace",      # unlabelled, as Habana's
                 "metadata": {"name": "habana-system"}}
    (work / "stand-in.yaml").write_text(yaml.safe_dump_all([namespace, stand_in]))
    body["resources"] = ["stand-in.yaml"]
    (work / "kustomization.yaml").write_text(yaml.safe_dump(body))
    built_ns, daemonset = sorted(kustomize(work), key=lambda d: d["kind"] != "Namespace")
    overlay = find(built("gaudi"), "Namespace", "habana-system")
    assert built_ns["metadata"]["labels"] == overlay["metadata"]["labels"]   # apply order-proof
    validate_core(daemonset)
    assert daemonset["metadata"]["name"] == "habanalabs-device-plugin-daemonset"
    pod = daemonset["spec"]["template"]["spec"]
    train = config()["resources"]["train"]
    assert pod["nodeSelector"] == train["node_selector"]
    assert pod["tolerations"] == train["tolerations"]


def test_secret_template_validates_and_holds_no_value():
    docs = list(yaml.safe_load_all((MANIFESTS / "base" / "s3-credentials.template.yaml").read_text()))
    assert len(docs) == 1
    secret = docs[0]
    validate_core(secret)
    storage = config()["storage"]
    assert secret["metadata"]["name"] == storage["credentials_secret"]
    assert set(secret["stringData"]) == {storage["access_key_key"], storage["secret_key_key"]}
    assert set(secret["stringData"].values()) == {"REPLACE_ME"}


# ---- what the resources say --------------------------------------------------------------

@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_namespaced_rbac_only(overlay):
    docs = built(overlay)
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, doc["metadata"]["name"]
    accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
    roles = {d["metadata"]["name"] for d in docs if d["kind"] == "Role"}
    for binding in (d for d in docs if d["kind"] == "RoleBinding"):
        assert binding["roleRef"]["kind"] == "Role" and binding["roleRef"]["name"] in roles
        for subject in binding["subjects"]:
            if subject["kind"] == "ServiceAccount" and subject["name"] in accounts:
                assert subject["namespace"] == NAMESPACE, binding["metadata"]["name"]


def allowed(role: dict, group: str, resource: str, verb: str, name: str | None = None) -> bool:
    for rule in role["rules"]:
        if (group in rule.get("apiGroups", []) and resource in rule.get("resources", [])
                and verb in rule.get("verbs", [])
                and (not rule.get("resourceNames") or name in rule["resourceNames"])):
            return True
    return False


@needs_kubectl
def test_workflow_role_covers_executor_and_training_operator():
    docs = built("local-minio")
    account = config()["pipeline"]["service_account"]
    find(docs, "ServiceAccount", account)
    binding = next(d for d in docs if d["kind"] == "RoleBinding"
                   and {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
                   in d["subjects"])
    role = find(docs, "Role", binding["roleRef"]["name"])
    for verb in ("create", "patch"):
        assert allowed(role, "argoproj.io", "workflowtaskresults", verb)
    for verb in ("create", "get", "watch"):
        assert allowed(role, "kubeflow.org", "pytorchjobs", verb), verb
    for resource in ("pods", "pods/log", "secrets"):   # Argo v4's executor needs none
        assert not allowed(role, "", resource, "get"), resource


@needs_kubectl
def test_user_roles_are_the_least_the_pipeline_needs():
    """manifests/base/users.yaml: unet-user publishes, submits and reruns and reads only the
    S3 Secret (for artifact links); unet-viewer reads. tests/test_cluster.py checks both
    against the real Argo server in client auth mode."""
    docs = built("local-minio")
    user, viewer = find(docs, "Role", "unet-user"), find(docs, "Role", "unet-viewer")
    secret = config()["storage"]["credentials_secret"]
    for verb in ("create", "update", "delete"):
        assert allowed(user, "argoproj.io", "workflows", verb), verb
    assert allowed(user, "argoproj.io", "workflowtemplates", "update")
    assert allowed(user, "", "secrets", "get", secret)
    assert not allowed(user, "", "secrets", "get", "another-secret")
    assert not allowed(user, "", "secrets", "list") and not allowed(user, "", "pods/exec",
                                                                      "create")
    for rule in viewer["rules"]:
        assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule
        assert "secrets" not in rule["resources"], rule
    for name in ("unet-user", "unet-viewer"):
        binding = find(docs, "RoleBinding", name)
        assert binding["roleRef"]["name"] == name
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name,
                                        "namespace": NAMESPACE}]


@needs_kubectl
def test_memoize_cache_is_labelled_and_writable_by_the_controller():
    """The cache is in the controller's namespace (Argo keeps it there), so it is in
    manifests/controller, which names no namespace: its binding's subjects are the
    controller's account in whatever namespace it is applied to (tests/test_cluster.py
    checks that on a real API server)."""
    docs = kustomize(MANIFESTS / "controller")
    name = config()["memoize"]["config_map"]
    cache = find(docs, "ConfigMap", name)
    assert cache["metadata"]["labels"]["workflows.argoproj.io/configmap-type"] == "Cache"
    assert all("namespace" not in d["metadata"] for d in docs)
    writers = [d for d in docs if d["kind"] == "Role"
               and allowed(d, "", "configmaps", "update", name)]
    assert writers, "nobody may update the memoize cache"
    assert not any(allowed(w, "", "configmaps", "update", "other") for w in writers)
    bound = [b for b in docs if b["kind"] == "RoleBinding"
             and b["roleRef"]["name"] in {w["metadata"]["name"] for w in writers}]
    subjects = [s for b in bound for s in b["subjects"]]
    assert {"argo", "argo-workflows-workflow-controller"} <= {s["name"] for s in subjects}
    assert not any("namespace" in s for s in subjects)
    for overlay in OVERLAYS:   # nothing of the cache is left in the pipeline's namespace
        assert not [d for d in built(overlay) if d["metadata"]["name"] == name]


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_artifact_repository(overlay):
    docs = built(overlay)
    storage = config()["storage"]
    cm = find(docs, "ConfigMap", storage["artifact_repository_configmap"])
    key = cm["metadata"]["annotations"]["workflows.argoproj.io/default-artifact-repository"]
    assert key == storage["artifact_repository_key"]
    repo = yaml.safe_load(cm["data"][key])
    module = validate_argo_module()
    schema = module.load_schema()
    from jsonschema import Draft202012Validator
    validator = Draft202012Validator(
        {"$ref": "#/definitions/io.argoproj.workflow.v1alpha1.ArtifactRepository",
         "definitions": schema["definitions"]})
    errors = list(validator.iter_errors(repo))
    assert not errors, errors[0].message
    s3 = repo["s3"]
    assert s3["bucket"] == storage["bucket"]
    assert "REPLACE_ME" not in s3["endpoint"]
    if s3.get("useSDKCreds"):
        assert "accessKeySecret" not in s3
    else:
        assert s3["accessKeySecret"] == {"name": storage["credentials_secret"],
                                         "key": storage["access_key_key"]}
        assert s3["secretKeySecret"] == {"name": storage["credentials_secret"],
                                         "key": storage["secret_key_key"]}
    assert not [d for d in docs if d["kind"] == "Secret"], "no Secret is ever applied"


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_pinned(overlay):
    for doc in built(overlay):
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            image = container["image"]
            name, _, tag = image.rpartition(":")
            assert name and "/" not in tag and tag not in ("", "latest"), image


@needs_kubectl
def test_local_minio_serves_the_repository_endpoint():
    docs = built("local-minio")
    s3 = artifact_repository(docs)["s3"]
    host, _, port = s3["endpoint"].partition(":")
    service_name, service_ns = host.split(".")[:2]
    assert service_ns == NAMESPACE
    service = find(docs, "Service", service_name)
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    assert s3["insecure"] is True and "createBucketIfNotPresent" in s3
    deployment = find(docs, "Deployment", service_name)
    pod = deployment["spec"]["template"]["spec"]
    assert service["spec"]["selector"].items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items()
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in pod["containers"][0]["env"]}
    storage = config()["storage"]
    assert env["MINIO_ROOT_USER"] == {"name": storage["credentials_secret"],
                                      "key": storage["access_key_key"]}
    assert env["MINIO_ROOT_PASSWORD"] == {"name": storage["credentials_secret"],
                                          "key": storage["secret_key_key"]}
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
              if "persistentVolumeClaim" in v]
    for claim in claims:
        find(docs, "PersistentVolumeClaim", claim)
    assert pod["securityContext"]["runAsNonRoot"] is True


@needs_kubectl
def test_aws_s3_uses_irsa():
    docs = built("aws-s3")
    account = find(docs, "ServiceAccount", config()["pipeline"]["service_account"])
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].startswith(
        "arn:aws:iam::")
    s3 = artifact_repository(docs)["s3"]
    assert s3["endpoint"] == "s3.amazonaws.com" and s3["insecure"] is False
    assert s3["useSDKCreds"] is True
    assert not [d for d in docs if d["kind"] in ("Deployment", "PersistentVolumeClaim")]


@needs_kubectl
def test_pod_security_is_relaxed_only_where_habana_requires_it():
    """Baseline everywhere, except on a Gaudi cluster: the device plugin's namespace (a
    hostPath) and the pipeline's, whose train pod Habana documents with hostIPC and SYS_NICE."""
    for overlay in OVERLAYS:
        docs = built(overlay)
        labels = find(docs, "Namespace", NAMESPACE)["metadata"]["labels"]
        expected = "privileged" if overlay == "gaudi" else "baseline"
        assert labels["pod-security.kubernetes.io/enforce"] == expected, overlay
        assert labels["pod-security.kubernetes.io/warn"] == "restricted", overlay
    habana = find(built("gaudi"), "Namespace", "habana-system")
    assert habana["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def _resolve_env(container: dict, docs: list[dict]) -> dict[str, str | None]:
    """A container's env as the kubelet would set it from this overlay's objects: a value,
    None for an optional reference that resolves to nothing, and a KeyError where a required
    reference is missing (the pod would never start)."""
    env: dict[str, str | None] = {}
    objects = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    for var in container.get("env") or []:
        source = var.get("valueFrom")
        if source is None:
            env[var["name"]] = var["value"]
            continue
        (key, ref), = source.items()
        if key == "resourceFieldRef":       # the container's own request (UNET_CPUS)
            env[var["name"]] = cpu_field(container.get("resources") or {}, ref, var["name"])
            continue
        kind = {"secretKeyRef": "Secret", "configMapKeyRef": "ConfigMap"}[key]
        data = (objects.get((kind, ref["name"])) or {}).get("data") or {}
        if ref["key"] not in data and not ref.get("optional"):
            raise KeyError(f"{var['name']}: {kind} {ref['name']} key {ref['key']}")
        env[var["name"]] = data.get(ref["key"])
    return env


def _endpoint_host(url: str | None) -> str:
    return "s3.amazonaws.com" if not url else url.split("://", 1)[-1].rstrip("/")


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("overrides", [[], ["resources.train.nodes=2"]])
def test_steps_start_and_reach_the_overlays_s3(overlay, overrides):
    """Issue 13 point 4: on every overlay the step pods start (no Secret the overlay lacks)
    and their checkpoints go to the same S3 as Argo's artifacts (no -p storage.endpoint)."""
    from workflows.unet import build
    docs = built(overlay)
    doc = build(load_config(None, None, overrides)).to_dict()
    containers = [t["container"] for t in doc["spec"]["templates"] if "container" in t]
    for tmpl in doc["spec"]["templates"]:
        manifest = (tmpl.get("resource") or {}).get("manifest")
        if manifest:
            for replica in yaml.safe_load(manifest)["spec"]["pytorchReplicaSpecs"].values():
                containers += replica["template"]["spec"]["containers"]
    repository = artifact_repository(docs)["s3"]["endpoint"]
    checked = 0
    for container in containers:
        env = _resolve_env(container, docs)
        if "AWS_REGION" in env:  # a step that uses the checkpoint / source store
            assert _endpoint_host(env.get("AWS_ENDPOINT_URL")) == repository, overlay
            checked += 1
    assert checked >= 2
