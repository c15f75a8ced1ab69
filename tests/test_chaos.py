"""Issue 48: faults of the engine under a run in flight, on the real cluster
(tests/real_cluster.py; the `cluster` marker, required in CI).

Each case submits the `cluster` profile's DAG with a train of three epochs long enough to be
hit between checkpoints, waits until train's first checkpoint is in S3 while its pod runs,
injects its faults, and checks the end: the workflow Succeeded, no pod made twice for one
attempt, the release's manifest verifies, and the model is byte-identical to the one of an
undisturbed run with the same parameters (a retried train resumed from its checkpoint too).
The model of the first run whose train took one attempt stands for the undisturbed run's
(class Release), so no undisturbed run is made in CI's order. Each case's time from train's
start to the end is printed (``UNET_CHAOS_RESULTS=FILE`` keeps them as JSON).

Faults that do not interfere share a run (four runs, where eight and then six took more of
CI's time than the 2-core Intel Xeon has): the controller lost while preprocess saves its
dataset, then the controller's pod deleted mid-train (its Deployment starts another); the
kubelet down 30 s, etcd restarted and the API server down 30 s, in turn (cluster/restart.sh);
the train pod evicted for its local storage; the S3 server (on its persistent volume) stopped
and started again while download uploads and while train loads, then the train pod deleted,
as an operator or an autoscaler does; and ten users submitting at once (the last case: it
publishes the template, and its runs read a source of their own). The cases that need
preprocess to run empty the memoization cache first. Ten users at once is marked
``beyond_ci`` (``python -m pytest -m beyond_ci tests/test_chaos.py``): it does not fit in CI's
time beside the rest.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from real_cluster import (BUCKET, CFG, CONTROLLER_NAMESPACE, NAMESPACE, RUN_DIR, argo_nodes,
                          attempt_log, cli, compiled, container_statuses, controller_pods,
                          fresh_source, kubectl, objects_of, pods_of, restart, scale_s3, span_s,
                          unique, until, wait, WAIT_S)
from steps import storage
from workflows.argo import DONE, ArgoError

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(1800)]

# Three epochs of 600 steps: about 7 s each in a pod of the cluster profile (1 CPU), so a
# fault injected once the first checkpoint is in S3 lands in the middle of the run's train.
LONG_TRAIN = ("train.max_epochs=3", "train.steps_per_epoch=600", "retry.backoff_duration=2s")
RESULTS: dict[str, dict] = {}
# How long the S3 server stays stopped once the transfer under test has begun; its start
# again comes on top (about 4 s idle, up to 15 s beside CI's other worker). Argo v4.0.5's
# executor retries a transfer that meets a refused connection for about 30 s: 5 tries 1 s
# apart, growing 1.6-fold with jitter (workflow/executor/retry/retry.go ExecutorRetry;
# workflow/artifacts/s3/s3.go Load and Save), each after minio-go's own 10 tries. At 10 s,
# the outage a transfer met in CI reached that window (transfers of up to 25 s, and on
# 2026-12-01 a train attempt lost), so the planned part is kept short and what the test
# holds is that the transfer ended only once the server was back.
S3_DOWN_S = 3


def running_train(store, name: str) -> str:
    """The train pod's name, once it runs and its first checkpoint is in S3."""
    latest = f"checkpoints/{name}/latest"

    def ready() -> str | None:
        pod = next((p for p in pods_of(name) if p["metadata"]["name"].startswith(
            f"{name}-train-") and p["status"]["phase"] == "Running"), None)
        listed = store.client().list_objects_v2(Bucket=BUCKET, Prefix=latest)
        return pod["metadata"]["name"] if pod and listed.get("KeyCount") else None

    return until(ready, 600, f"{name}'s train running with a checkpoint in S3", every=0.5)


def step_pod(name: str, step: str, container: str = "", state: str = "") -> str | None:
    """The pod of ``step`` in workflow ``name``, if there is one; with ``container`` (main,
    init, wait), one whose container is in ``state`` (waiting, running, terminated)."""
    for pod in pods_of(name):
        if pod["metadata"]["name"].startswith(f"{name}-{step}-") and (not container or any(
                c["name"] == container and state in c.get("state", {})
                for c in container_statuses(pod["status"]))):
            return pod["metadata"]["name"]
    return None


def pod_status(pod: str) -> dict:
    return json.loads(kubectl("-n", NAMESPACE, "get", "pod", pod, "-o", "json"))["status"]


def containers_of(uid: str) -> list[str]:
    """containerd's containers of the pod with ``uid`` (the kubelet labels each)."""
    return ctr("containers", "list", "-q", f'labels."io.kubernetes.pod.uid"=={uid}').split()


def ctr(*args: str) -> str:
    """containerd's own client on the kubelet's namespace (cluster/up.sh's socket)."""
    return subprocess.run(["ctr", "--address", str(RUN_DIR / "containerd" / "containerd.sock"),
                           "-n", "k8s.io", *args], capture_output=True, text=True, timeout=60,
                          check=True).stdout


def transient_refusals(log: str) -> list[str]:
    """The executor's retried transfers in a container's log: a refused connection that Argo
    v4.0.5 took for transient (util/errors/errors.go IsTransientErrQuiet logs "Transient
    error"; isTransientNetworkErr matches "connect: connection refused")."""
    return [line for line in log.splitlines()
            if "Transient error" in line and "connection refused" in line]


def quantity_bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    number, unit = re.fullmatch(r"(\d+)([KMGT]i)?", quantity).groups()
    return int(number) * units.get(unit or "", 1)


def controller_pid() -> int:
    """The host pid of the workflow controller's process (its container's task in
    containerd)."""
    container = controller_pods("status.containerStatuses[0].containerID").split()[0]
    return next(int(line.split()[1]) for line in ctr("tasks", "ls").splitlines()
                if line.startswith(container.removeprefix("containerd://")))


def empty_memo_cache() -> None:
    """The controller's memoization cache emptied, so that download and preprocess run."""
    kubectl("-n", CONTROLLER_NAMESPACE, "patch", "configmap", CFG.memoize.config_map,
            "--type=merge", "-p", '{"data": null}')


@dataclass(frozen=True)
class Outage:
    pod: str            # the pod whose transfer it was timed around
    gone: datetime      # the server's pod gone
    back: datetime      # the server ready again (its rollout done)


def s3_down_while(begun, what: str, then=lambda: None) -> Outage:
    """The S3 server stopped, ``then()`` called, the server kept stopped until ``begun()``
    names a pod, then S3_DOWN_S more, then started again."""
    try:
        scale_s3(0)
        gone = datetime.now(timezone.utc)
        then()
        pod = until(begun, 300, what, every=0.5)
        time.sleep(S3_DOWN_S)
    finally:
        scale_s3(1)
    return Outage(pod, gone, datetime.now(timezone.utc))


def transfer_across_outage(outage: Outage, container: str) -> dict:
    """How the executor's ``container`` moved its artifacts across the stopped S3 server: its
    seconds (the init container's run, or the wait container's from main's end), the
    seconds the server was still away once it had begun, and the refused connections Argo
    logged. A transfer that succeeded waited the outage out: it ended once the server was
    back, less 2 s (the statuses' whole seconds; the Service's endpoint is ready a moment
    before the test sees the rollout done). Whether a refusal reaches Argo's log varies:
    minio-go retries a failed request itself first, silently, and one load in CI
    (2026-11-29) took 24.6 s with none logged."""
    log = kubectl("-n", NAMESPACE, "logs", outage.pod, "-c", container)
    states = {c["name"]: c["state"].get("terminated", {})
              for c in container_statuses(pod_status(outage.pod))}
    began = datetime.fromisoformat(states[container]["startedAt"] if container == "init"
                                   else states["main"]["finishedAt"])
    ended = datetime.fromisoformat(states[container]["finishedAt"])
    assert ended >= outage.back - timedelta(seconds=2), (ended, outage, log[-2000:])
    return {"seconds": (ended - began).total_seconds(),
            "outage_after_start_s": round((outage.back - max(began, outage.gone))
                                          .total_seconds(), 1),
            "server_away_s": round((outage.back - outage.gone).total_seconds(), 1),
            "refusals_logged": len(transient_refusals(log))}


def lost_attempt(pod: str, gone: datetime) -> dict:
    """What ended ``pod``'s attempt: each container's end (relative to when the S3 server was
    gone) and the last lines of the log of any that failed."""
    ended = {}
    for status in container_statuses(pod_status(pod)):
        end = status["state"].get("terminated") or {}
        ended[status["name"]] = {k: end.get(k) for k in ("exitCode", "reason", "message")}
        for key in ("startedAt", "finishedAt"):
            if end.get(key):
                ended[status["name"]][key] = (datetime.fromisoformat(end[key]) -
                                              gone).total_seconds()
        if end.get("exitCode"):
            log = kubectl("-n", NAMESPACE, "logs", pod, "-c", status["name"], check=False)
            ended[status["name"]]["log"] = log.splitlines()[-8:]
    return ended


def phase(namespace: str, pod: str) -> str:
    return kubectl("-n", namespace, "get", "pod", pod, "-o", "jsonpath={.status.phase}",
                   check=False).strip()


def released_onnx(store, name: str, tmp_path: Path) -> str:
    """The sha256 of the run's released ONNX model, its manifest verified on the way."""
    prefix = f"{CFG.storage.models_prefix}/{CFG.pipeline.model_name}/{name}"
    dest = tmp_path / name
    storage.download_dir(f"s3://{BUCKET}/{prefix}/", dest, client=store.client(),
                         artifact="exported", progress=False)
    return hashlib.sha256((dest / "unet2d.onnx").read_bytes()).hexdigest()


# What a deleted pod's attempt says: Argo's own line, or the step's for the kubelet's SIGTERM.
DELETED = re.compile(r"^pod deleted$|\(exit code 143\): error: \S+: stopped by SIGTERM;")

# A pod that Succeeded this long ago while its node still waits for its outputs has been
# given up by its executor (below); the controller's informer sees a task result in seconds.
STUCK_S = 60
REPORTED = "workflows.argoproj.io/report-outputs-completed"
NODE_ID = "workflows.argoproj.io/node-id"          # a pod's annotation: its node in the run


def stuck_pods(wf: dict) -> list[str]:
    """Pods of run ``wf`` that Argo v4.0.5 will wait on for ever: Succeeded at least
    STUCK_S ago, their node not yet Succeeded, and their WorkflowTaskResult (named by the
    node's id) not labelled complete. An executor that cannot reach the API server gives up
    reporting after about 31 s (workflow/executor/executor.go FinalizeOutput: backoff Cap
    30 s) and still exits 0; operator.go podReconciliation then skips the Succeeded pod whose
    result is incomplete and requeues the workflow ("pod reconciliation didn't complete,
    will retry") before any deadline is checked, and taskresult.go's fallback
    (TASK_RESULT_TIMEOUT_DURATION) only covers nodes already completed."""
    name, nodes = wf["metadata"]["name"], wf["status"].get("nodes") or {}
    waiting = {r["metadata"]["name"] for r in objects_of(name, "workflowtaskresults")
               if (r["metadata"].get("labels") or {}).get(REPORTED) != "true"}
    now = datetime.now(timezone.utc)
    stuck = []
    for pod in pods_of(name):
        node = pod["metadata"].get("annotations", {}).get(NODE_ID)
        ended = [datetime.fromisoformat(c["state"]["terminated"]["finishedAt"])
                 for c in container_statuses(pod["status"]) if "terminated" in c["state"]]
        if pod["status"]["phase"] == "Succeeded" and node in waiting and ended and \
                (nodes.get(node) or {}).get("phase") != "Succeeded" and \
                (now - max(ended)).total_seconds() > STUCK_S:
            stuck.append(pod["metadata"]["name"])
    return stuck


def wait_mending_stuck(argo, name: str) -> tuple[dict, list[str]]:
    """The run's end, each stuck pod (:func:`stuck_pods`) deleted on the way as
    docs/operations.md tells a user: its node becomes an Error, "pod deleted", which the
    retry strategy runs again (train resumes from its checkpoint). Returns the workflow and
    the pods deleted."""
    mended: list[str] = []

    def ended() -> dict | None:
        try:
            wf = argo.get_workflow(name)
        except ArgoError as exc:   # the Argo Server answers 500 until its API is reachable
            if exc.transient:
                return None
            raise
        if wf["status"].get("phase") in DONE:
            return wf
        for pod in stuck_pods(wf):
            print(f"chaos: {pod} Succeeded, its outputs never reported: deleted")
            kubectl("-n", NAMESPACE, "delete", "pod", pod, "--wait=false")
            mended.append(pod)
        return None

    return until(ended, WAIT_S, f"{name} to end", every=5), mended


def one_pod_per_attempt(name: str) -> None:
    nodes = Counter(p["metadata"]["annotations"].get(NODE_ID) for p in pods_of(name))
    assert nodes and all(count == 1 for count in nodes.values()), nodes


def record(case: str, wf: dict, compare: bool = True, **facts) -> None:
    """The case's time from train's start to the workflow's end (download and preprocess are
    memoized after the first run, so the whole wall would not compare), beside the
    undisturbed run's (``compare``: the same parameters)."""
    train = next(n for n in wf["status"]["nodes"].values() if n["displayName"] == "train")
    span = span_s(train["startedAt"], wf["status"]["finishedAt"])
    RESULTS[case] = {"workflow": wf["metadata"]["name"], "phase": wf["status"]["phase"],
                     "train_to_end_s": span, **facts}
    if compare and "undisturbed" in RESULTS and case != "undisturbed":
        RESULTS[case]["added_s"] = span - RESULTS["undisturbed"]["train_to_end_s"]
    print(f"chaos: {case}: {json.dumps(RESULTS[case])}")
    if os.environ.get("UNET_CHAOS_RESULTS"):
        Path(os.environ["UNET_CHAOS_RESULTS"]).write_text(json.dumps(RESULTS, indent=1) + "\n")


class Release:
    """The released ONNX model (sha256) every run with the faults' parameters must end with,
    one per set of overrides. The controller's and the S3 server's faults leave train's one
    attempt alone, so the first of those runs gives it; a case whose train is retried, run
    first (alone, with ``-k``) or with overrides of its own, takes it from an undisturbed run
    of its own. In CI's order no undisturbed run is needed: one workflow run less
    (docs/testing.md)."""

    def __init__(self, argo, store, tmp_path_factory):
        self.argo, self.store, self.tmp = argo, store, tmp_path_factory
        self.sha: dict[tuple[str, ...], str] = {}

    def expected(self, overrides: tuple[str, ...]) -> str:
        if overrides not in self.sha:
            name = unique("chaos-none")
            self.argo.create_workflow(compiled(*overrides, name=name))
            wf = wait(self.argo, name)
            assert wf["status"]["phase"] == "Succeeded", wf["status"].get("message")
            record("undisturbed", wf)
            self.sha[overrides] = released_onnx(self.store, name, self.tmp.mktemp("undisturbed"))
        return self.sha[overrides]

    def check(self, name: str, tmp_path: Path, train_retried: bool,
              overrides: tuple[str, ...] = LONG_TRAIN) -> None:
        """The run ``name``, made with ``overrides``, released the same bytes as an
        undisturbed run with them."""
        got = released_onnx(self.store, name, tmp_path)
        if not train_retried:
            self.sha.setdefault(overrides, got)
        assert got == self.expected(overrides)


@pytest.fixture(scope="module")
def release(argo, store, tmp_path_factory) -> Release:
    return Release(argo, store, tmp_path_factory)


def test_the_controller_lost_while_an_artifact_is_saved_and_replaced_mid_train(
        argo, store, release, tmp_path):
    """The controller's two faults, in one run (the memoization cache emptied first, so that
    preprocess runs):

    1. the controller lost while preprocess saves its dataset: its process frozen (SIGSTOP,
       as a hung controller or one on a node cut off) from the moment it has made
       preprocess's pod until that pod has saved the dataset and ended, then its pod
       force-deleted, as for a lost node. The executor saves the artifact and leaves its
       outputs in a WorkflowTaskResult (v4.0.5 workflow/executor/executor.go reportResult),
       which the Deployment's next controller reads when it takes the workflow over. (Scaling
       the Deployment to 0 is no such fault: the controller goes on reconciling through its
       30 s of graceful termination, and saw the 8 s pod end.)
    2. the controller's pod deleted mid-train: the next controller takes the workflow over
       (Argo's docs/high-availability.md) and the train pod runs on untouched.

    The run ends as an undisturbed one, byte for byte."""
    name = unique("chaos-controller")
    empty_memo_cache()
    argo.create_workflow(compiled(*LONG_TRAIN, name=name))
    pod = until(lambda: step_pod(name, "preprocess"), 600, "preprocess's pod", every=0.2)
    lost, pid = controller_pods(), controller_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        until(lambda: phase(NAMESPACE, pod) == "Succeeded", 300,
              "preprocess's pod ended, its dataset saved", every=0.5)
        # the frozen controller never saw the pod run, let alone end
        assert argo_nodes(argo.get_workflow(name))["preprocess"]["phase"] in ("Pending",
                                                                              "Running")
    finally:
        kubectl("-n", CONTROLLER_NAMESPACE, "delete", "pod", lost, "--grace-period=0",
                "--force")
        os.kill(pid, signal.SIGCONT)          # the kubelet's kill then ends it
    train = running_train(store, name)
    old = controller_pods(running=True)
    kubectl("-n", CONTROLLER_NAMESPACE, "delete", "pod", old, "--wait=false")
    assert phase(NAMESPACE, train) == "Running"          # the fault hit mid-train
    new = until(lambda: controller_pods(running=True).replace(old, "").strip(), 180,
                "a new controller")
    wf = wait(argo, name)
    assert wf["status"]["phase"] == "Succeeded", wf["status"].get("message")
    table = argo_nodes(wf)
    assert table["preprocess"]["phase"] == "Succeeded" and not table["preprocess"]["memoized"]
    assert table["train"]["attempts"] == 1 and table["train"]["exit_codes"] == [0], table
    one_pod_per_attempt(name)
    release.check(name, tmp_path, train_retried=False)
    record("controller lost while preprocess saved, then its pod deleted mid-train", wf,
           controllers=[lost, old, new])


# The host processes, in the order they go down in one run, each back before the next: the
# command that says it is back (the API server's readyz checks its etcd too).
READYZ = ("get", "--raw", "/readyz")
HOST_FAULTS = (
    ("kubelet", 30, ("get", "node", "localhost", "-o",
                     "jsonpath={.status.conditions[?(@.type=='Ready')].status}")),
    ("etcd", 10, READYZ),
    ("kube-apiserver", 30, READYZ),
)


# beyond CI since 2026-11-29: 5-7 min of the node, and a race of Argo v4.0.5
# that can leave its run waiting for ever (stuck_pods); docs/status.md
@pytest.mark.beyond_ci
def test_the_kubelet_etcd_and_api_server_down_in_turn_lose_nothing(argo, store, release,
                                                                   tmp_path):
    """One run, from train's first checkpoint on: the kubelet down 30 s (a restart), then etcd
    restarted (down 10 s), then the API server down 30 s (an upgrade), each back before the
    next goes down, the run still Running when each goes down. The pods run on, the controller
    and the watch (workflows/argo.py) ride it out, and the run ends as an undisturbed one, byte
    for byte.

    The API server goes last because it alone may cost an attempt. Pods reach it through the
    `kubernetes` Service, which has no endpoint until the restarted server has re-added its
    lease: about a minute from the stop, measured. A step that ends in that minute loses its
    attempt: Argo v4.0.5's executor retries the report of its outputs "effectively
    infinitely" (workflow/executor/executor.go, reportResult), but with a Cap of 30 s, at which
    apimachinery's backoff sets its steps to zero (k8s.io/apimachinery v0.33.1
    pkg/util/wait/backoff.go, delay), so it gives up after about 31 s; the attempt is an Error
    naming the refused connection (once, "pod deleted" instead), and the retry resumes from
    the checkpoint (train) or runs again (convert, whose output is the same bytes). When what
    it gives up is its last report (FinalizeOutput), the pod Succeeds and Argo waits on it
    for ever (seen 2026-11-29; :func:`stuck_pods`): the test deletes that pod as
    docs/operations.md tells a user, and the attempt is lost as "pod deleted"."""
    name = unique("chaos-hosts")
    argo.create_workflow(compiled(*LONG_TRAIN, name=name))
    running_train(store, name)
    hit = {}
    for process, down_s, ready in HOST_FAULTS:
        wf = argo.get_workflow(name)
        assert wf["status"]["phase"] == "Running", f"the run ended before {process} went down"
        hit[process] = sorted(t for t, n in argo_nodes(wf).items() if n["phase"] == "Running")
        restart(process, down_s)
        until(lambda: kubectl(*ready, check=False).strip() in ("ok", "True"), 180,
              f"{process} back")
    wf, mended = wait_mending_stuck(argo, name)
    assert wf["status"]["phase"] == "Succeeded", wf["status"].get("message")
    lost = {n["displayName"]: n.get("message", "") for n in wf["status"]["nodes"].values()
            if re.search(r"\(\d+\)$", n["displayName"]) and n["phase"] != "Succeeded"}
    # the lost attempt's message: the executor's refused report, or, seen once, "pod
    # deleted" for a pod that was still there (the controller's informer, relisting after the
    # restart, missed it: operator.go podReconciliation)
    assert len(lost) <= 1 and all("10.96.0.1:443" in m or m == "pod deleted"
                                  for m in lost.values()), lost
    if "train(0)" in lost:
        assert f"resumed from s3://{BUCKET}/checkpoints/{name}/" in \
            attempt_log(store, wf, "train", 1)
    one_pod_per_attempt(name)
    release.check(name, tmp_path, train_retried=True)
    assert len(mended) <= 1 and (not mended or list(lost.values()) == ["pod deleted"]), \
        (mended, lost)
    record("kubelet down 30 s, etcd 10 s, then the API server 30 s, in turn from mid-train", wf,
           running_at_each_fault=hit, lost_attempts={k: v[:160] for k, v in lost.items()},
           stuck_pods_deleted=mended)


# beyond CI since 2026-11-29: 4 min of the node (docs/status.md)
@pytest.mark.beyond_ci
def test_a_train_pod_evicted_for_its_scratch_is_retried_and_resumes(argo, store, release,
                                                                     tmp_path):
    """The kubelet evicts the running train's pod, as it does under disk pressure: a process
    in it writes a bounded file (its ``ephemeral-storage`` limit and 64 MiB) into the main
    container's writable layer. The kubelet's eviction manager checks every pod's local storage
    against its limits every 10 s, with no eviction threshold set (Kubernetes v1.35.4
    pkg/kubelet/eviction/eviction_manager.go synchronize and localStorageEviction; the
    writable layer's size from containerd's CRI stats, scanned every 10 s), marks the pod
    Failed, reason ``Evicted``, and kills it; Argo retries the attempt, which resumes from the
    checkpoint. The filler goes with the evicted pod's containers (the kubelet's container GC
    removes an evicted pod's containers: pkg/kubelet/kuberuntime/kuberuntime_gc.go
    evictContainers, ShouldPodContentBeRemoved), so nothing of it stays on the node."""
    name = unique("chaos-evict")
    # Twelve epochs, not LONG_TRAIN's three: the kubelet sees the filler 10 to 30 s after it is
    # written (containerd's snapshot usage, refreshed every 10 s, then the eviction manager's
    # 10 s loop). With three epochs of about 7 s on the AMD VM, the train had one epoch left
    # when it was evicted (2026-11-30, 12 s after the filler), so a slower eviction let it end
    # first: Succeeded, never evicted, the timeout seen once that day. Eleven epochs after the
    # first checkpoint leave about 75 s; a train that still ends first fails here, by name.
    overrides = (*LONG_TRAIN, "train.max_epochs=12")
    argo.create_workflow(compiled(*overrides, name=name))
    train = running_train(store, name)
    limit = kubectl("-n", NAMESPACE, "get", "pod", train, "-o",
                    "jsonpath={.spec.containers[?(@.name=='main')].resources.limits"
                    ".ephemeral-storage}")
    filler = quantity_bytes(limit) + (64 << 20)
    kubectl("-n", NAMESPACE, "exec", train, "-c", "main", "--", "sh", "-c",
            f"head -c {filler} /dev/zero > /tmp/chaos-filler")
    uid = kubectl("-n", NAMESPACE, "get", "pod", train, "-o", "jsonpath={.metadata.uid}")
    status = until(lambda: (s := pod_status(train)).get("reason") == "Evicted" and s
                   or s.get("phase") == "Succeeded" and s, 180, f"{train} evicted")
    assert status.get("reason") == "Evicted", f"{train} ended before the kubelet evicted it"
    assert status["phase"] == "Failed" and "ephemeral" in status["message"], status
    wf = wait(argo, name)
    assert wf["status"]["phase"] == "Succeeded", wf["status"].get("message")
    table = argo_nodes(wf)
    assert table["train"]["attempts"] == 2 and table["train"]["exit_codes"][-1] == 0, table
    first = next(n for n in wf["status"]["nodes"].values() if n["displayName"] == "train(0)")
    # Argo v4.0.5 takes a failed pod's message for its node's (operator.go inferFailedReason):
    # Failed, which the retry policy Always retries (processNodeRetries). Once in CI
    # (2026-11-29) the attempt was an Error instead: the controller marks a node whose pod it
    # no longer sees "pod deleted" (operator.go podReconciliation), the race the host faults'
    # case met too; retried all the same
    assert (first["phase"], first["message"].strip()) in (
        ("Failed", status["message"].strip()), ("Error", "pod deleted")), first
    assert f"resumed from s3://{BUCKET}/checkpoints/{name}/" in attempt_log(store, wf, "train", 1)
    one_pod_per_attempt(name)
    release.check(name, tmp_path, train_retried=True, overrides=overrides)
    until(lambda: not containers_of(uid), 180, f"the evicted pod's containers (and the "
          f"{filler >> 20} MiB filler in its writable layer) removed")
    record("train pod evicted (ephemeral storage)", wf, first_attempt=first.get("message"),
           eviction=status["message"].strip())


def test_the_s3_server_down_while_artifacts_move_then_the_train_pod_deleted_lose_nothing(
        argo, store, release, tmp_path):
    """One run, the memoization cache emptied first so that preprocess runs:

    1. the S3 Deployment stopped, kept stopped until S3_DOWN_S after the transfer under test
       has begun, and started again (on its persistent volume), twice, each time while Argo's
       executor moves an artifact: download's upload of raw (its
       wait container, once main has ended: main saves by key only a tar's files, and this
       source is generated, so the run is submitted with the server already stopped;
       preprocess's main reads raw from S3 itself since 2026-11-30, so an outage timed around
       its upload would meet its main), then train's load of the dataset (its init container).
       Each transfer waits the outage out (retried by minio-go, then by Argo's executor),
       ending only once the server is back; the bucket's objects outlive both restarts.
    2. ``kubectl delete pod`` on the running train, once its first checkpoint is in S3, as an
       operator or an autoscaler does. The kubelet sends the containers SIGTERM and the pod
       object goes once they have ended. Argo marks the attempt an Error, "pod deleted", when
       its informer never saw the pod end (v4.0.5 workflow/controller/operator.go,
       podReconciliation: a started node whose pod is no longer listed), or Failed with the
       step's own line for SIGTERM (exit 143) when it saw main end first (seen in a cold CI
       run on the AMD EPYC VM, 2026-11-29). Either way the retry strategy's policy Always
       retries it (lastRetry.exitCode is not 2); the next attempt resumes from the
       checkpoint.

    The run ends as an undisturbed one, byte for byte: steps.train restores the optimizer,
    the schedule, the RNG and the thread count with the epoch's checkpoint."""
    name = unique("chaos-s3")
    kept = f"chaos/{name}/written-before-the-restarts"
    store.client().put_object(Bucket=BUCKET, Key=kept, Body=name.encode())
    empty_memo_cache()
    # submitted once the server is gone: download's main needs no S3 for a generated source,
    # and stopping the server takes longer than that main runs, so an outage begun once main
    # ran could miss its upload (0 s, in CI on 2026-12-01)
    upload = s3_down_while(lambda: step_pod(name, "download", "main", "terminated"),
                           "download's main ended, its wait container uploading",
                           then=lambda: argo.create_workflow(compiled(*LONG_TRAIN, name=name)))
    until(lambda: argo_nodes(argo.get_workflow(name)).get("preprocess", {}).get("phase")
          == "Succeeded", 600, "preprocess Succeeded", every=0.5)
    load = s3_down_while(lambda: step_pod(name, "train", "init", "running") or
                         step_pod(name, "train", "init", "terminated"),
                         "train's init container loading")
    train = running_train(store, name)
    assert train == load.pod, \
        f"the outage cost train's attempt: {lost_attempt(load.pod, load.gone)}"
    # read before the loader's pod is deleted. The init's load can end before the server is
    # gone (1 s, seen in CI 2026-11-29): the outage then meets main's first S3 call, which
    # the pods' UNET_S3_MAX_ATTEMPTS (config/pipeline.yaml) rides out; the attempts below
    # show that it cost none
    transfers = {"wait": transfer_across_outage(upload, "wait")}
    init = {c["name"]: c["state"].get("terminated", {})
            for c in container_statuses(pod_status(load.pod))}["init"]
    met_by = "init" if datetime.fromisoformat(init["finishedAt"]) > load.gone + timedelta(
        seconds=1) else "main"           # finishedAt has whole seconds
    if met_by == "init":
        transfers["init"] = transfer_across_outage(load, "init")
    kubectl("-n", NAMESPACE, "delete", "pod", train, "--wait=false")
    wf = wait(argo, name)
    assert wf["status"]["phase"] == "Succeeded", wf["status"].get("message")
    table = argo_nodes(wf)
    assert not table["preprocess"]["memoized"], table
    assert table["train"]["attempts"] == 2 and table["train"]["exit_codes"][-1] == 0, table
    first = next(n for n in wf["status"]["nodes"].values() if n["displayName"] == "train(0)")
    assert first["phase"] in ("Error", "Failed") and DELETED.search(first.get("message", "")), \
        first
    assert f"resumed from s3://{BUCKET}/checkpoints/{name}/" in attempt_log(store, wf, "train", 1)
    one_pod_per_attempt(name)
    assert store.client().get_object(Bucket=BUCKET, Key=kept)["Body"].read() == name.encode()
    release.check(name, tmp_path, train_retried=True)
    record(f"S3 stopped while download uploaded, and again while train loaded (until "
           f"{S3_DOWN_S} s after each began, then started), then the train pod deleted "
           f"mid-step", wf, compare=False, first_attempt=first.get("message"),
           upload=transfers["wait"], load=transfers.get("init"), second_outage_met_by=met_by,
           second_outage_s=round((load.back - load.gone).total_seconds(), 1))


@pytest.mark.beyond_ci
def test_ten_users_at_once_share_the_cache_and_queue_for_the_node(argo, store, tmp_path):
    """Ten workflows submitted together from the published template, as ten users do: eight
    learning rates and one of them twice, all on a new source, so all ten would miss the
    memoization cache at once; the memo key's mutex (workflows/templates.py memoize) lets one
    download and one preprocess run and the other nine hit. The trains queue for the node's
    2 CPUs (each asks 1): Pending, unschedulable, not failed, and the pod's deadline does not
    count that wait (the kubelet counts activeDeadlineSeconds from the pod's start:
    Kubernetes v1.35.4 pkg/kubelet/active_deadline.go pastActiveDeadline). Every run ends
    Succeeded, one pod per attempt, none left Running; the two runs with the same parameters
    release the same model, byte for byte."""
    published = cli(argo, "publish")
    assert published.returncode == 0, published.stderr
    # a source of their own, so that no earlier run's cache entry serves them
    source = fresh_source()
    rates = ["0.001", "0.002", "0.003", "0.004", "0.005", "0.006", "0.007", "0.008", "0.009",
             "0.002"]
    start = time.monotonic()
    with ThreadPoolExecutor(len(rates)) as pool:
        submitted = list(pool.map(lambda rate: argo.submit_from_template(
            CFG.pipeline.model_name, [f"learning-rate={rate}", f"source={source}",
                                      "md5="]), rates))
    names = [wf["metadata"]["name"] for wf in submitted]
    queued = set()

    def all_ended() -> bool:
        listed = kubectl("-n", NAMESPACE, "get", "pods", "-o", "json", "-l",
                         f"workflows.argoproj.io/workflow in ({','.join(names)})")
        for pod in json.loads(listed)["items"]:
            if "-train-" in pod["metadata"]["name"] and any(
                    c["type"] == "PodScheduled" and c["status"] == "False" and
                    c.get("reason") == "Unschedulable"
                    for c in pod["status"].get("conditions", [])):
                queued.add(pod["metadata"]["name"])
        return all(argo.get_workflow(n)["status"].get("phase") not in (None, "", "Pending",
                                                                        "Running")
                   for n in names)

    until(all_ended, 1500, "ten workflows ended", every=3)
    wall = time.monotonic() - start
    runs = [argo.get_workflow(name) for name in names]
    assert [wf["status"]["phase"] for wf in runs] == ["Succeeded"] * len(runs), \
        [(wf["metadata"]["name"], wf["status"].get("message")) for wf in runs]
    tables = [argo_nodes(wf) for wf in runs]
    for step in ("download", "preprocess"):
        ran = [t[step] for t in tables if not t[step]["memoized"]]
        assert len(ran) == 1, (step, [t[step] for t in tables])
    assert queued, "no train waited for the node's CPUs"
    for name in names:
        one_pod_per_attempt(name)
    assert released_onnx(store, names[1], tmp_path) == released_onnx(store, names[-1], tmp_path)
    record("ten users at once", runs[0], compare=False, workflows=len(runs),
           wall_s=round(wall, 1), trains_queued=len(queued))
