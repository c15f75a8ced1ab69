"""The config model: profiles, overrides, and one-line errors that name the key."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from steps.storage import DEFAULT_BUCKET, DEFAULT_REGION
from workflows.config import DEFAULT_CONFIG, Config, ConfigError, load_config, with_defaults

REPO = Path(__file__).resolve().parent.parent
PROFILES = ("fp32_8hpu_training", "bf16_8hpu_training", "cuda_1gpu", "cpu_quick", "local")


def test_base_config_lists_stages_and_profiles():
    cfg = load_config()
    assert cfg.pipeline.stages == ["download", "preprocess", "train", "convert", "quantize"]
    assert set(PROFILES) <= set(cfg.profiles)
    assert cfg.profile == ""


def test_quantize_and_evaluate_are_the_optional_stages():
    """Without quantize the DAG has no quantize task and no 'quantize' parameter; evaluate
    follows convert, with or without quantize; stages are never reordered or invented."""
    doc = render_dict(["pipeline.stages=[download,preprocess,train,convert]"])
    tasks = [t["name"] for t in doc["spec"]["templates"][-1]["dag"]["tasks"]]
    assert "quantize" not in tasks
    assert "quantize" not in {p["name"] for p in doc["spec"]["arguments"]["parameters"]}
    doc = render_dict([])
    dag = {t["name"]: t for t in doc["spec"]["templates"][-1]["dag"]["tasks"]}
    assert dag["quantize"]["when"] == "{{workflow.parameters.quantize}} == true"
    assert "evaluate" not in dag
    for stages in ("[download,preprocess,train,convert,evaluate]",
                   "[download,preprocess,train,convert,quantize,evaluate]"):
        dag = {t["name"]: t for t in render_dict([f"pipeline.stages={stages}"])["spec"][
            "templates"][-1]["dag"]["tasks"]}
        assert dag["evaluate"]["depends"] == "convert" and "when" not in dag["evaluate"]
    for bad in ("[download,preprocess,convert,train]", "[download,preprocess,train,quantize]",
                "[download,preprocess,train,convert,quantize,serve]",
                "[download,preprocess,train,convert,evaluate,quantize]",
                "[download,preprocess,train,convert,evaluate,evaluate]"):
        with pytest.raises(ConfigError, match="pipeline.stages"):
            load_config(overrides=[f"pipeline.stages={bad}"])


@pytest.mark.parametrize("overrides, needle", [
    (["pipeline.folds=[2]"], r"pipeline\.folds: must be empty or at least two different"),
    (["pipeline.folds=[0,1,1]"], r"pipeline\.folds: must be empty or at least two different"),
    (["pipeline.folds=[0,5]"], r"pipeline\.folds\.1: must be less than or equal to 4"),
    (["pipeline.folds=[0,1]"], r"pipeline\.folds: needs the evaluate stage"),
    (["pipeline.folds=[0,1]", "pipeline.stages=[download,preprocess,train,convert,evaluate]",
      "resources.train.nodes=2"], r"pipeline\.folds: .*resources\.train\.nodes must be 1"),
])
def test_folds_are_two_or_more_distinct_evaluated_on_one_node(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(overrides=overrides)


def render_dict(overrides: list[str], profile: str | None = None) -> dict:
    from workflows.unet import build
    return build(load_config(profile=profile, overrides=overrides)).to_dict()


def test_fp32_8hpu_training_is_the_old_pipelines_profile():
    t = load_config(profile="fp32_8hpu_training").train
    assert (t.devices, t.batch_size, t.val_batch_size, t.optimizer, t.learning_rate) == \
        (8, 64, 64, "fusedadamw", 1e-4)
    assert (t.norm, t.deep_supervision, t.min_epochs, t.max_epochs, t.seed, t.num_workers,
            t.precision) == ("instance", True, 1, 2, 1, 8, "fp32")


@pytest.mark.parametrize("name,accelerator", [("bf16_8hpu_training", "gaudi"),
                                              ("cuda_1gpu", "cuda"), ("cpu_quick", "cpu")])
def test_profiles_switch_accelerator(name, accelerator):
    cfg = load_config(profile=name)
    assert cfg.resources.train.accelerator == accelerator
    assert cfg.profile == name


def test_local_profile_is_small_and_synthetic():
    cfg = load_config(local=True)
    assert cfg.profile == cfg.local_profile == "local"
    assert cfg.download.source.startswith("synthetic://")
    assert cfg.resources.train.accelerator == "cpu"
    assert cfg.train.base_filters <= 16
    assert cfg.train.max_epochs * cfg.train.steps_per_epoch <= 400   # well under a minute


def test_overrides_dotted_and_bare_keys():
    cfg = load_config(overrides=["train.max_epochs=7", "learning_rate=1e-4",
                                 "deep_supervision=false", "images.cpu.tag=9.9"])
    assert cfg.train.max_epochs == 7
    assert cfg.train.learning_rate == pytest.approx(1e-4)
    assert cfg.train.deep_supervision is False
    assert cfg.images.cpu.tag == "9.9"


def test_profile_then_override_order():
    cfg = load_config(profile="cuda_1gpu", overrides=["train.devices=2"])
    assert cfg.train.devices == 2 and cfg.resources.train.accelerator == "cuda"


@pytest.mark.parametrize("override,needle", [
    ("train.bogus=1", "train.bogus: unknown key"),
    ("nonsense=1", "'nonsense': unknown key"),
    ("train.optimizer=adam", "train.optimizer"),
    ("train.max_epochs=-1", "train.max_epochs"),
    ("train.fold=7", "train.fold"),
    ("train.batch_size=0", "train.batch_size"),
    ("preprocess.image_dtype=int8", "preprocess.image_dtype"),
    ("download.md5=xyz", "download.md5"),
    ("train.min_epochs=500", "train.min_epochs"),
    ("novalue", "expected key=value"),
])
def test_bad_values_are_one_line_naming_the_key(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    message = str(info.value)
    assert needle in message
    assert "\n" not in message


def test_unknown_profile_lists_known_ones():
    with pytest.raises(ConfigError, match="profile 'nope': unknown.*cpu_quick"):
        load_config(profile="nope")


def test_bad_profile_in_file_is_named(tmp_path):
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["profiles"]["broken"] = {"train": {"fold": 9}}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"profiles\.broken: train\.fold"):
        load_config(path)


def _leaves(node, path=()):
    """(key path, value) of every leaf; an empty mapping is a leaf."""
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaves(value, path + (key,))
    else:
        yield path, node


def _at(tree, path):
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return "<absent>"
        tree = tree[key]
    return tree


def test_pipeline_yaml_states_only_departures():
    """Issue 28: the base states only what differs from the model's defaults (images and the
    download source have none), and each profile only what differs from what it extends."""
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    required = {"images": raw["images"], "download": {"source": raw["download"]["source"]}}
    defaults = Config.model_validate(with_defaults(required)).model_dump()
    base = {k: v for k, v in raw.items() if k not in ("profiles", "local_profile", "images")}
    restated = [".".join(path) for path, value in _leaves(base)
                if path != ("download", "source") and value == _at(defaults, path)]
    for name, body in raw["profiles"].items():
        parent = load_config(profile=body.get("extends")).model_dump()
        own = {k: v for k, v in body.items() if k != "extends"}
        restated += [f"profiles.{name}." + ".".join(path) for path, value in _leaves(own)
                     if value == _at(parent, path)]
    assert not restated, f"config/pipeline.yaml restates: {restated}"


def test_a_profile_extends_another_and_changes_only_what_it_names():
    quick, local = load_config(profile="cpu_quick"), load_config(profile="local")
    assert local.resources == quick.resources and local.train.device == "cpu"
    assert (local.train.levels, quick.train.levels) == (4, 6)
    assert local.quantizes and not quick.quantizes
    # a partial section keeps the defaults of what it leaves out (2Gi, not StepResources' 4Gi)
    assert load_config(profile="cpu_quick").resources.download.memory == "2Gi"


@pytest.mark.parametrize("extends, needle", [
    ("nope", r"profiles\.a\.extends: names no profile"),
    ("b", r"profiles\.b\.extends: a cycle through a -> b -> a"),
])
def test_a_bad_extends_is_one_line(tmp_path, extends, needle):
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["profiles"] |= {"a": {"extends": extends}, "b": {"extends": "a"}}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=needle):
        load_config(path)


@pytest.mark.slow
def test_cli_reports_bad_config_in_one_line_without_traceback():
    proc = subprocess.run([sys.executable, "workflows/unet.py", "render", "-p", "train.fold=7"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.fold" in lines[0] and "Traceback" not in proc.stderr


# ---- config values are data, never template (issue 14, point 4) ------------------------------
HOSTILE = [
    ("download.source=https://x/{{=sprig.env('ARGO_TOKEN')}}", "download.source: must not contain '{{'"),
    ("storage.models_prefix=../../etc", "storage.models_prefix: must be a key prefix without"),
    ("storage.checkpoint_prefix=/abs", "storage.checkpoint_prefix: must match"),
    ('resources.extra_env={"A B": "1"}', "resources.extra_env.A B"),
    ("resources.extra_env={X: '}}'}", "resources.extra_env.X: must not contain"),
    ("storage.bucket=a{b}c", "storage.bucket: must match"),
    ("storage.bucket=Upper", "storage.bucket: must match"),
    ("storage.endpoint=http://minio:9000/{{workflow.name}}", "storage.endpoint"),
    ("storage.region=us east", "storage.region: must match"),
    ("images.cpu.tag=0.1.0}}", "images.cpu.tag: must match"),
    ("images.cpu.repository=Registry/x", "images.cpu.repository: must match"),
    ("train.resume_from=file:///tmp/ck", "train.resume_from 'file:///tmp/ck': unsupported scheme 'file'"),
    ("download.source=not a uri", "download.source 'not a uri': a plain path is not accepted"),
    ("resources.train.node_selector={'a b': x}", "resources.train.node_selector"),
]


@pytest.mark.parametrize("override,needle", HOSTILE, ids=[h[0][:40] for h in HOSTILE])
def test_values_that_would_become_template_or_bad_names_are_refused(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    message = str(info.value)
    assert needle in message and "\n" not in message


CREDENTIALS = [
    ("resources.extra_env.AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI0K7MDENGbPxRfiCYEXAMPLEKEY",
     "must not name a credential (AWS_SECRET_ACCESS_KEY:", "wJalrXUtnFEMI0K7MDENG"),
    ("resources.extra_env.HF_TOKEN=hf_abcdefgh12345678", "(HF_TOKEN:", "hf_abcdefgh"),
    ("resources.extra_env.HTTPS_PROXY=http://bob:Pr0xyPass@proxy:3128",
     "HTTPS_PROXY holds credentials in a URL", "Pr0xyPass"),
    ("resources.extra_env.HTTPS_PROXY=http://tok3nTok3n@proxy:3128",
     "HTTPS_PROXY holds credentials in a URL", "tok3nTok3n"),
    ("resources.extra_env.SETTING=AKIAABCDEFGHIJKLMNOP", "SETTING holds an AWS access key id",
     "AKIAABCDEFGHIJKLMNOP"),
]


@pytest.mark.parametrize("override,needle,secret", CREDENTIALS,
                         ids=[c[1][:30] for c in CREDENTIALS])
def test_a_credential_in_extra_env_is_refused_without_echoing_it(override, needle, secret):
    """extra_env's values are written into every template of the compiled YAML as literals;
    render, submit and publish never run lint, so the config refuses them."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    message = str(info.value)
    assert needle in message and "resources.extra_env" in message and "\n" not in message
    assert secret not in message


def test_extra_env_keeps_its_tuning_values():
    env = load_config(overrides=["resources.extra_env.HTTPS_PROXY=http://proxy:3128"]
                      ).resources.extra_env
    assert env["HTTPS_PROXY"] == "http://proxy:3128" and "GLIBC_TUNABLES" in env


def test_control_characters_are_refused_and_escaped_in_the_line():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=['resources.extra_env={X: "a\\u0007b"}'])
    assert "control characters" in str(info.value) and "\\x07" in str(info.value)
    assert "\x07" not in str(info.value)


@pytest.mark.slow
def test_lint_refuses_what_render_refuses():
    for command in ("render", "lint"):
        proc = subprocess.run([sys.executable, "workflows/unet.py", command, "-p",
                               "storage.models_prefix=../x"], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and "storage.models_prefix" in proc.stderr, command
        assert proc.stdout == ""



# Files read by other tools (compose, the S3 container, Argo's artifact repository) cannot
# import the one home of the bucket and region (steps.storage); they restate them, equal.
RESTATED = {
    ".env.example": [r"^UNET_ARTIFACT_BUCKET=(\S+)", r"^AWS_REGION=(\S+)"],
    "docker-compose.yml": [r"\$\{UNET_ARTIFACT_BUCKET:-([^}]+)\}", r"\$\{AWS_REGION:-([^}]+)\}"],
    "containers/seaweedfs/entrypoint.sh": [r"\$\{BUCKET:-([^}]+)\}"],
    "manifests/base/artifact-repositories.yaml": [r"^\s*region: (\S+)", r"^\s*bucket: (\S+)"],
    "manifests/overlays/aws-s3/artifact-repository.yaml": [r"^\s*region: (\S+)"],
    "manifests/overlays/local-minio/artifact-repository.yaml": [r"^\s*region: (\S+)"],
}


def test_files_for_other_tools_restate_the_one_bucket_and_region():
    found = []
    for path, patterns in RESTATED.items():
        text = (REPO / path).read_text()
        for pattern in patterns:
            values = re.findall(pattern, text, re.MULTILINE)
            assert values, f"{path}: {pattern} matches nothing"
            found += [(path, v) for v in values if v not in (DEFAULT_BUCKET, DEFAULT_REGION)]
    assert not found, found
    storage = load_config().storage
    assert (storage.bucket, storage.region) == (DEFAULT_BUCKET, DEFAULT_REGION)


def test_the_cluster_profile_fits_two_pods_on_the_test_node():
    """cluster/ builds a node of 2 CPUs (config/pipeline.yaml's cluster profile): every step
    of the profile, the optional ones and the folds' joins too, asks at most 1 CPU and 3 GiB,
    so two pods share it. (evaluate once asked the base's 4 CPUs: its pods stayed Pending.)"""
    doc = render_dict(["pipeline.folds=[0,1]",
                       "pipeline.stages=[download,preprocess,train,convert,quantize,evaluate]"],
                      "cluster")
    asked = {t["name"]: t["container"]["resources"]["requests"]
             for t in doc["spec"]["templates"] if "container" in t}
    assert {"evaluate", "ensemble", "pool", "quantize"} <= set(asked)
    for name, requests in asked.items():
        assert float(requests["cpu"]) <= 1, (name, requests)
        assert requests["memory"].endswith("Gi") and float(requests["memory"][:-2]) <= 3, \
            (name, requests)
