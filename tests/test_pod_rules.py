"""What a cluster would break (issue 13, points 1-6): the compiled workflow keeps every pod
contract, and each rule catches the defect that the wave-1 YAML had (rebuilt here by undoing
the fix on today's compiled workflow, so each test fails on that YAML).

The rules are in workflows/pod_rules.py; the facts behind them are cited there.
"""
from __future__ import annotations

import copy
import json

import pytest
import yaml

from workflows.config import load_config, seconds
from workflows.lint import PYTORCHJOB_CRDS, crd, first_file, lint
from workflows.pod_rules import (deadlines, memoized_retries, multinode_job, references,
                                 writable_outputs)
from workflows.unet import build

needs_crd = pytest.mark.skipif(first_file(PYTORCHJOB_CRDS) is None,
                               reason=f"no PyTorchJob CRD: none of {PYTORCHJOB_CRDS} is there")
PROFILES = (None, "fp32_8hpu_training", "bf16_8hpu_training", "cuda_1gpu", "cpu_quick",
            "local")


def _doc(*overrides, profile=None) -> dict:
    return build(load_config(None, profile, list(overrides))).to_dict()


def _multinode() -> dict:
    return _doc("resources.train.nodes=2")


def _templates(doc) -> dict:
    return {t["name"]: t for t in doc["spec"]["templates"]}


def _job(doc) -> dict:
    return yaml.safe_load(_templates(doc)["train"]["resource"]["manifest"])


def _set_job(doc, job) -> None:
    _templates(doc)["train"]["resource"]["manifest"] = yaml.safe_dump(job, sort_keys=False)


# ---- 1. every step can write its outputs ---------------------------------------------------
@pytest.mark.parametrize("profile", PROFILES)
def test_every_output_is_on_a_writable_work_volume(profile):
    doc = _doc(profile=profile)
    assert writable_outputs(doc) == []
    cfg = load_config(None, profile, [])
    for tmpl in doc["spec"]["templates"]:
        if "container" in tmpl:
            work = {v["name"]: v for v in tmpl["volumes"]}["work"]
            assert work["emptyDir"]["sizeLimit"] == cfg.resources.work_volume_size
            assert {"name": "work", "mountPath": "/data"} in tmpl["container"]["volumeMounts"]


def test_multinode_pods_write_on_their_work_volume():
    doc = _multinode()
    assert writable_outputs(doc) == []
    for replica in _job(doc)["spec"]["pytorchReplicaSpecs"].values():
        spec = replica["template"]["spec"]
        assert "work" in {v["name"] for v in spec["volumes"]}


def test_outputs_on_no_volume_are_flagged():
    doc = _multinode()
    for tmpl in doc["spec"]["templates"]:
        if "container" in tmpl:  # wave 1: no volume, outputs in the image's root-owned /data
            tmpl.pop("volumes", None)
            tmpl["container"]["volumeMounts"] = [m for m in tmpl["container"].get(
                "volumeMounts", []) if m["name"] != "work"]
    job = _job(doc)
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        container = replica["template"]["spec"]["containers"][0]
        container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "work"]
    _set_job(doc, job)
    problems = writable_outputs(doc)
    for name in ("download", "preprocess", "convert", "share-dataset", "collect-model"):
        assert any(f"template {name} output" in p and "no declared volume" in p
                   for p in problems), name
    assert any("PyTorchJob Master writes /data/model" in p for p in problems)


def test_a_read_only_mount_is_not_writable():
    doc = _doc()
    download = _templates(doc)["download"]
    download["container"]["volumeMounts"][0]["readOnly"] = True
    assert any("read-only" in p for p in writable_outputs(doc))


# ---- 2. retries can happen; 6. every step has a deadline -------------------------------------
@pytest.mark.parametrize("profile", PROFILES)
def test_every_step_has_a_deadline_and_no_retry_cutoff(profile):
    doc = _doc(profile=profile)
    assert deadlines(doc) == []
    cfg = load_config(None, profile, [])
    t = _templates(doc)
    for name in ("download", "preprocess", "convert"):
        assert t[name]["activeDeadlineSeconds"] == \
            seconds(getattr(cfg.resources, name).timeout)
    assert t["train"]["activeDeadlineSeconds"] == seconds(cfg.resources.train.timeout)
    for tmpl in t.values():
        backoff = (tmpl.get("retryStrategy") or {}).get("backoff")
        if backoff:
            assert "maxDuration" not in backoff and backoff.get("cap") == cfg.retry.backoff_cap


@pytest.mark.parametrize("profile", PROFILES)
def test_no_template_memoizes_and_retries(profile):
    """The combination that hangs Argo v4's DAG on a cache hit (tests/test_cluster.py saw
    it on the real controller) is never compiled, and the rule catches it."""
    doc = _doc(profile=profile)
    assert memoized_retries(doc) == []
    t = _templates(doc)
    t["download"]["retryStrategy"] = t["train"]["retryStrategy"]
    assert memoized_retries(doc) == [
        "pods: template download has memoize and a retryStrategy; a cache hit leaves the DAG "
        "Running forever on Argo v4 (drop one of them)"]


def test_a_retry_deadline_shorter_than_the_attempts_is_flagged():
    doc = _doc()
    for tmpl in doc["spec"]["templates"]:
        if "retryStrategy" in tmpl:  # wave 1: maxDuration 10m and no step deadline
            tmpl["retryStrategy"]["backoff"]["maxDuration"] = "10m"
    problems = deadlines(doc)
    assert any("template train retryStrategy.backoff.maxDuration 10m" in p for p in problems)
    _templates(doc)["train"]["retryStrategy"]["backoff"]["maxDuration"] = "1000h"
    assert not any("template train" in p for p in deadlines(doc))  # 3 x 72 h + waits fit
    for tmpl in doc["spec"]["templates"]:
        tmpl.pop("activeDeadlineSeconds", None)
    assert any("template download has no activeDeadlineSeconds" in p
               for p in deadlines(doc))
    _templates(doc)["download"]["activeDeadlineSeconds"] = 600
    _templates(doc)["train"]["timeout"] = "72h"      # counts while queued: refused
    _templates(doc)["train"]["activeDeadlineSeconds"] = 3600
    assert [p for p in deadlines(doc) if "template train" in p] == [
        "pods: template train has a timeout, which fails its pod while it waits Pending for "
        "room; use activeDeadlineSeconds"]


def test_the_multinode_job_has_deadlines_inside_argos():
    doc = _multinode()
    cfg = load_config(None, None, ["resources.train.nodes=2"])
    job = _job(doc)
    job_deadline = job["spec"]["runPolicy"]["activeDeadlineSeconds"]
    assert job_deadline == seconds(cfg.resources.train.timeout)
    assert _templates(doc)["train"]["activeDeadlineSeconds"] > job_deadline
    assert deadlines(doc) == []


# ---- 3. the multi-node job neither crashes nor hangs ----------------------------------------
def test_multinode_world_size_and_failure_are_consistent():
    doc = _multinode()
    assert multinode_job(doc) == []
    job = _job(doc)
    assert job["spec"]["nprocPerNode"] == "{{inputs.parameters.devices}}"
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        assert replica["restartPolicy"] == "Never"   # issue 26: ExitCode recreated pods unbounded
    master = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert master["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456}]
    assert "--nodes 2" in master["command"][2]


def test_wave1_multinode_defects_are_flagged():
    doc = _multinode()
    job = _job(doc)
    job["spec"]["nprocPerNode"] = "8"  # while --devices is the workflow parameter
    del job["spec"]["runPolicy"]["activeDeadlineSeconds"]
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        replica["restartPolicy"] = "OnFailure"
        script = replica["template"]["spec"]["containers"][0]["command"]
        script[2] = script[2].replace(" --nodes 2", "")
    _set_job(doc, job)
    _templates(doc)["train"]["resource"]["failureCondition"] = \
        "status.replicaStatuses.Master.failed > 0"
    text = "\n".join(multinode_job(doc))
    for expected in ("restartPolicy OnFailure", "nprocPerNode '8' is not the step's --devices",
                     "2 pods but the step's --nodes is 1", "cannot see a job failed by",
                     "no runPolicy.activeDeadlineSeconds"):
        assert expected in text, expected


@pytest.mark.slow
@needs_crd
def test_the_pytorchjob_passes_the_operators_crd():
    doc = _multinode()
    assert crd(doc) == []
    job = _job(doc)
    job["spec"]["nprocPerNode"] = 8  # the CRD wants a string
    job["spec"]["runPolicy"]["activeDeadlineSeconds"] = "72h"
    _set_job(doc, job)
    problems = crd(doc)
    assert any("nprocPerNode" in p for p in problems)
    assert any("activeDeadlineSeconds" in p for p in problems)


def test_the_step_refuses_a_world_size_that_is_not_nodes_times_devices(monkeypatch):
    from steps import train
    from steps.errors import StepError
    monkeypatch.setenv("WORLD_SIZE", "16")
    with pytest.raises(StepError, match="--devices 8 x --nodes 1 does not match WORLD_SIZE 16"):
        train.main(["--dataset", "d", "--model", "m", "--devices", "8", "--batch-size", "64"])
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(StepError, match="--nodes 2: every node must be started"):
        train.main(["--dataset", "d", "--model", "m", "--nodes", "2"])


# ---- 4. references every overlay satisfies ---------------------------------------------------
@pytest.mark.parametrize("overrides", [[], ["resources.train.nodes=2"]])
def test_no_pod_needs_an_object_an_overlay_does_not_create(overrides):
    doc = _doc(*overrides)
    assert references(doc) == []


def test_a_required_secret_or_a_missing_config_map_is_flagged():
    doc = _doc()
    train = _templates(doc)["train"]
    for var in train["container"]["env"]:  # wave 1: the Secret was required
        ref = (var.get("valueFrom") or {}).get("secretKeyRef")
        if ref:
            ref.pop("optional")
        ref = (var.get("valueFrom") or {}).get("configMapKeyRef")
        if ref:
            ref["name"] = "unet-storag"
    problems = "\n".join(references(doc))
    assert "Secret 'unet-s3-credentials', which overlay aws-s3 does not create" in problems
    assert "ConfigMap 'unet-storag', which overlay local-minio does not create" in problems


# ---- 5. metrics measure training, once per run -----------------------------------------------
@pytest.mark.parametrize("overrides,trainer", [([], "train"),
                                               (["resources.train.nodes=2"], "train")])
def test_the_duration_metric_is_on_the_training_node_and_only_on_success(overrides, trainer):
    t = _templates(_doc(*overrides))
    found = {name: [p["name"] for p in (tmpl.get("metrics") or {}).get("prometheus", [])]
             for name, tmpl in t.items()}
    owners = [name for name, names in found.items() if "unet_train_duration_seconds" in names]
    assert owners == [trainer]  # the PyTorchJob node, not collect-model's copy
    duration = next(p for p in t[trainer]["metrics"]["prometheus"]
                    if p["name"] == "unet_train_duration_seconds")
    assert duration["when"] == "{{status}} == Succeeded"  # failed attempts add nothing
    # no {{retries}}: an attempt node lacks it, so it made a MetricsError (issue 26)
    assert "{{retries}}" not in str(duration["labels"])
    gauges = [n for n, names in found.items() if "unet_train_mean_dice" in names]
    assert gauges == ["convert"]   # from its inputs, which every convert node has (issue 26)


def test_the_wave1_workflow_fails_lint_and_todays_passes():
    doc = _multinode()
    assert lint(doc, env={})[0] == []
    broken = copy.deepcopy(doc)
    for tmpl in broken["spec"]["templates"]:
        tmpl.pop("activeDeadlineSeconds", None)
    problems, _ = lint(broken, env={})
    assert any(p.startswith("pods:") for p in problems)


# ---- the Gaudi train pod as Habana's docs specify it (issue 18) -------------------------------

def _train_pods(doc) -> list[dict]:
    """(pod spec, container) of every pod that trains: the Argo template, or the job's."""
    t = _templates(doc)["train"]
    if "resource" in t:
        job = yaml.safe_load(t["resource"]["manifest"])
        return [(spec["template"]["spec"], spec["template"]["spec"]["containers"][0])
                for spec in job["spec"]["pytorchReplicaSpecs"].values()]
    return [(json.loads(t.get("podSpecPatch", "{}")), t["container"])]


@pytest.mark.parametrize("nodes", [1, 2])
def test_the_gaudi_train_pod_has_what_habanas_docs_ask(nodes):
    """Intel Gaudi docs: Kubernetes Quick Start (docs.habana.ai/en/latest/Quick_Start_Guides/
    Kubernetes_Quick_Start.html) runs the job with hostIPC: true and capability SYS_NICE and
    asks habana.ai/gaudi and hugepages-2Mi; "Pull Prebuilt Containers" says --ipc=host is
    required for HCCL. Hugepages: the docs' 8-card example (AWS EKS guide, v1.9.0) asks
    42000Mi, here 5250Mi per card by default (resources.train.hugepages_2mi_per_card)."""
    doc = _doc(f"resources.train.nodes={nodes}")
    for pod, container in _train_pods(doc):
        assert pod["hostIPC"] is True
        # no SYS_NICE: uid 1000 could not use it (kubernetes/kubernetes#56374, issue 26)
        assert "capabilities" not in (container.get("securityContext") or {})
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        assert limits["habana.ai/gaudi"] == "8" and limits["hugepages-2Mi"] == "42000Mi"
        assert requests == limits      # hugepages and extended resources: requests = limits
    one = _doc("train.devices=2", "train.batch_size=64")
    assert _train_pods(one)[0][1]["resources"]["limits"]["hugepages-2Mi"] == "10500Mi"


@pytest.mark.parametrize("profile", ["cuda_1gpu", "local"])
def test_other_accelerators_get_no_host_ipc_or_capabilities(profile):
    for pod, container in _train_pods(_doc(profile=profile)):
        assert "hostIPC" not in pod and "securityContext" not in container
