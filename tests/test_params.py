"""One source of truth per step parameter (steps/params.py): the step's command line, the
pipeline config and the compiled workflow agree on every name, default, bound and value."""
from __future__ import annotations

import re

import pytest

from steps import convert, download, evaluate, params, preprocess, quantize, train
from workflows.config import Config, ConfigError, load_config
from workflows.unet import build

REQUIRED = {  # the artifact flags each step needs besides its parameters
    "download": ["--raw", "r"],
    "preprocess": ["--raw", "r", "--dataset", "d"],
    "train": ["--dataset", "d", "--model", "m"],
    "convert": ["--model", "m", "--dataset", "d", "--exported", "e"],
    "quantize": ["--exported", "e", "--dataset", "d", "--quantized", "q"],
    "evaluate": ["--exported", "e", "--dataset", "d", "--evaluation", "v"],
}
ALL = [(section, p) for section, spec in params.STEPS.items() for p in spec]


def parse(section: str, argv: list[str]):
    """The step's own argument parsing, as its main() does it."""
    argv = REQUIRED[section] + argv
    if section == "download":
        return download._parser().parse_args(argv)
    if section == "preprocess":
        return preprocess.build_parser().parse_args(argv)
    if section == "train":
        args = train.build_parser().parse_args(argv)
        train.check_args(args)
        return args
    if section == "quantize":
        return quantize.build_parser().parse_args(argv)
    if section == "evaluate":
        return evaluate.build_parser().parse_args(argv)
    return convert.parse_args(argv)


def minimal(section: str) -> list[str]:
    return ["--source", "synthetic://?cases=2"] if section == "download" else []


@pytest.mark.parametrize("section,p", ALL, ids=[f"{s}.{p.name}" for s, p in ALL])
def test_cli_and_config_have_the_same_default_and_choices(section, p):
    field = Config.model_fields[section].annotation.model_fields[p.name]
    if p.default is None:
        assert field.is_required()
        with pytest.raises(SystemExit):
            parse(section, [])
        return
    assert getattr(parse(section, minimal(section)), p.name) == p.default
    assert field.default == p.default
    assert field.description == p.help
    if p.choices:
        for choice in p.choices:
            assert getattr(parse(section, minimal(section) + [p.flag, choice]), p.name) == choice
            accelerator = {"hpu": "gaudi", "cuda": "cuda", "cpu": "cpu"}
            load_config(overrides=[f"{section}.{p.name}={choice}"] +
                        ([f"resources.train.accelerator={accelerator[choice]}"]
                         if p.name == "device" and choice != "auto" else []))


BOUNDED = [(section, p, word) for section, p in ALL
           for word in ("ge", "gt", "le") if getattr(p, word) is not None]


@pytest.mark.parametrize("section,p,word", BOUNDED,
                         ids=[f"{s}.{p.name}.{w}" for s, p, w in BOUNDED])
def test_cli_and_config_refuse_the_same_bounds(section, p, word, capsys):
    bound = getattr(p, word)
    step = 1 if p.type is int else 1e-3 * max(1.0, abs(bound))
    outside = {"ge": bound - step, "gt": bound, "le": bound + step}[word]
    inside = {"ge": bound, "gt": bound + step, "le": bound}[word]
    outside, inside = p.type(outside), p.type(inside)
    with pytest.raises(SystemExit) as exit_info:
        parse(section, minimal(section) + [p.flag, p.text(outside)])
    assert exit_info.value.code == 2 and p.flag in capsys.readouterr().err
    with pytest.raises(ConfigError, match=rf"{section}\.{p.name}"):
        load_config(overrides=[f"{section}.{p.name}={p.text(outside)}"])
    extra = relations_for(section, p.name, inside)
    assert getattr(parse(section, minimal(section) + [p.flag, p.text(inside)] + extra[0]),
                   p.name) == inside
    load_config(overrides=[f"{section}.{p.name}={p.text(inside)}"] + extra[1])


def relations_for(section: str, name: str, value) -> tuple[list[str], list[str]]:
    """(flags, overrides) that keep the other train parameters consistent with ``value``."""
    if section == "train" and name == "levels" and value < 4:
        return ["--deep-supervision", "false"], ["train.deep_supervision=false"]
    if section == "train" and name == "min_epochs" and value > 100:
        return ["--max-epochs", str(value)], [f"train.max_epochs={value}"]
    if section == "train" and name == "batch_size" and value < 8:
        return [], ["train.devices=1"]     # the base config trains on 8 devices
    if section == "train" and name == "devices":
        return (["--batch-size", str(max(64, value))],
                [f"train.batch_size={max(64, value)}"])
    return [], []


# Every parameter away from its default, consistently: what the compiled YAML must carry.
CHANGED = {
    "download": {"source": "synthetic://?cases=3&seed=4", "md5": ""},
    "preprocess": {"workers": 3, "image_dtype": "float32", "mode": "anchor",
                   "patch_size": "128x96"},
    "train": {"device": "cpu", "devices": 2, "precision": "fp32", "hpu_mode": "lazy",
              "cuda_compile": False, "cuda_compile_mode": "default",
              "cuda_channels_last": True, "cuda_layout_opt": False, "compile_cache": False,
              "num_workers": 5, "base_filters": 16, "levels": 5, "norm": "batch",
              "deep_supervision": False, "batch_size": 12, "val_batch_size": 7,
              "learning_rate": 0.002, "lr_schedule": "constant", "weight_decay": 0.03,
              "optimizer": "sgd", "skip_first_n_eval": 3,
              "min_epochs": 2, "max_epochs": 9, "patience": 4, "steps_per_epoch": 11,
              "fold": 3, "seed": 8, "checkpoint_minutes": 0.0, "resume": "never",
              "resume_from": "s3://bucket/earlier/run/"},
    "convert": {"opset": 18, "parity_slices": 40},
    "quantize": {"calibration_slices": 40, "calibration_seed": 5,
                 "calibration_method": "entropy", "float_layers": "none", "gate_cases": 3,
                 "max_dice_drop": 1.5, "max_class_dice_drop": 3.0, "min_agreement": 0.95},
    "evaluate": {"overlap": 0.25, "mirroring": False},
}


def test_the_changed_values_cover_every_parameter():
    assert {s: set(v) for s, v in CHANGED.items()} == \
        {s: {p.name for p in spec} for s, spec in params.STEPS.items()}
    for section, p in ALL:
        assert CHANGED[section][p.name] != p.default, f"{section}.{p.name}"


def _resolve(text: str, inputs: dict[str, str], workflow: dict[str, str]) -> str:
    text = re.sub(r"\{\{inputs\.parameters\.([-\w]+)\}\}", lambda m: inputs[m.group(1)], text)
    text = re.sub(r"\{\{workflow\.parameters\.([-\w]+)\}\}", lambda m: workflow[m.group(1)],
                  text)
    return text.replace("{{workflow.name}}", "wf")


def compiled_argv(doc: dict, step: str) -> list[str]:
    """The step's command line as Argo runs it: template args with the DAG task's input
    values, themselves resolved from the workflow parameters."""
    spec = doc["spec"]
    workflow = {p["name"]: p.get("value", "") for p in spec["arguments"]["parameters"]}
    template = next(t for t in spec["templates"] if t["name"] == step)
    dag = next(t for t in spec["templates"] if t["name"] == "pipeline")["dag"]["tasks"]
    task = next(t for t in dag if t["template"] == step)
    inputs = {p["name"]: _resolve(p["value"], {}, workflow)
              for p in task.get("arguments", {}).get("parameters", [])}
    args = [_resolve(a, inputs, workflow) for a in template["container"]["args"]]
    skip = {"--raw", "--dataset", "--model", "--exported", "--quantized", "--evaluation",
            "--nodes", "--checkpoint-uri"}
    out, i = [], 0
    while i < len(args):
        if args[i] not in skip:
            out += args[i:i + 2]
        i += 2
    return out


def test_the_compiled_workflow_runs_each_step_with_the_configs_values():
    overrides = [f"{s}.{k}={params.by_name(params.STEPS[s])[k].text(v)}"
                 for s, values in CHANGED.items() for k, v in values.items()]
    every_stage = "pipeline.stages=[download,preprocess,train,convert,quantize,evaluate]"
    cfg = load_config(overrides=overrides + ["resources.train.accelerator=cpu", every_stage])
    doc = build(cfg).to_dict()
    for section in params.STEPS:
        args = parse(section, compiled_argv(doc, section))
        for p in params.STEPS[section]:
            expected = CHANGED[section][p.name]
            got = getattr(args, p.name)
            assert got == expected, f"{section}.{p.name}: compiled {got!r}, config {expected!r}"
            assert getattr(getattr(cfg, section), p.name) == expected


def test_ui_parameters_carry_the_spec_help_and_choices():
    doc = build(load_config()).to_dict()
    ui = {p["name"]: p for p in doc["spec"]["arguments"]["parameters"]}
    for section, p in ALL:
        assert (p.dashed in ui) == p.ui, p.name
        if p.ui:
            assert ui[p.dashed]["description"] == p.help
            if p.choices:
                assert ui[p.dashed]["enum"] == list(p.choices)
