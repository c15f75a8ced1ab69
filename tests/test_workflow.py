"""The compiled workflow: golden files, Argo's schema, Hera round-trip and project rules."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from steps import params, quantize
from steps.artifacts import write_outputs
from workflows.cli import FOLDS, GOLDEN_FILES
from workflows.config import load_config
from workflows.lint import (ARGO_SCHEMAS, REFERENCES, VALIDATOR, first_file, lint,
                            project_rules, round_trip, schema)
from workflows.unet import GOLDEN, build, render

REPO = Path(__file__).resolve().parent.parent
REGENERATE = "python workflows/unet.py render --golden"
needs_shared = pytest.mark.skipif(not VALIDATOR.is_file() or first_file(ARGO_SCHEMAS) is None,
                                  reason=f"{VALIDATOR} or every one of {ARGO_SCHEMAS} is absent")


def missing_references() -> dict[str, Path]:
    """Per lint check, the pinned version's own reference (the first of lint's REFERENCES,
    which cluster/build.sh downloads) where it is not here yet: lint then checks against
    ../shared's copy and says so in a note (CI's `lint --strict` fails on such a note)."""
    return {name: paths[0] for name, (_, paths) in REFERENCES.items() if not paths[0].is_file()}


def _doc(*overrides, kind="workflow", profile=None) -> dict:
    return build(load_config(None, profile, list(overrides)), kind).to_dict()


def _templates(doc) -> dict:
    return {t["name"]: t for t in doc["spec"]["templates"]}


@pytest.mark.parametrize("name", sorted(GOLDEN_FILES))
def test_golden_file_matches_render(name):
    kind, overrides = GOLDEN_FILES[name]
    rendered = render(load_config(None, None, overrides), kind)
    golden = (GOLDEN / name).read_text()
    assert rendered == golden, (f"{name} differs from the compiled YAML; if the change is "
                                f"intended, regenerate with: {REGENERATE}")


@needs_shared
@pytest.mark.parametrize("name", sorted(GOLDEN_FILES))
def test_golden_files_pass_argo_schema(name):
    doc = yaml.safe_load((GOLDEN / name).read_text())
    assert schema(doc) == []


@needs_shared
def test_schema_check_catches_a_misspelt_field():
    doc = _doc()
    _templates(doc)["train"]["retryStrategy"]["limt"] = 3
    assert any("limt" in p for p in schema(doc))


@pytest.mark.parametrize("kind", ["workflow", "template"])
@pytest.mark.parametrize("profile", [None, "cuda_1gpu", "local"])
def test_round_trip_drops_nothing(kind, profile):
    assert round_trip(_doc(kind=kind, profile=profile)) == []


def test_round_trip_reports_a_dropped_key():
    doc = _doc()
    doc["spec"]["templates"][0]["notAField"] = 1
    assert any("notAField" in p for p in round_trip(doc))


@pytest.mark.parametrize("overrides", [[], ["resources.train.nodes=2"], FOLDS])
def test_project_rules_pass_for_the_shipped_config(overrides):
    assert project_rules(_doc(*overrides), env={}) == []


def test_latest_image_is_flagged():
    problems = project_rules(_doc("images.cpu.tag=latest"), env={})
    assert problems and all(":latest" in p for p in problems)
    assert {"download", "preprocess", "convert"} <= {p.split()[2] for p in problems}


def test_literal_secret_in_config_is_flagged_without_printing_it():
    secret = "s3cr3t-Value-0123"
    doc = _doc(f"resources.extra_env={{MY_SETTING: {secret}}}")
    problems = project_rules(doc, env={"AWS_SECRET_ACCESS_KEY": secret})
    assert any("AWS_SECRET_ACCESS_KEY" in p for p in problems)
    assert not any(secret in p for p in problems)
    # The config refuses both (tests/test_config.py); lint finds them in a document written
    # or edited by other hands.
    named, keyish = _doc(), _doc()
    _templates(named)["train"]["container"]["env"].append({"name": "AWS_SECRET_ACCESS_KEY",
                                                           "value": "abc"})
    _templates(keyish)["train"]["container"]["env"].append({"name": "X",
                                                            "value": "AKIAABCDEFGHIJKLMNOP"})
    assert any("literal value" in p for p in project_rules(named, env={}))
    assert any("AWS access key id" in p for p in project_rules(keyish, env={}))


def test_unproduced_artifact_is_flagged():
    doc = _doc()
    dag = _templates(doc)["pipeline"]["dag"]
    convert = next(t for t in dag["tasks"] if t["name"] == "convert")
    convert["arguments"]["artifacts"][0]["from"] = "{{tasks.train.outputs.artifacts.weights}}"
    assert any("does not produce 'weights'" in p for p in project_rules(doc, env={}))


def test_a_missing_or_misspelt_task_parameter_is_flagged():
    """Argo refuses a run whose task leaves out a parameter its template declares without a
    default; one it misspells Argo drops silently, the template's own value used."""
    doc = _doc()
    train = next(t for t in _templates(doc)["pipeline"]["dag"]["tasks"] if t["name"] == "train")
    assert not [p for p in project_rules(doc, env={}) if p.startswith("parameters:")]
    rate = next(p for p in train["arguments"]["parameters"] if p["name"] == "learning-rate")
    rate["name"] = "learning_rate"
    assert project_rules(doc, env={}) == [
        "parameters: task train does not supply input parameter 'learning-rate'",
        "parameters: task train supplies 'learning_rate', which template train does not "
        "declare"]
    rate["name"] = "learning-rate"
    next(p for p in _templates(doc)["train"]["inputs"]["parameters"]
         if p["name"] == "learning-rate")["default"] = "0.001"
    train["arguments"]["parameters"].remove(rate)
    assert project_rules(doc, env={}) == []


def test_lint_command_passes_and_fails(capsys, monkeypatch):
    from workflows.cli import main
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "ARGO_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    assert main(["lint"]) == 0
    assert capsys.readouterr().out.count(": ok") == 2
    assert main(["lint", "-p", "images.gaudi.tag=latest"]) == 1
    assert ":latest" in capsys.readouterr().out


def test_lint_names_a_skipped_check_and_strict_fails_on_it(capsys, monkeypatch):
    """A check that could not run is never part of "ok"; --strict (CI) fails on it."""
    from workflows import lint as lint_module
    from workflows.cli import main
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "ARGO_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(lint_module, "schema", lambda doc: None)
    assert main(["lint"]) == 0
    out = capsys.readouterr().out
    ok = next(line for line in out.splitlines() if line.startswith("workflow: ok ("))
    assert "round-trip" in ok and "schema" not in ok and "workflow: schema: skipped" in out
    assert ("crd" in ok) == ("crd" not in missing_references()), out
    assert main(["lint", "--strict"]) == 1
    out = capsys.readouterr().out
    assert ": ok" not in out and out.count("error: schema: skipped") == 2


def test_lint_without_the_repositorys_pins_still_runs_and_says_so():
    """Installed without this repository (no cluster/lib.sh): lint imports, and where no
    schema of a pinned version can be found it names what it used or skipped."""
    code = ("from pathlib import Path\nimport workflows.versions as v\n"
            "v.LIB_SH = Path('/nonexistent/lib.sh')\nfrom workflows import lint\n"
            "from workflows.unet import build\nfrom workflows.config import load_config\n"
            "problems, notes = lint.lint(build(load_config(None, None, [])).to_dict())\n"
            "print(lint.ARGO_VERSION, problems, [n.split(':')[0] for n in notes])")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split(" ", 1)[0] == "unpinned", done.stdout
    assert "'schema'" in done.stdout and "'crd'" in done.stdout, done.stdout


def test_dag_wiring_and_artifacts():
    doc = _doc()
    t = _templates(doc)
    tasks = {x["name"]: x for x in t["pipeline"]["dag"]["tasks"]}
    assert tasks["preprocess"]["depends"] == "download"
    assert tasks["train"]["depends"] == "preprocess"
    assert tasks["convert"]["depends"] == "train"
    froms = {a["name"]: a["from"] for a in tasks["convert"]["arguments"]["artifacts"]}
    assert froms == {"model": "{{tasks.train.outputs.artifacts.model}}"}
    froms = {a["name"]: a["from"] for a in tasks["train"]["arguments"]["artifacts"]}
    assert froms == {"dataset": "{{tasks.preprocess.outputs.artifacts.dataset}}"}
    for name, art in (("download", "raw"), ("preprocess", "dataset"), ("train", "model"),
                      ("convert", "exported")):
        outs = {a["name"]: a for a in t[name]["outputs"]["artifacts"]}
        assert outs[art]["archive"] == {"none": {}}
    release = {a["name"]: a for a in t["convert"]["outputs"]["artifacts"]}["release"]
    assert release["s3"]["key"] == "models/unet2d-brats/{{workflow.name}}"
    assert doc["spec"]["artifactRepositoryRef"] == {"configMap": "artifact-repositories",
                                                    "key": "default-v1"}


def test_preprocess_reads_raw_by_key_from_the_uri_download_hands_on():
    """No ``raw`` input artifact (Argo would copy it whole into the pod): download saves it at
    a stated key and hands that key's URI on as ``raw-uri``, which preprocess takes as
    ``--raw`` with the S3 variables; download's memo entries are apart from the older ones,
    which lack the parameter."""
    doc = _doc()
    t = _templates(doc)
    key = "{{workflow.name}}/{{pod.name}}/raw"
    raw = {a["name"]: a for a in t["download"]["outputs"]["artifacts"]}["raw"]
    assert raw["s3"] == {"key": key} and raw["path"] == "/data/raw"
    uri = {p["name"]: p for p in t["download"]["outputs"]["parameters"]}["raw-uri"]
    assert uri["valueFrom"]["default"] == f"s3://unet-artifacts/{key}"
    assert t["download"]["memoize"]["key"].startswith("download-uri-")
    preprocess = t["preprocess"]
    assert "artifacts" not in preprocess["inputs"]
    args = preprocess["container"]["args"]
    assert args[args.index("--raw") + 1] == "{{inputs.parameters.raw-uri}}"
    env = {e["name"]: e for e in preprocess["container"]["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == \
        "unet-s3-credentials"
    task = {x["name"]: x for x in t["pipeline"]["dag"]["tasks"]}["preprocess"]
    given = {p["name"]: p["value"] for p in task["arguments"]["parameters"]}
    assert given["raw-uri"] == "{{tasks.download.outputs.parameters.raw-uri}}"
    assert "artifacts" not in task["arguments"]


@pytest.mark.parametrize("variant", [(), FOLDS])
def test_preprocess_saves_its_dataset_at_the_key_its_output_is_saved_at(variant):
    """``--dataset-uri`` is the bucket and the very key of preprocess's output artifact
    (both rendered with the pod's name), so the executor adds the manifest beside the cases
    the step saved. Train takes the artifact whole; convert, quantize and evaluate take that
    key's URI as ``dataset-uri`` and fetch the cases they use (``steps.dataset.read_dataset``),
    and preprocess's memo entries are apart from the older ones, which lack the parameter."""
    t = _templates(_doc(*variant))
    preprocess = t["preprocess"]
    out = {a["name"]: a for a in preprocess["outputs"]["artifacts"]}["dataset"]
    assert out["s3"] == {"key": "{{workflow.name}}/{{pod.name}}/dataset"}
    args = preprocess["container"]["args"]
    assert args[args.index("--dataset-uri") + 1] == f"s3://unet-artifacts/{out['s3']['key']}"
    assert args[args.index("--dataset") + 1] == "{{outputs.artifacts.dataset.path}}"
    tasks = {x["name"]: x for x in t["pipeline"]["dag"]["tasks"]}
    readers = [name for name, task in tasks.items() if any(
        a.get("from") == "{{tasks.preprocess.outputs.artifacts.dataset}}"
        for a in (task.get("arguments") or {}).get("artifacts") or [])]
    assert {r.split("-")[0] for r in readers} == ({"train", "ensemble"} if variant else
                                                 {"train"})
    uri = {p["name"]: p for p in preprocess["outputs"]["parameters"]}["dataset-uri"]
    assert uri["valueFrom"]["default"] == f"s3://unet-artifacts/{out['s3']['key']}"
    assert preprocess["memoize"]["key"].startswith("preprocess-uri-")
    by_key = {name: task for name, task in tasks.items() if any(
        p["value"] == "{{tasks.preprocess.outputs.parameters.dataset-uri}}"
        for p in task["arguments"].get("parameters") or [])}
    assert {"convert", "quantize"} <= {name.split("-")[0] for name in by_key}
    if variant:
        assert {name.split("-")[0] for name in by_key} == {"convert", "evaluate", "quantize"}
    for name, task in by_key.items():
        template = t[task["template"]]
        args = template["container"]["args"]
        assert args[args.index("--dataset") + 1] == "{{inputs.parameters.dataset-uri}}"
        assert "AWS_SECRET_ACCESS_KEY" in {e["name"] for e in template["container"]["env"]}
        assert "dataset" not in {a["name"] for a in template["inputs"].get("artifacts") or []}


@pytest.mark.parametrize("variant", [(), FOLDS, ("resources.train.nodes=2",)])
def test_every_task_supplies_its_templates_inputs(variant):
    """Each DAG task passes every input its template declares without a value (or, for an
    artifact, a location of its own): Argo refuses one that is missing only when the task
    runs."""
    t = _templates(_doc(*variant))
    for task in t["pipeline"]["dag"]["tasks"]:
        given = task.get("arguments") or {}
        declared = t[task["template"]].get("inputs") or {}
        for kind in ("parameters", "artifacts"):
            needed = {x["name"] for x in declared.get(kind) or []
                      if not {"value", "default", "optional", "s3", "raw", "http"} & set(x)}
            supplied = {x["name"] for x in given.get(kind) or []}
            assert needed <= supplied, (task["name"], kind, sorted(needed - supplied))


def test_folds_fan_out_after_preprocess_and_join_in_the_ensemble_and_the_pool():
    doc = _doc(*FOLDS)
    t = _templates(doc)
    tasks = {x["name"]: x for x in t["pipeline"]["dag"]["tasks"]}
    folds = range(5)
    assert "fold" not in {p["name"] for p in doc["spec"]["arguments"]["parameters"]}
    for k in folds:
        train, convert, evaluate = (tasks[f"{s}-fold-{k}"] for s in ("train", "convert",
                                                                      "evaluate"))
        assert (train["depends"], convert["depends"], evaluate["depends"]) == (
            "preprocess", f"train-fold-{k}", f"convert-fold-{k}")
        given = {p["name"]: p["value"] for p in train["arguments"]["parameters"]}
        assert given["fold"] == str(k)
        assert {a["name"]: a["from"] for a in convert["arguments"]["artifacts"]}["model"] == \
            f"{{{{tasks.train-fold-{k}.outputs.artifacts.model}}}}"
    assert not {"train", "convert", "evaluate"} & set(tasks)
    # each fold checkpoints apart: an attempt resumes its own fold only
    assert "/{{workflow.name}}/fold-{{inputs.parameters.fold}}/" in " ".join(
        t["train"]["container"]["args"])
    assert tasks["ensemble"]["depends"] == " && ".join(
        [f"convert-fold-{k}" for k in folds] + ["pool"])
    assert tasks["pool"]["depends"] == " && ".join(f"evaluate-fold-{k}" for k in folds)
    assert tasks["quantize"]["depends"] == "ensemble"
    assert {a["name"]: a["from"] for a in tasks["quantize"]["arguments"]["artifacts"]}[
        "exported"] == "{{tasks.ensemble.outputs.artifacts.exported}}"
    # the ensemble alone is released; the pool's means alone are the workflow's outputs
    releases = {n for n, x in t.items() for a in (x.get("outputs") or {}).get("artifacts", [])
                if a["name"] == "release"}
    assert releases == {"ensemble", "quantize"}
    outputs = {n for x in t.values() for n in
               [p["name"] for p in (x.get("outputs") or {}).get("parameters", [])
                if p.get("globalName")]}
    assert outputs == {"dice-wt", "dice-tc", "dice-et", "int8-mean-dice", "int8-speedup"}
    assert {p["globalName"] for p in t["pool"]["outputs"]["parameters"]} == {
        "dice-wt", "dice-tc", "dice-et"}
    args = t["ensemble"]["container"]["args"]
    assert args.count("--with-exported") == 4 and "--ensemble" in args
    assert args[args.index("--pooled") + 1] == "{{inputs.artifacts.pooled.path}}"
    assert {a["name"]: a["from"] for a in tasks["ensemble"]["arguments"]["artifacts"]}[
        "pooled"] == "{{tasks.pool.outputs.artifacts.pooled}}"
    assert t["pool"]["container"]["args"][:2] == ["pool", "--evaluation"]


def test_artifact_paths_reach_commands_only_through_variables():
    """No argument names a container path under /data itself (an S3 key may end in one)."""
    for tmpl in _doc()["spec"]["templates"]:
        for arg in (tmpl.get("container") or {}).get("args", []):
            path = arg.split("://", 1)[0] if "://" in arg else arg
            assert not re.search(r"(^|[\s=:])/data\b", path), \
                f"{tmpl['name']}: literal artifact path in {arg}"
        if "container" in tmpl:
            assert tmpl["container"]["command"] == ["python", "-m", f"steps.{tmpl['name']}"]


def test_steps_retry_with_backoff_and_data_steps_are_memoized_instead():
    """download and preprocess memoize and so cannot retry (pod_rules.memoized_retries)."""
    t = _templates(_doc())
    for name in ("train", "convert", "quantize"):
        assert t[name]["retryStrategy"]["backoff"]["duration"] == "30s"
        assert int(t[name]["retryStrategy"]["limit"]) == 2
    for name in ("download", "preprocess"):
        assert "retryStrategy" not in t[name]
        memo = t[name]["memoize"]
        assert memo["cache"]["configMap"]["name"] == "unet-memoize-cache"
        assert memo["maxAge"] == "720h"
        assert "inputs.parameters['source']" in memo["key"]
        assert "inputs.parameters['md5']" in memo["key"]
        # one run at a time per key: the others wait, then hit (templates.memoize)
        assert t[name]["synchronization"] == {"mutexes": [{"name": memo["key"]}]}
    assert "inputs.parameters['patch-size']" in t["preprocess"]["memoize"]["key"]
    assert "train" not in {n for n in t if "memoize" in t[n] or "synchronization" in t[n]}


def test_workflow_parameters_have_descriptions_and_enums():
    params = {p["name"]: p for p in _doc()["spec"]["arguments"]["parameters"]}
    for name in ("source", "md5", "fold", "devices", "batch-size", "max-epochs",
                 "learning-rate", "precision", "optimizer", "resume-from", "data-image-tag",
                 "train-image-tag"):
        assert params[name]["description"], name
    assert params["fold"]["enum"] == ["0", "1", "2", "3", "4"]
    assert params["optimizer"]["enum"] == ["adamw", "fusedadamw", "sgd"]
    assert params["precision"]["enum"] == ["auto", "fp32", "bf16", "fp16"]
    assert "8" in params["devices"]["enum"]


def test_gaudi_train_resources_and_outputs():
    t = _templates(_doc())["train"]
    res = t["container"]["resources"]
    assert res["limits"]["habana.ai/gaudi"] == res["requests"]["habana.ai/gaudi"] == "8"
    assert res["limits"]["hugepages-2Mi"] == "42000Mi"   # 5250Mi per card x 8
    shm = {v["name"]: v for v in t["volumes"]}["dshm"]["emptyDir"]
    assert shm["medium"] == "Memory"
    assert {"mountPath": "/dev/shm", "name": "dshm"} in t["container"]["volumeMounts"]
    assert t["nodeSelector"] and t["tolerations"]
    args = t["container"]["args"]
    uri = args[args.index("--checkpoint-uri") + 1]
    assert uri == "s3://unet-artifacts/checkpoints/{{workflow.name}}/"
    assert args[args.index("--resume-from") + 1] == "{{inputs.parameters.resume-from}}"
    outputs = {p["name"]: p["valueFrom"]["path"] for p in t["outputs"]["parameters"]}
    assert outputs["mean-dice"] == "{{outputs.artifacts.model.path}}/argo-outputs/mean_dice"
    assert set(outputs) == {"mean-dice", "best-epoch", "img-per-s"}
    metrics = {p["name"] for p in t["metrics"]["prometheus"]}
    assert metrics == {"unet_train_duration_seconds"}   # the gauges are on convert (issue 26)
    report = {a["name"]: a for a in t["outputs"]["artifacts"]}["report"]
    assert report["path"] == "{{outputs.artifacts.model.path}}/report"   # page and figures


def test_credentials_only_through_secret_refs():
    text = render(load_config())
    env = {e["name"]: e for e in _templates(_doc())["train"]["container"]["env"]}
    assert "secretKeyRef" in env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]
    assert "value" not in env["AWS_SECRET_ACCESS_KEY"]
    assert not re.search(r"AKIA[0-9A-Z]{16}", text)


@pytest.mark.parametrize("profile,resource,absent", [
    ("cuda_1gpu", "nvidia.com/gpu", "habana.ai/gaudi"),
    ("cpu_quick", "cpu", "nvidia.com/gpu"),
])
def test_accelerator_switches_resources(profile, resource, absent):
    res = _templates(_doc(profile=profile))["train"]["container"]["resources"]["limits"]
    assert resource in res and absent not in res and "habana.ai/gaudi" not in res


def test_template_kind_and_multinode_variant():
    template = _doc(kind="template")
    assert template["kind"] == "WorkflowTemplate"
    assert template["metadata"]["name"] == "unet2d-brats"
    multi = _doc("resources.train.nodes=2")
    t = _templates(multi)
    train = t["train"]["resource"]
    assert train["action"] == "apply" and train["setOwnerReference"] is True  # issue 26
    assert "succeeded > 0" in train["successCondition"]
    assert "status.conditions.3.type == Failed" in train["failureCondition"]
    job = yaml.safe_load(train["manifest"])
    assert job["kind"] == "PyTorchJob"
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    script = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert "s3://unet-artifacts/checkpoints/{{workflow.name}}/" in script["command"][2]
    assert "-m steps.train" in script["command"][2]
    tasks = {x["name"]: x for x in t["pipeline"]["dag"]["tasks"]}
    assert tasks["convert"]["depends"] == "collect-model"


@pytest.mark.slow
def test_render_script_and_module_agree(tmp_path):
    out = tmp_path / "wf.yaml"
    proc = subprocess.run([sys.executable, "workflows/unet.py", "render", "--kind", "template",
                           "-o", str(out)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == render(load_config(), "template")


@needs_shared
def test_full_lint_of_profiles():
    """Every profile lints clean; its only notes name the pinned references not downloaded
    here, once each (none in CI)."""
    missing = missing_references()
    for profile in ("fp32_8hpu_training", "bf16_8hpu_training", "cuda_1gpu", "cpu_quick",
                    "local"):
        problems, notes = lint(_doc(profile=profile), env={})
        assert problems == [], profile
        assert [note.split(":")[0] for note in notes] == list(missing), (profile, notes)
        assert all(f"{path} is missing" in note
                   for note, path in zip(notes, missing.values())), notes


def _with_io(monkeypatch, step, **changes):
    io = params.IO[step]
    monkeypatch.setitem(params.IO, step, dataclasses.replace(io, **changes))


def test_one_table_entry_reaches_the_parser_the_template_and_the_dag(monkeypatch):
    """Issue 28: an input artifact and an output parameter added to ``params.IO`` alone."""
    io = params.IO["quantize"]
    _with_io(monkeypatch, "quantize", reads={**io.reads, "model": "best.pt, for its card"},
             outputs=io.outputs + ("int8_bytes",))
    flags = {a.option_strings[0]: a for a in quantize.build_parser()._actions
             if a.option_strings}
    assert flags["--model"].required and "best.pt, for its card" in flags["--model"].help
    for doc, writer in ((_doc(), "train"), (_doc("resources.train.nodes=2"), "collect-model")):
        t = _templates(doc)
        args = t["quantize"]["container"]["args"]
        assert args[args.index("--model") + 1] == "{{inputs.artifacts.model.path}}"
        assert {"name": "model", "path": "/data/model"} in t["quantize"]["inputs"]["artifacts"]
        outs = {p["name"]: p for p in t["quantize"]["outputs"]["parameters"]}
        assert outs["int8-bytes"]["valueFrom"]["path"] == (
            "{{outputs.artifacts.quantized.path}}/argo-outputs/int8_bytes")
        tasks = {x["name"]: x for x in t["pipeline"]["dag"]["tasks"]}
        froms = {a["name"]: a["from"] for a in tasks["quantize"]["arguments"]["artifacts"]}
        assert froms["model"] == "{{tasks.%s.outputs.artifacts.model}}" % writer
        assert tasks["quantize"]["depends"] == "convert"   # train already precedes convert
    with pytest.raises(ValueError, match="int8_bytes"):
        write_outputs(Path("/nonexistent"), "quantize", {"int8_mean_dice": "1"})


def test_a_step_reading_an_earlier_artifact_waits_for_its_writer(monkeypatch):
    """The DAG's edges follow the table: convert reading ``raw`` too changes nothing (download
    precedes train), and train no longer reading ``dataset`` loses its edge to preprocess."""
    _with_io(monkeypatch, "convert", reads={**params.IO["convert"].reads, "raw": "its md5"})
    tasks = {x["name"]: x for x in _templates(_doc())["pipeline"]["dag"]["tasks"]}
    assert tasks["convert"]["depends"] == "train"
    assert "{{tasks.download.outputs.artifacts.raw}}" in [
        a["from"] for a in tasks["convert"]["arguments"]["artifacts"]]
    _with_io(monkeypatch, "train", reads={"raw": "the cases as downloaded"})
    tasks = {x["name"]: x for x in _templates(_doc())["pipeline"]["dag"]["tasks"]}
    assert tasks["train"]["depends"] == "download"
    assert tasks["convert"]["depends"] == "preprocess && train"
