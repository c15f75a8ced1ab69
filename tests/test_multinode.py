"""The multi-node train (a Kubeflow PyTorchJob from an Argo resource step) and its failure
modes (issue 26).

The first part checks the compiled YAML and the code against what training-operator v1.9.3 and
Argo v4.0.5 do (cited in workflows/multinode.py); each test failed on the YAML before the fix.
The second part (marker ``operator``) runs the job on the real operator, built from its Go
module (``bash cluster/build.sh training-operator``), on the single-node cluster of
tests/real_cluster.py, whose fixtures it shares. Without the cluster or the operator those
tests skip with the reason; ``UNET_REQUIRE_CLUSTER=1`` turns the skip into a failure.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from steps import handoff
from steps.errors import INPUT_ERROR_FILE_ENV
from workflows import multinode
from workflows.config import ConfigError, load_config, seconds
from workflows.unet import build

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "manifests"


def _doc(*overrides: str, profile: str | None = None) -> dict:
    return build(load_config(None, profile, ["resources.train.nodes=2", *overrides])).to_dict()


def _templates(doc: dict) -> dict:
    return {t["name"]: t for t in doc["spec"]["templates"]}


def _job(doc: dict) -> dict:
    return yaml.safe_load(_templates(doc)["train"]["resource"]["manifest"])


def _replicas(doc: dict) -> dict:
    return _job(doc)["spec"]["pytorchReplicaSpecs"]


# ---- 1. a failed, stopped or retried job releases every pod; one checkpoint writer ----------
def test_a_finished_job_releases_every_pod():
    """cleanPodPolicy None kept the surviving replicas (and their cards) after a failure."""
    assert _job(_doc())["spec"]["runPolicy"]["cleanPodPolicy"] == "All"


def test_attempts_share_one_job_name_so_rank0_pods_never_overlap():
    """generateName gave every Argo retry a new job beside the old one; with one name per
    workflow the pods are <job>-master-0 etc., and a name is not free until its pod is gone."""
    doc = _doc()
    job, tmpl = _job(doc), _templates(doc)["train"]
    assert job["metadata"]["name"] == "{{workflow.name}}-train"
    assert "generateName" not in job["metadata"]
    assert tmpl["resource"]["action"] == "apply"   # a retry re-attaches to a job still running
    ttl = job["spec"]["runPolicy"]["ttlSecondsAfterFinished"]
    first_wait = seconds(tmpl["retryStrategy"]["backoff"]["duration"])
    assert 5 < ttl < first_wait  # seen by argoexec's 5 s poll, gone before the retry applies


def test_stop_deletes_the_job_and_waits_for_its_pods():
    doc = _doc()
    release = _templates(doc)[doc["spec"]["onExit"]]["resource"]
    assert release["action"] == "delete" and "manifest" not in release
    flags = release["flags"]
    assert flags[0] == "pytorchjobs.kubeflow.org"
    assert flags[flags.index("--selector") + 1] == \
        f"{multinode.JOB_LABEL}={{{{workflow.name}}}}"
    assert _job(doc)["metadata"]["labels"][multinode.JOB_LABEL] == "{{workflow.name}}"
    assert {"--cascade=foreground", "--wait=true"} <= set(flags)


def test_the_workflow_account_may_delete_its_jobs():
    rules = yaml.safe_load_all((MANIFESTS / "base" / "rbac.yaml").read_text())
    role = next(d for d in rules if d and d["kind"] == "Role")
    verbs = {v for r in role["rules"] if "pytorchjobs" in r["resources"] for v in r["verbs"]}
    assert {"create", "get", "patch", "list", "delete"} <= verbs


def test_single_node_has_no_exit_handler():
    assert "onExit" not in build(load_config(None, None, [])).to_dict()["spec"]


# ---- 2. a bound the operator enforces ---------------------------------------------------------
def test_every_replica_pod_has_the_job_deadline():
    """training-operator v1.9.3 never re-checks runPolicy.activeDeadlineSeconds by itself
    (kubeflow/trainer#3358): a hung job ran past it. The pods' own deadline is the kubelet's."""
    job = _job(_doc("resources.train.timeout=90m"))
    assert job["spec"]["runPolicy"]["activeDeadlineSeconds"] == 5400
    for spec in job["spec"]["pytorchReplicaSpecs"].values():
        assert spec["template"]["spec"]["activeDeadlineSeconds"] == 5400


def test_replicas_never_restart_so_argo_limit_is_the_bound():
    """ExitCode recreated pods that exit >= 128 with no bound (backoffLimit counts container
    restarts of Running pods only, core/job.go PastBackoffLimit)."""
    doc = _doc()
    for spec in _replicas(doc).values():
        assert spec["restartPolicy"] == "Never"
    assert "backoffLimit" not in _job(doc)["spec"]["runPolicy"]
    assert _templates(doc)["train"]["retryStrategy"]["limit"] == 2


# ---- 3. bad input fails once, with the step's line ------------------------------------------
def test_the_pods_record_bad_input_and_end_the_job_with_a_verdict():
    script = _replicas(_doc())["Master"]["template"]["spec"]["containers"][0]["command"][2]
    assert f"{INPUT_ERROR_FILE_ENV}={multinode.INPUT_ERROR_FILE} python -m torch.distributed.run" \
        in script
    verdict = next(line for line in script.splitlines() if "steps.handoff refuse" in line)
    assert verdict.rstrip().endswith("exit 0; fi")


def test_the_step_writes_its_input_error_line_to_the_file(tmp_path):
    target = tmp_path / "input-error"
    env = {**os.environ, INPUT_ERROR_FILE_ENV: str(target)}
    run = subprocess.run([sys.executable, "-m", "steps.train", "--dataset", str(tmp_path / "no"),
                          "--model", str(tmp_path / "m"), "--device", "cpu"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert run.returncode == 2
    line = target.read_text().strip()
    assert line.startswith("error: ") and line in run.stderr
    assert len(target.read_text().splitlines()) == 1


def test_verify_of_a_refused_model_fails_with_the_step_line(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / handoff.REFUSAL).write_text("error: --fold 7: the dataset has no fold 7\n")
    code = handoff_main(["verify", "--artifact", "model", str(model)])
    assert code == 2
    assert capsys.readouterr().err.strip() == "error: --fold 7: the dataset has no fold 7"


def handoff_main(argv: list[str]) -> int:
    from steps.errors import run_main
    return run_main(handoff.main, argv)


def test_collect_model_does_not_retry_the_verdict():
    retry = _templates(_doc())["collect-model"]["retryStrategy"]
    assert retry["expression"] == "asInt(lastRetry.exitCode) != 2"


# ---- 4. the dl1 recipe passes admission -------------------------------------------------------
def _dl1_recipe() -> dict:
    text = (MANIFESTS / "README.md").read_text()
    recipe = text[text.index("For AWS dl1"):]
    return yaml.safe_load(re.search(r"```yaml\n(.*?)```", recipe, re.S).group(1))


def test_the_dl1_recipe_enforces_privileged_on_the_pipeline_namespace(tmp_path):
    """The recipe listed only ../aws-s3 and habana-system.yaml: the namespace stayed at Pod
    Security baseline, which refuses the train pod's hostIPC."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (manifests/install-kubectl.sh)")
    overlay = MANIFESTS / "overlays" / "dl1-recipe"   # beside aws-s3, as the recipe assumes
    overlay.mkdir()
    try:
        (overlay / "kustomization.yaml").write_text(yaml.safe_dump(_dl1_recipe()))
        for name in ("habana-system.yaml", "pipeline-namespace.yaml"):
            shutil.copy(MANIFESTS / "overlays" / "gaudi" / name, overlay / name)
        run = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True,
                             text=True, timeout=120)
    finally:
        shutil.rmtree(overlay)
    assert run.returncode == 0, run.stderr
    namespace = next(d for d in yaml.safe_load_all(run.stdout)
                     if d["kind"] == "Namespace" and d["metadata"]["name"] == "unet")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_the_readme_does_not_claim_no_host_ipc():
    text = (MANIFESTS / "README.md").read_text()
    assert "without host IPC" not in text and "no added capabilities" not in text


# ---- 5. SYS_NICE for a non-root user ----------------------------------------------------------
def test_the_gaudi_pod_asks_only_for_what_a_non_root_user_can_use():
    """kubernetes/kubernetes#56374: an added capability reaches only the bounding and
    inheritable sets of a non-root process, so SYS_NICE would do nothing for uid 1000."""
    doc = _doc(profile="fp32_8hpu_training")
    for spec in _replicas(doc).values():
        pod = spec["template"]["spec"]
        container = pod["containers"][0]
        assert "capabilities" not in (container.get("securityContext") or {})
        assert pod["hostIPC"] is True
    assert "capabilities" not in (_templates(build(load_config(
        None, "fp32_8hpu_training", [])).to_dict())["train"].get("securityContext") or {})


# ---- 6. metrics only with fields that exist ---------------------------------------------------
_PLACEHOLDER = re.compile(r"{{\s*([^}]+?)\s*}}")
# What every node of a template has, failed attempts included (steps.go prepareMetricScope):
# no ``retries`` (only a node with children) and no ``outputs`` (only what the wait container
# saved).
_ATTEMPT_SCOPE = re.compile(r"^(status|duration|inputs\.parameters\.[\w-]+"
                            r"|resourcesDuration\.\w+)$")


@pytest.mark.parametrize("multi", [False, True])
def test_every_metric_field_exists_on_a_failed_attempt(multi):
    """Argo fills every placeholder of a metric before it reads ``when``; a failed attempt has
    no ``{{retries}}`` and no output parameters, so each one added a MetricsError (operator.go
    computeMetrics, steps.go prepareMetricScope)."""
    doc = _doc() if multi else build(load_config(None, None, [])).to_dict()
    for tmpl in doc["spec"]["templates"]:
        for metric in (tmpl.get("metrics") or {}).get("prometheus", []):
            for field in _PLACEHOLDER.findall(yaml.safe_dump(metric)):
                assert _ATTEMPT_SCOPE.match(field), (tmpl["name"], metric["name"], field)


# ---- 7. retry settings that mean what they say ------------------------------------------------
def test_a_cap_that_no_wait_reaches_is_refused():
    with pytest.raises(ConfigError, match="backoff_cap 10m never applies"):
        load_config(None, None, ["retry.backoff_cap=10m"])
    cfg = load_config(None, None, ["retry.backoff_cap=45s"])
    assert cfg.retry.backoff_cap == "45s"


def test_no_compiled_retry_has_a_cap_it_cannot_reach():
    for doc in (_doc(), build(load_config(None, None, [])).to_dict()):
        for tmpl in doc["spec"]["templates"]:
            retry = tmpl.get("retryStrategy") or {}
            backoff = retry.get("backoff") or {}
            if "cap" in backoff:
                longest = seconds(backoff["duration"]) * int(backoff["factor"]) ** (
                    int(retry["limit"]) - 1)
                assert seconds(backoff["cap"]) < longest, tmpl["name"]


# ---- on the real operator ---------------------------------------------------------------------
# The single-node cluster's fixtures (cluster up, our image loaded, S3, the namespace as the
# README deploys it) come from tests/real_cluster.py through tests/conftest.py.
from real_cluster import (BUCKET, CACHE, NAMESPACE, _script, _skip, api,  # noqa: E402
                          compiled, keys, kubectl, template, text, unique, until, wait)
from workflows.versions import pin  # noqa: E402

def on_the_operator(test):
    """A test on the real operator: slow, and allowed the cluster suite's time."""
    return pytest.mark.operator(pytest.mark.slow(pytest.mark.timeout(1800)(test)))


CONTAINERD = "/run/unet-cluster/containerd/containerd.sock"   # cluster/lib.sh CONTAINERD_SOCK

# 2 replicas x 1 CPU process (gloo) on the 2-core, 24 GiB node of the cluster profile.
MULTI = ("resources.train.nodes=2", "train.devices=1")
JOB_WAIT_S = 1200
WEBHOOK = "validator.training-operator.kubeflow.org"   # cmd/training-operator.v1/main.go


@pytest.fixture(scope="session")
def operator(cluster):
    """cluster/operator.sh: the operator's own install (its standalone overlay from the Go
    module) with the image built from that module."""
    version = pin("TRAINING_OPERATOR_VERSION")
    image = CACHE / f"training-operator-image-{version}" / "training-operator.tar"
    if not image.exists():
        _skip(f"the training operator is not built ({image}; bash cluster/build.sh "
              "training-operator training-operator-image)")
    run = _script("operator.sh", timeout=300)
    assert run.returncode == 0, f"cluster/operator.sh: {run.stderr[-600:]}"
    return version


def with_worker(doc: dict, worker: dict) -> dict:
    """Fault injection: ``worker`` merged into the PyTorchJob's Worker pod spec (the hung-job
    test's node selector that no node matches). The job is otherwise as compiled: its pods on
    the pod network, MASTER_ADDR (the master's headless Service) resolved by CoreDNS."""
    tmpl = template(doc, "train")
    job = yaml.safe_load(tmpl["resource"]["manifest"])
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"].update(worker)
    tmpl["resource"]["manifest"] = yaml.safe_dump(job, sort_keys=False, width=1000)
    return doc


def job_pods(workflow: str) -> list[dict]:
    out = kubectl("-n", NAMESPACE, "get", "pods", "-l",
                  f"training.kubeflow.org/job-name={workflow}-train", "-o", "json")
    return yaml.safe_load(out)["items"]


def jobs(workflow: str) -> list[dict]:
    out = kubectl("-n", NAMESPACE, "get", "pytorchjobs", "-l",
                  f"{multinode.JOB_LABEL}={workflow}", "-o", "json")
    return yaml.safe_load(out)["items"]


def nodes(wf: dict, task: str) -> list[dict]:
    return sorted((n for n in wf["status"]["nodes"].values()
                   if re.fullmatch(rf"{task}\(\d+\)", n["displayName"])),
                  key=lambda n: n["displayName"])


def exit_handler(wf: dict) -> dict:
    """The node of the Workflow's onExit handler (Argo names it ``<workflow>.onExit``)."""
    name = wf["metadata"]["name"]
    return next(n for n in wf["status"]["nodes"].values() if n["displayName"] == f"{name}.onExit")


def submit(argo, *overrides: str, tasks=("download", "preprocess", "share-dataset", "train",
                                         "collect-model"), worker: dict | None = None) -> str:
    doc = compiled(*MULTI, *overrides, name=unique("mn"), tasks=tasks)
    if worker:
        doc = with_worker(doc, worker)
    return argo.create_workflow(doc)["metadata"]["name"]


def dry_run(job: dict) -> str:
    """``kubectl create --dry-run=server`` of ``job``: what the API server, its admission
    webhooks included, says of it."""
    return kubectl("-n", NAMESPACE, "create", "--dry-run=server", "-f", "-",
                   stdin=yaml.safe_dump(job), check=False)


@on_the_operator
def test_the_operators_webhook_admits_the_compiled_job_and_refuses_two_masters(operator, argo):
    """The install registers the operator's validating webhook, which the API server calls
    through the operator's Service with the CA its cert rotator filled in. The compiled job
    (Argo's placeholders filled in as the controller would) passes it; with two masters it is
    refused by it (pkg/webhooks/pytorch: "must be 1"). In the pipeline's namespace (``argo``
    deploys it), where the job would be created."""
    hooks = json.loads(kubectl("get", "validatingwebhookconfiguration", WEBHOOK, "-o", "json"))
    hook = next(h for h in hooks["webhooks"] if h["name"].startswith("validator.pytorchjob."))
    assert hook["clientConfig"]["service"]["name"] == "training-operator"
    assert hook["clientConfig"].get("caBundle") and hook["failurePolicy"] == "Fail"
    manifest = template(compiled(*MULTI), "train")["resource"]["manifest"]
    manifest = manifest.replace("{{workflow.name}}", unique("webhook"))
    job = yaml.safe_load(re.sub(r"\{\{[^}]+\}\}", "1", manifest))
    said = dry_run(job)
    assert said.strip().endswith("created (server dry run)"), said
    job["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = 2
    said = dry_run(job)
    assert 'admission webhook "validator.pytorchjob.training-operator.kubeflow.org" denied' in said
    assert "Master].replicas: Forbidden: must be 1" in said, said


@on_the_operator
def test_the_job_trains_on_two_replicas_and_the_model_is_collected(operator, argo, store):
    name = submit(argo, tasks=())
    env = until(lambda: _master_env(name), 900, "the master pod")
    assert env["WORLD_SIZE"] == "2" and env["RANK"] == "0"
    assert env["MASTER_ADDR"] == f"{name}-train-master-0" and env["PET_NPROC_PER_NODE"] == "1"
    wf = wait(argo, name, timeout=JOB_WAIT_S)
    assert wf["status"]["phase"] == "Succeeded", wf["status"].get("message")
    assert len(nodes(wf, "train")) == 1
    collected = {n["displayName"]: n for n in wf["status"]["nodes"].values()}
    assert collected["collect-model"]["phase"] == "Succeeded"
    assert any(k.endswith("MANIFEST.json") for k in keys(store, f"{name}/shared/model/"))
    assert collected["convert"]["phase"] == "Succeeded"
    until(lambda: not job_pods(name) and not jobs(name), 120, "no pod and no job left")


def _master_env(name: str) -> dict | None:
    pods = [p for p in job_pods(name) if p["metadata"]["name"].endswith("master-0")]
    if not pods:
        return None
    env = pods[0]["spec"]["containers"][0]["env"]
    return {e["name"]: e.get("value") for e in env}


@on_the_operator
def test_a_killed_replica_fails_the_job_and_the_retry_resumes(operator, argo, store):
    name = submit(argo, "train.max_epochs=6", "train.steps_per_epoch=10",
                  "train.min_epochs=6")
    until(lambda: any(k.endswith("latest") for k in keys(store, f"checkpoints/{name}/")),
          900, "the first checkpoint")
    worker = next(p for p in job_pods(name) if p["metadata"]["name"].endswith("worker-0"))
    first_uid = worker["metadata"]["uid"]
    container = worker["status"]["containerStatuses"][0]["containerID"].split("//")[1]
    subprocess.run(["ctr", "--address", CONTAINERD, "-n", "k8s.io", "tasks", "kill", "-s",
                    "SIGKILL", container], check=True, timeout=60)
    log = until(lambda: _resumed_log(name, first_uid), 900, "the retry's master to resume")
    assert f"resumed from s3://{BUCKET}/checkpoints/{name}/" in log
    wf = wait(argo, name, timeout=JOB_WAIT_S)
    assert wf["status"]["phase"] == "Succeeded", wf["status"].get("message")
    assert [n["phase"] for n in nodes(wf, "train")] == ["Failed", "Succeeded"]
    until(lambda: not job_pods(name) and not jobs(name), 120, "no pod and no job left")


def _resumed_log(name: str, old_uid: str) -> str | None:
    pods = [p for p in job_pods(name) if p["metadata"]["name"].endswith("master-0")
            and p["metadata"]["uid"] != old_uid and p["status"].get("containerStatuses")]
    if not pods:
        return None
    log = kubectl("-n", NAMESPACE, "logs", pods[0]["metadata"]["name"], check=False)
    return log if "resumed from" in log else None


@on_the_operator
def test_bad_input_fails_once_with_the_step_line(operator, argo, store):
    name = submit(argo, "train.fold=4")   # 4 tiny cases: fold 4 has no validation case
    wf = wait(argo, name, timeout=JOB_WAIT_S)
    assert wf["status"]["phase"] == "Failed"
    assert len(nodes(wf, "train")) == 1 and nodes(wf, "train")[0]["phase"] == "Succeeded"
    collect = nodes(wf, "collect-model")
    assert len(collect) == 1 and collect[0]["outputs"]["exitCode"] == "2"
    line = text(store, f"{name}/shared/model/{handoff.REFUSAL}").strip()
    assert line.startswith("error: --fold 4")
    assert exit_handler(wf)["phase"] == "Succeeded"    # onExit ran after the failure
    until(lambda: not job_pods(name) and not jobs(name), 120, "no pod and no job left")


@on_the_operator
def test_argo_stop_deletes_the_job_and_its_pods(operator, argo, store):
    name = submit(argo, "train.max_epochs=50", "train.min_epochs=50")
    until(lambda: len([p for p in job_pods(name) if p["status"]["phase"] == "Running"]) == 2,
          900, "both replicas running")
    api(argo, "stop", name, {})     # what `argo stop` and the UI's Stop send
    wf = wait(argo, name, timeout=600)
    assert wf["status"]["phase"] == "Failed"
    assert exit_handler(wf)["phase"] == "Succeeded"
    assert not job_pods(name) and not jobs(name)


@on_the_operator
def test_the_deadline_ends_a_hung_job(operator, argo, store):
    """The worker can never be scheduled, so the master waits in the rendezvous: hung. The
    operator alone never fails it (kubeflow/trainer#3358); the kubelet ends the master at its
    pod deadline (the train timeout), the operator then fails the job and deletes every pod,
    the pending worker included (common/job.go -> DeletePodsAndServices)."""
    name = submit(argo, "resources.train.timeout=120s", "retry.limit=0",
                  worker={"nodeSelector": {"unet-argo/no-such-node": "true"}})
    wf = wait(argo, name, timeout=900)
    assert wf["status"]["phase"] == "Failed"
    message = nodes(wf, "train")[0]["message"]
    assert "failure condition" in message or "has been deleted" in message, message
    assert len(nodes(wf, "train")) == 1
    until(lambda: not job_pods(name) and not jobs(name), 120, "no pod and no job left")
