"""The local runner (emulator) on small hand-written Workflows against a real S3 server.

Steps are ``python tests/local_runner_step.py <action>`` run by the subprocess executor; the
S3 is the SeaweedFS fixture. The container executors are in tests/test_pods.py.
"""
from __future__ import annotations

import copy
import hashlib
import json
import re
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from steps import storage
from emulator.errors import LocalRunError
from emulator.dag import pod_name
from emulator.runner import run_workflow, validate_workflow
from emulator.expr import eval_depends, eval_when, substitute
from emulator.dag import fnv1a_32
from emulator.spec import duration_seconds

ROOT = Path(__file__).resolve().parent.parent
STEP = str(Path(__file__).resolve().parent / "local_runner_step.py")


# ---- Workflow builders ------------------------------------------------------------------------
def container(name: str, args: list[str], *, inputs: dict | None = None,
              outputs: dict | None = None, **extra) -> dict:
    template = {"name": name, "container": {"image": "python:3.11-slim",
                                            "command": ["python", STEP], "args": args}}
    if inputs:
        template["inputs"] = inputs
    if outputs:
        template["outputs"] = outputs
    template.update(extra)
    return template


def out_dir(name: str, path: str, **extra) -> dict:
    return {"name": name, "path": path, "archive": {"none": {}}, **extra}


def workflow(tasks: list[dict], templates: list[dict], parameters: dict | None = None) -> dict:
    params = [{"name": k, "value": v} for k, v in (parameters or {}).items()]
    templates = copy.deepcopy(templates)
    return {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow",
            "metadata": {"generateName": "lr-test-", "labels": {"app": "test"}},
            "spec": {"entrypoint": "main", "arguments": {"parameters": params},
                     "serviceAccountName": "someone",
                     "templates": [{"name": "main", "dag": {"tasks": tasks}}, *templates]}}


PRODUCE = container(
    "produce", ["produce", "--out", "{{outputs.artifacts.text.path}}",
                "--text", "{{inputs.parameters.text}}",
                "--param", "{{outputs.artifacts.text.path}}/../word"],
    inputs={"parameters": [{"name": "text"}]},
    outputs={"artifacts": [out_dir("text", "/work/text")],
             "parameters": [{"name": "word", "valueFrom": {"path": "/work/word"}}]})

CONSUME = container(
    "consume", ["consume", "--inp", "{{inputs.artifacts.text.path}}",
                "--out", "{{outputs.artifacts.shout.path}}"],
    inputs={"artifacts": [{"name": "text", "path": "/work/in/text"}]},
    outputs={"artifacts": [out_dir("shout", "/work/out/shout"),
                           {"name": "packed", "path": "{{outputs.artifacts.shout.path}}"},
                           out_dir("release", "/work/out/shout",
                                   s3={"key": "models/lr/{{workflow.name}}"})]})


def chain() -> dict:
    """a (produce) → b (consume a.text) → c (produce with a's output parameter)."""
    return workflow(
        [{"name": "a", "template": "produce",
          "arguments": {"parameters": [{"name": "text", "value": "{{workflow.parameters.msg}}"}]}},
         {"name": "b", "template": "consume", "depends": "a",
          "arguments": {"artifacts": [{"name": "text",
                                       "from": "{{tasks.a.outputs.artifacts.text}}"}]}},
         {"name": "c", "template": "produce", "depends": "a && b.Succeeded",
          "arguments": {"parameters": [
              {"name": "text", "value": "again-{{tasks.a.outputs.parameters.word}}"}]}}],
        [PRODUCE, CONSUME], {"msg": "hello"})


@pytest.fixture
def run(s3, tmp_path):
    """run_workflow against the fixture S3; collects the runner's log lines."""
    lines: list[str] = []

    def go(wf: dict, **kw):
        kw.setdefault("run_dir", tmp_path / "state")
        kw.setdefault("output_dir", tmp_path / "outputs")
        kw.setdefault("env", s3.env())
        kw.setdefault("bucket", s3.bucket)
        kw.setdefault("backoff_scale", 0.0)
        kw.setdefault("echo", None)
        return run_workflow(wf, log=lines.append, **kw)

    go.lines = lines
    return go


def keys(s3, prefix: str) -> set[str]:
    return set(storage.list_keys(f"s3://{s3.bucket}/{prefix}", client=s3.client()))


# ---- names and expressions (no S3) -----------------------------------------------------------
def test_pod_names_follow_argo_v2():
    assert fnv1a_32("") == 0x811C9DC5 and fnv1a_32("foobar") == 0xBF9CF968  # FNV-1a vectors
    expected = f"wf-abc12-train-{fnv1a_32('wf-abc12.train')}"
    assert pod_name("wf-abc12", "wf-abc12.train", "train") == expected
    assert pod_name("wf", "wf", "main") == "wf"
    assert pod_name("wf", "wf.t(0)", "t") != pod_name("wf", "wf.t(1)", "t")


def test_expressions():
    phases = {"a": "Succeeded", "b": "Failed", "c": "Skipped", "d": "Error"}
    assert eval_depends("a && c", phases, "x")
    assert eval_depends("b.Failed && !b", phases, "x")
    assert eval_depends("(a.Failed || d.Errored) && a.Succeeded", phases, "x")
    assert not eval_depends("a && b", phases, "x")
    assert eval_when("'fp32' == 'fp32' && 10 > 9", "x") and not eval_when("2 > 10", "x")
    key = substitute("k-{{=sprig.sha256sum(inputs.parameters['a-b'] + '|' + workflow.name)}}",
                     {"inputs.parameters.a-b": "s3://x", "workflow.name": "wf"}, "key")
    assert key == "k-" + hashlib.sha256(b"s3://x|wf").hexdigest()
    assert duration_seconds("1h30m", "x") == 5400 and duration_seconds(10, "x") == 10
    with pytest.raises(LocalRunError, match="unknown task 'zz'"):
        eval_depends("zz", phases, "x")
    with pytest.raises(LocalRunError, match="not supported"):
        substitute("{{=exec('rm')}}", {}, "args[0]")
    with pytest.raises(LocalRunError, match="'sprig.env' is not supported"):  # only what we use
        substitute("{{=sprig.env('HOME')}}", {}, "args[0]")


# ---- refusals (no S3: they happen before anything runs) --------------------------------------
def _mutate(path: str, value):
    wf = chain()
    target = wf
    *parents, last = path.split("/")
    for part in parents:
        target = target[int(part)] if part.isdigit() else target[part]
    target[last] = value
    return wf


@pytest.mark.parametrize("path,value,field", [
    ("spec/templates/1/script", {"image": "x", "source": "print(1)"}, "script"),
    ("spec/templates/1/podSpecPatch", "{}", "podSpecPatch"),
    ("spec/templates/1/sidecars", [{"name": "s", "image": "x"}], "sidecars"),
    ("spec/templates/1/container/envFrom", [{"secretRef": {"name": "s"}}], "envFrom"),
    ("spec/templates/0/dag/tasks/1/withItems", [1, 2], "withItems"),
    ("spec/onExit", "produce", "onExit"),
    ("spec/templates/1/container/volumeMounts", [{"name": "v", "mountPath": "/x"}], "volumeMounts"),
    ("spec/templates/0/dag/tasks/1/depends", "a.AnySucceeded", "AnySucceeded"),
    ("spec/templates/1/container/args", ["{{workflow.parameters.nope}}"],
     "workflow.parameters.nope"),
    ("spec/templates/1/outputs/artifacts/0/archive", {"zip": {}}, "zip"),
])
def test_unsupported_fields_are_refused_in_one_line(tmp_path, path, value, field):
    with pytest.raises(LocalRunError) as info:
        run_workflow(_mutate(path, value), run_dir=tmp_path, env={"AWS_ENDPOINT_URL": ""},
                     log=lambda _: None, echo=None)
    message = str(info.value)
    assert field in message and "\n" not in message
    assert not (tmp_path / "s3").exists()  # refused before any server or step started


def test_known_irrelevant_keys_are_noted_not_refused(run, s3):
    wf = chain()
    wf["spec"]["templates"][1].update(nodeSelector={"a": "b"}, tolerations=[],
                                      metrics={"prometheus": []})
    wf["spec"]["templates"][1]["container"]["resources"] = {"limits": {"cpu": "1"}}
    result = run(wf)
    assert result.succeeded
    notes = [line for line in run.lines if line.startswith("note:")]
    for key in ("nodeSelector", "tolerations", "metrics", "resources", "serviceAccountName"):
        assert any(key in line for line in notes), key


# ---- runs against the S3 fixture -------------------------------------------------------------
def test_dag_passes_artifacts_and_parameters_with_argo_keys(run, s3, tmp_path):
    result = run(chain())
    assert result.succeeded and result.exit_code == 0
    wf = result.workflow_name
    assert re.fullmatch(r"lr-test-[bcdfghjklmnpqrstvwxz2456789]{5}", wf)
    assert [n.task for n in result.nodes] == ["a", "b", "c"]
    a, b, c = result.nodes
    assert a.pod_name == pod_name(wf, f"{wf}.a", "produce")
    assert a.parameters == {"word": "hello"}
    assert c.parameters == {"word": "again-hello"}  # a's output parameter reached c
    # archive none: a prefix <workflow>/<pod>/<basename>/ with MANIFEST.json
    assert {f"{wf}/{a.pod_name}/text/text.txt", f"{wf}/{a.pod_name}/text/MANIFEST.json"} \
        <= keys(s3, f"{wf}/{a.pod_name}")
    # default archive: one <artifact>.tgz; explicit s3.key: used as is
    assert b.artifacts["packed"].key == f"{wf}/{b.pod_name}/packed.tgz"
    assert f"{wf}/{b.pod_name}/packed.tgz" in keys(s3, f"{wf}/{b.pod_name}")
    assert f"models/lr/{wf}/text.txt" in keys(s3, f"models/lr/{wf}")
    # b consumed a's artifact: its text is a's, upper-cased
    body = s3.client().get_object(Bucket=s3.bucket, Key=f"{wf}/{b.pod_name}/shout/text.txt")
    assert body["Body"].read() == b"HELLO"
    # leaf outputs copied (c's text); per-node timings recorded
    assert (tmp_path / "outputs" / "text" / "text.txt").read_text() == "again-hello"
    assert all(n.step_seconds > 0 and n.seconds >= n.step_seconds for n in result.nodes)
    assert result.overhead_seconds == pytest.approx(result.wall_seconds - result.step_seconds)
    record = json.loads((Path(result.run_dir) / "result.json").read_text())
    assert record["phase"] == "Succeeded" and len(record["nodes"]) == 3
    # each finished pod's volumes are gone, as the kubelet tears them down; its log stays
    for node in result.nodes:
        assert [p.name for p in Path(node.log_path).parent.iterdir()] == ["main.log"]
        assert node.max_disk_bytes > 0          # it held its artifacts while it ran


def test_tar_artifact_round_trips_into_a_consumer(run, s3):
    wf = chain()
    consume_packed = copy.deepcopy(CONSUME)
    consume_packed["name"] = "consume-packed"
    wf["spec"]["templates"].append(consume_packed)
    wf["spec"]["templates"][0]["dag"]["tasks"].append(
        {"name": "d", "template": "consume-packed", "depends": "b",
         "arguments": {"artifacts": [{"name": "text",
                                      "from": "{{tasks.b.outputs.artifacts.packed}}"}]}})
    result = run(wf)
    assert result.succeeded, result.message
    d = result.node("d")
    body = s3.client().get_object(Bucket=s3.bucket,
                                  Key=f"{result.workflow_name}/{d.pod_name}/shout/text.txt")
    assert body["Body"].read() == b"HELLO"


def test_presigned_link_downloads_the_onnx_model(run, s3):
    result = run(chain())
    release = result.models[:1]  # the stable key (explicit s3.key) comes first
    assert release and f"/models/lr/{result.workflow_name}/" in release[0].uri
    assert release[0].url.startswith(s3.endpoint)
    with urllib.request.urlopen(release[0].url, timeout=10) as response:
        assert response.read() == b"HELLO" * 3
    assert s3.secret_key not in release[0].url


def _flaky(limit: int, marker: Path) -> dict:
    flaky = container("flaky", ["flaky", "--marker", str(marker),
                                "--out", "{{outputs.artifacts.text.path}}"],
                      outputs={"artifacts": [out_dir("text", "/work/text")]},
                      retryStrategy={"limit": limit, "retryPolicy": "OnFailure",
                                     "backoff": {"duration": "1s", "factor": 2}})
    return workflow(
        [{"name": "f", "template": "flaky"},
         {"name": "b", "template": "consume", "depends": "f",
          "arguments": {"artifacts": [{"name": "text",
                                       "from": "{{tasks.f.outputs.artifacts.text}}"}]}}],
        [flaky, CONSUME])


def test_retry_succeeds_on_the_second_attempt(run, s3, tmp_path):
    result = run(_flaky(1, tmp_path / "marker"))
    assert result.succeeded, result.message
    node = result.node("f")
    wf = result.workflow_name
    assert node.attempts == 2
    assert node.pod_name == pod_name(wf, f"{wf}.f(1)", "flaky")  # Argo's retry child
    failed = Path(result.run_dir) / pod_name(wf, f"{wf}.f(0)", "flaky")
    assert (failed / "main.log").read_text().startswith("flaky: failing")
    assert [p.name for p in failed.iterdir()] == ["main.log"]    # a failed pod's too
    assert f"{wf}/{node.pod_name}/text/text.txt" in keys(s3, wf)


def test_failure_stops_the_dag(run, s3, tmp_path):
    result = run(_flaky(0, tmp_path / "marker"))
    assert result.phase == "Failed" and result.exit_code == 1
    assert result.node("f").phase == "Failed" and result.node("f").attempts == 1
    assert "exit code 1" in result.node("f").message
    assert result.node("b").phase == "Omitted"
    assert not keys(s3, result.workflow_name)  # nothing uploaded by the failed node
    assert not (tmp_path / "outputs").exists()


def test_failfast_false_still_runs_independent_tasks(run, s3):
    fail = container("fail", ["fail", "--code", "3"])
    wf = workflow([{"name": "x", "template": "fail"},
                   {"name": "y", "template": "produce",
                    "arguments": {"parameters": [{"name": "text", "value": "y"}]}},
                   {"name": "z", "template": "produce", "depends": "x.Failed",
                    "arguments": {"parameters": [{"name": "text", "value": "z"}]}}],
                  [fail, PRODUCE])
    wf["spec"]["templates"][0]["dag"]["failFast"] = False
    result = run(wf)
    assert [n.phase for n in result.nodes] == ["Failed", "Succeeded", "Succeeded"]
    assert result.phase == "Failed"


def _memoized(counter: Path) -> dict:
    produce = copy.deepcopy(PRODUCE)
    produce["container"]["args"] += ["--counter", str(counter)]
    produce["memoize"] = {"key": "produce-{{=sprig.sha256sum(inputs.parameters.text)}}",
                          "maxAge": "1h", "cache": {"configMap": {"name": "lr-cache"}}}
    wf = chain()
    wf["spec"]["templates"][1] = produce
    return wf


@pytest.mark.slow
def test_memoized_node_is_skipped_and_its_outputs_reused(run, s3, tmp_path):
    counter = tmp_path / "count"
    first = run(_memoized(counter))
    assert first.succeeded and not first.node("a").memoized
    assert counter.read_text().count("ran") == 2  # a and c
    second = run(_memoized(counter))
    assert second.succeeded
    a = second.node("a")
    assert a.memoized and a.attempts == 0 and a.step_seconds == 0
    assert a.artifacts["text"].key == first.node("a").artifacts["text"].key
    assert a.parameters == {"word": "hello"}
    assert second.node("c").memoized  # c's key (its text) was also seen in the first run
    assert counter.read_text().count("ran") == 2  # neither ran again
    assert not second.node("b").memoized  # b is not memoized: it ran on a's cached artifact
    assert keys(s3, "argo-local-memoize/lr-cache")
    third = run(_memoized(counter), parameters={"msg": "other"})
    assert not third.node("a").memoized and counter.read_text().count("ran") == 4


@pytest.mark.slow
def test_embedded_s3_keeps_results_between_runs(tmp_path, s3):
    """No AWS_ENDPOINT_URL: each run starts SeaweedFS on <run_dir>/s3 with fresh
    credentials; the second run still finds the first one's cache and artifacts."""
    counter, lines = tmp_path / "count", []
    no_s3 = {"AWS_ENDPOINT_URL": "", "AWS_ENDPOINT_URL_S3": ""}
    common = dict(run_dir=tmp_path / "state", env=no_s3, log=lines.append, echo=None)
    first = run_workflow(_memoized(counter), **common)
    assert first.succeeded and first.endpoint != s3.endpoint
    assert (tmp_path / "state" / "s3").is_dir()
    second = run_workflow(_memoized(counter), **common)
    assert second.succeeded and second.node("a").memoized
    assert counter.read_text().count("ran") == 2
    assert second.models and not second.models[0].url  # no link from a stopped server
    identity = json.loads((tmp_path / "state" / "s3" / "identities.json").read_text())
    secret = identity["identities"][0]["credentials"][0]["secretKey"]
    assert len(secret) > 20 and not any(secret in line for line in lines)


def test_memo_entries_expire_but_do_not_check_their_artifacts(s3_env):
    """Argo's cache hit is the stored outputs; whether the artifacts still exist is found
    out by the consumer (operator.go), so a hit does not look."""
    from emulator import memo
    from emulator.results import ArtifactRef
    s3 = s3_env
    storage.put_bytes(b"x", f"s3://{s3.bucket}/memo-test/a.txt")
    ref = ArtifactRef("a", s3.bucket, "memo-test/a.txt", "none", "file")
    memo.save(s3.bucket, "cm", "k-1", "wf.t", {"p": "v"}, {"a": ref})
    hit = memo.load(s3.bucket, "cm", "k-1", 3600)
    assert hit["parameters"] == {"p": "v"} and hit["artifacts"]["a"] == ref
    assert memo.load(s3.bucket, "cm", "k-1", 0) is None  # older than maxAge
    s3.client().delete_object(Bucket=s3.bucket, Key="memo-test/a.txt")
    assert memo.load(s3.bucket, "cm", "k-1", 3600)["artifacts"]["a"] == ref
    assert memo.load(s3.bucket, "cm", "never-saved", 3600) is None


def test_memo_hit_with_deleted_artifacts_fails_at_the_consumer(run, s3, tmp_path):
    """As on a cluster: the memoized node Succeeds, the consumer's input fails to load
    (an Error whose step never ran: lastRetry.exitCode is -1, so it is retried)."""
    counter = tmp_path / "count"
    first = run(_memoized(counter))
    assert first.succeeded
    text = first.node("a").artifacts["text"]
    client = s3.client()
    for key in keys(s3, text.key):
        client.delete_object(Bucket=s3.bucket, Key=key)
    wf = _memoized(counter)
    wf["spec"]["templates"][2]["retryStrategy"] = {
        "limit": 1, "retryPolicy": "Always", "expression": "asInt(lastRetry.exitCode) != 2"}
    second = run(wf)
    a, b = second.node("a"), second.node("b")
    assert a.phase == "Succeeded" and a.memoized
    assert b.phase == "Error" and "artifact text failed to load" in b.message, b.message
    assert b.attempts == 2 and b.step_seconds == 0  # retried (exit code -1), never ran
    assert b.exit_codes == [None, None]
    assert second.phase == "Error"     # the failed branch's phase, as on Argo v4.0.5


def _sleepy(retry: dict, marker: Path, code: int = 1) -> dict:
    sleepy = container("sleepy", ["sleepy", "--marker", str(marker), "--code", str(code)],
                       retryStrategy=retry)
    return workflow([{"name": "s", "template": "sleepy"}], [sleepy])


@pytest.mark.slow
def test_retry_max_duration_is_a_deadline_that_kills_a_later_attempt(run, tmp_path):
    """Argo: maxDuration counts from the first attempt's start; a retry still running when
    it passes is stopped (ARGO_DEADLINE), and no attempt follows."""
    retry = {"limit": 3, "retryPolicy": "Always",
             "backoff": {"duration": "1s", "factor": 1, "maxDuration": "4s"}}
    result = run(_sleepy(retry, tmp_path / "marker"))
    node = result.node("s")
    assert node.phase == "Failed" and node.attempts == 2
    assert "Step exceeded its deadline" in node.message
    assert "Max duration limit exceeded" in node.message
    assert node.seconds < 30  # not the step's 120 s sleep


def test_retry_expression_sees_the_exit_code(run, tmp_path):
    retry = {"limit": 3, "retryPolicy": "Always", "expression": "asInt(lastRetry.exitCode) != 2",
             "backoff": {"duration": "1s"}}
    result = run(_sleepy(retry, tmp_path / "marker", code=2))
    node = result.node("s")
    assert node.phase == "Failed" and node.attempts == 1  # exit 2 is not retried


def test_empty_directory_output_fails_at_its_consumer(run):
    """Argo's S3 driver uploads no object for an empty directory and its loader finds none."""
    empty = {"name": "empty", "container": {
        "image": "python:3.11-slim", "command": ["python", "-c"],
        "args": ["import os; os.makedirs('{{outputs.artifacts.text.path}}')"]},
        "outputs": {"artifacts": [out_dir("text", "/work/text")]}}
    wf = workflow([{"name": "e", "template": "empty"},
                   {"name": "b", "template": "consume", "depends": "e",
                    "arguments": {"artifacts": [{"name": "text",
                                                 "from": "{{tasks.e.outputs.artifacts.text}}"}]}}],
                  [empty, CONSUME])
    result = run(wf)
    assert result.node("e").phase == "Succeeded"
    assert result.node("b").phase == "Error" and "failed to load" in result.node("b").message


def test_config_map_references_resolve_from_the_local_store(run, s3):
    def probe(name: str, ref: dict) -> dict:
        template = container(name, ["env", "--text", "AWS_ENDPOINT_URL", "--out", "/work/v"],
                             outputs={"parameters": [{"name": "v",
                                                      "valueFrom": {"path": "/work/v"}}]})
        template["container"]["env"] = [{"name": "AWS_ENDPOINT_URL",
                                         "valueFrom": {"configMapKeyRef": ref}}]
        return template
    storage_ref = {"name": "unet-storage", "key": "endpoint", "optional": True}
    other_ref = {"name": "other", "key": "endpoint", "optional": True}
    wf = workflow([{"name": "s", "template": "s"}, {"name": "o", "template": "o"}],
                  [probe("s", storage_ref), probe("o", other_ref)])
    result = run(wf)
    assert result.node("s").parameters["v"] == s3.endpoint  # the run's S3 stands in
    result = run(wf, configmaps={"other": {"endpoint": "http://elsewhere:9000"},
                                 "unet-storage": {"endpoint": "http://minio:9000"}})
    assert result.node("s").parameters["v"] == "http://minio:9000"
    assert result.node("o").parameters["v"] == "http://elsewhere:9000"


def test_a_resource_field_ref_gives_the_cpu_request_rounded_up(run):
    """The templates' ``UNET_CPUS`` comes from the pod's CPU request through the downward
    API; the runner gives the step the value a kubelet would (1500m: 2)."""
    probe = container("cpus", ["env", "--text", "UNET_CPUS", "--out", "/work/v"],
                      outputs={"parameters": [{"name": "v", "valueFrom": {"path": "/work/v"}}]})
    probe["container"]["resources"] = {"requests": {"cpu": "1500m"}}
    probe["container"]["env"] = [{"name": "UNET_CPUS", "valueFrom": {"resourceFieldRef": {
        "resource": "requests.cpu", "divisor": "1"}}}]
    result = run(workflow([{"name": "c", "template": "cpus"}], [probe]))
    assert result.succeeded, result.message
    assert result.node("c").parameters["v"] == "2"


def test_a_work_volume_is_a_folder_of_the_pod(run, s3):
    wf = chain()
    for template in wf["spec"]["templates"][1:]:
        template["volumes"] = [{"name": "work", "emptyDir": {"sizeLimit": "1Gi"}}]
        template["container"]["volumeMounts"] = [{"name": "work", "mountPath": "/work"}]
    result = run(wf)
    assert result.succeeded, result.message
    wf["spec"]["templates"][1]["volumes"] = [{"name": "work", "hostPath": {"path": "/tmp"}}]
    with pytest.raises(LocalRunError, match="only emptyDir"):
        run(wf)


@pytest.mark.slow
def test_template_timeout_stops_the_step(run):
    sleepy = {"name": "sleepy", "timeout": "1s",
              "container": {"image": "python:3.11-slim", "command": ["python", "-c"],
                            "args": ["import time; time.sleep(60)"]}}
    result = run(workflow([{"name": "s", "template": "sleepy"}], [sleepy]))
    node = result.node("s")
    assert node.phase == "Failed" and "timed out" in node.message
    assert node.step_seconds < 15
    assert node.exit_codes == [143]   # SIGTERM as a container reports it (Argo v4.0.5: 143)
    assert node.cpu_seconds is None and node.max_rss_bytes is None   # stopped: not known
    assert node.max_disk_bytes is None


# One attempt: 0.5 s of CPU with 300 MiB resident; fails the first time (the marker file).
_WORK = """
import pathlib, sys, time
held = bytearray(300 << 20)
start = time.process_time()
while time.process_time() - start < 0.5:
    pass
marker = pathlib.Path(sys.argv[1])
if not marker.exists():
    marker.touch()
    sys.exit(1)
"""


def test_a_steps_cpu_time_and_peak_memory_are_its_own_over_its_attempts(run, tmp_path):
    """The step process's CPU time summed over its attempts, and its peak memory, the
    largest: not the runner's, though the runner holds 600 MiB more (getrusage's ru_maxrss
    of a child starts at its parent's); a child process's memory counts with it."""
    work = {"name": "work", "retryStrategy": {"limit": 1, "retryPolicy": "OnFailure"},
            "container": {"image": "python:3.11-slim", "command": ["python", "-c"],
                          "args": [_WORK, str(tmp_path / "marker")]}}
    small = {"name": "small", "container": {"image": "python:3.11-slim",
                                            "command": ["python", "-c"], "args": ["pass"]}}
    child = {"name": "child", "container": {
        "image": "python:3.11-slim", "command": ["python", "-c"],
        "args": ["import subprocess, sys; subprocess.run([sys.executable, '-c', "
                 "'import time; b = bytearray(200 << 20); time.sleep(0.5)'], check=True)"]}}
    runner_memory = bytearray(600 << 20)             # touched: resident in this process
    result = run(workflow([{"name": "w", "template": "work"}, {"name": "s", "template": "small"},
                           {"name": "c", "template": "child"}], [work, small, child]))
    del runner_memory
    node = result.node("w")
    assert result.succeeded and node.attempts == 2, result.message
    assert 1.0 <= node.cpu_seconds < 3.0
    assert 300 << 20 < node.max_rss_bytes < 400 << 20
    assert 300 << 20 < node.max_anon_bytes <= node.max_rss_bytes
    assert result.node("s").max_rss_bytes < 50 << 20
    assert 200 << 20 < result.node("c").max_rss_bytes < 300 << 20
    assert result.to_dict()["nodes"][0]["cpu_seconds"] == node.cpu_seconds


def test_invalid_memoization_key_is_refused(run):
    wf = _memoized(Path("/nonexistent"))
    wf["spec"]["templates"][1]["memoize"]["key"] = "{{inputs.parameters.text}}/x"
    result = run(wf)
    assert result.node("a").phase == "Error" and "memoization key" in result.node("a").message


def test_secrets_reach_the_step_but_never_the_logs(run, s3, tmp_path, capfd):
    secret = container(
        "secret", ["secret", "--out", "/work/digest"],
        outputs={"parameters": [{"name": "digest", "valueFrom": {"path": "/work/digest"}}]})
    secret["container"]["env"] = [
        {"name": "AWS_SECRET_ACCESS_KEY",
         "valueFrom": {"secretKeyRef": {"name": "creds", "key": "secretKey"}}},
        {"name": "AWS_ACCESS_KEY_ID",
         "valueFrom": {"secretKeyRef": {"name": "creds", "key": "accessKey"}}}]
    result = run(workflow([{"name": "s", "template": "secret"}], [secret]),
                 echo=sys.stderr)
    assert result.succeeded, result.message
    expected = hashlib.sha256(s3.secret_key.encode()).hexdigest()
    assert result.node("s").parameters["digest"] == expected
    captured = capfd.readouterr()
    texts = ["\n".join(run.lines), captured.out, captured.err,
             (Path(result.run_dir) / "result.json").read_text(),
             Path(result.node("s").log_path).read_text()]
    assert all(s3.secret_key not in text for text in texts)


def test_a_step_without_s3_env_gets_no_credentials(run, s3, tmp_path):
    probe = container("probe", ["secret", "--out", "/work/digest"],
                      outputs={"parameters": [{"name": "digest",
                                               "valueFrom": {"path": "/work/digest"}}]})
    result = run(workflow([{"name": "p", "template": "probe"}], [probe]))
    assert result.node("p").parameters["digest"] == hashlib.sha256(b"").hexdigest()


# ---- the compose file ------------------------------------------------------------------------
def test_compose_file_is_pinned_healthy_and_secret_free():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    minio = next(s for s in services.values() if "minio/minio" in s["image"])
    boot = next(s for s in services.values() if "minio/mc" in s["image"])
    for service in (minio, boot):
        image = service["image"]
        assert re.search(r":[\w.\-]+$", image) and not image.endswith(":latest"), image
    assert "test" in minio["healthcheck"]
    assert any(str(p).split(":")[-1].startswith("9001") or "9001" in str(p)
               for p in minio["ports"])  # console
    named = [v.split(":")[0] for v in minio["volumes"]]
    assert set(named) <= set(compose["volumes"])
    depends = boot["depends_on"]
    assert depends[next(iter(depends))]["condition"] == "service_healthy"
    assert boot.get("restart", "no") == "no"
    text = (ROOT / "docker-compose.yml").read_text()
    env_example = (ROOT / ".env.example").read_text()
    declared = set(re.findall(r"^([A-Z_][A-Z0-9_]*)=", env_example, re.M))
    for service in services.values():
        for key, value in (service.get("environment") or {}).items():
            if re.search(r"(PASSWORD|SECRET|USER|ACCESS_KEY)", key):
                assert re.fullmatch(r"\$\{[A-Z_][A-Z0-9_]*(:?[-?][^}]*)?\}", str(value)), key
    used = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", text))
    assert used <= declared, used - declared
    assert {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= declared


# ---- the project's own Workflow --------------------------------------------------------------
def test_the_pipeline_workflow_passes_the_runner_checks():
    from workflows import config, unet
    cfg = config.load_config(ROOT / "config" / "pipeline.yaml", None, [], local=True)
    notes = validate_workflow(unet.build(cfg, "workflow").to_dict())
    assert any("/dev/shm" in n for n in notes)


# Holds 64 MiB in its working folder for 2 s (the runner samples the folder every second),
# then leaves 1 MiB there.
_DISK = """
import os, time
with open("big", "wb") as f:
    f.write(os.urandom(64 << 20))
time.sleep(2)
os.remove("big")
with open("kept", "wb") as f:
    f.write(os.urandom(1 << 20))
"""


def test_a_steps_peak_disk_is_the_most_its_folder_held(run):
    """The pod's folder at its fullest, a file since deleted included: the blocks on disk,
    sampled while the step runs."""
    disk = {"name": "disk", "container": {"image": "python:3.11-slim",
                                          "command": ["python", "-c"], "args": [_DISK]}}
    result = run(workflow([{"name": "d", "template": "disk"}], [disk]))
    assert result.succeeded, result.message
    assert 64 << 20 <= result.node("d").max_disk_bytes < 70 << 20


# Reads a 128 MiB file through a memory map: resident, but file pages, not anonymous memory.
_MAPPED = """
import mmap, os, time
with open("data", "wb") as f:
    for _ in range(128):
        f.write(os.urandom(1 << 20))
with open("data", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
    total = sum(m[i] for i in range(0, len(m), 4096))
    time.sleep(0.5)
"""


def test_a_memory_mapped_file_counts_in_rss_not_in_anonymous_memory(run):
    mapped = {"name": "mapped", "container": {"image": "python:3.11-slim",
                                              "command": ["python", "-c"], "args": [_MAPPED]}}
    result = run(workflow([{"name": "m", "template": "mapped"}], [mapped]))
    node = result.node("m")
    assert result.succeeded, result.message
    assert node.max_rss_bytes > 128 << 20
    assert node.max_anon_bytes < 64 << 20
