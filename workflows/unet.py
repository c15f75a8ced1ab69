"""The pipeline as a Hera DAG.

    python workflows/unet.py render [--kind workflow|template] [-o FILE] [--golden]
    python workflows/unet.py lint [--strict]
    python workflows/unet.py submit [--watch] [--from-template]
    python workflows/unet.py publish
    python workflows/unet.py run --local [--output-dir DIR]

(also ``unet-pipeline <command>`` once installed; the commands are :mod:`workflows.cli`).
Every command takes ``--config config/pipeline.yaml``, ``--profile NAME`` and
``-p key=value`` (see :mod:`workflows.config`).

DAG: download --raw--> preprocess --dataset--> train --model--> convert --exported-->
models/<model_name>/<workflow name>/ (convert also reads ``dataset``), and with the optional
stage ``quantize`` (``pipeline.stages``; the ``quantize`` parameter turns it off per run)
convert --exported--> quantize --quantized--> models/<model_name>/<workflow name>/int8/. The templates are
:mod:`workflows.templates`. With ``resources.train.nodes > 1`` train becomes a Kubeflow
PyTorchJob (see :mod:`workflows.multinode`).
"""
if __name__ == "__main__":  # a script: run the CLI, which imports this file as workflows.unet
    import runpy
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    runpy.run_module("workflows.cli", run_name="__main__")
    sys.exit(0)  # not reached: the CLI exits

from pathlib import Path

from hera.workflows import DAG, Task, Workflow, WorkflowTemplate, models as m

from workflows import multinode, templates as t
from workflows.config import Config

GOLDEN = Path(__file__).resolve().parent / "golden"


def build(cfg: Config, kind: str = "workflow") -> Workflow:
    """The pipeline as a Hera Workflow (``kind="workflow"``) or WorkflowTemplate."""
    cls = WorkflowTemplate if kind == "template" else Workflow
    name = cfg.pipeline.model_name
    naming = {"name": name} if kind == "template" else {"generate_name": f"{name}-"}
    s = cfg.storage
    with cls(**naming, entrypoint="pipeline",
             labels={"app.kubernetes.io/name": "unet-argo",
                     "app.kubernetes.io/component": "training-pipeline"},
             annotations={"workflows.argoproj.io/description":
                          "MSD Task01 brain-tumour 2D U-Net: download, preprocess, train, "
                          "ONNX convert",
                          "unet-argo/profile": cfg.profile or "base"},
             arguments=t.workflow_parameters(cfg),
             service_account_name=cfg.pipeline.service_account,
             artifact_repository_ref=m.ArtifactRepositoryRef(
                 config_map=s.artifact_repository_configmap, key=s.artifact_repository_key),
             security_context=m.PodSecurityContext(
                 run_as_non_root=True, run_as_user=cfg.pipeline.run_as_user,
                 run_as_group=cfg.pipeline.run_as_user, fs_group=cfg.pipeline.run_as_user),
             ) as wf:
        download, preprocess = t.download_template(cfg), t.preprocess_template(cfg)
        convert = t.convert_template(cfg)
        quantize = t.quantize_template(cfg) if cfg.quantizes else None
        multi = cfg.resources.train.nodes > 1
        train = multinode.templates(cfg) if multi else t.train_template(cfg)
        data_tag = wf.get_parameter("data-image-tag").with_name("image-tag")
        train_params = (t.task_params(wf, cfg, "train")
                        + [wf.get_parameter("train-image-tag").with_name("image-tag")])
        with DAG(name="pipeline"):
            t_download = Task(name="download", template=download,
                              arguments=t.task_params(wf, cfg, "download") + [data_tag])
            t_pre = Task(name="preprocess", template=preprocess, arguments=(
                t.task_params(wf, cfg, "download", t.memo_names("download"))
                + t.task_params(wf, cfg, "preprocess") + [data_tag,
                                                          t_download.get_artifact("raw")]))
            dataset = t_pre.get_artifact("dataset")
            if multi:
                first, last = multinode.tasks(wf, train, train_params, dataset)
            else:
                first = last = Task(name="train", template=train,
                                    arguments=train_params + [dataset])
            t_convert = Task(name="convert", template=convert, arguments=[
                data_tag, last.get_artifact("model"), dataset, wf.get_parameter("precision")]
                + [last.get_parameter(n) for n in t.RESULTS])
            t_download >> t_pre >> first
            last >> t_convert
            if quantize is not None:
                t_convert >> Task(name="quantize", template=quantize,
                                  when="{{workflow.parameters.quantize}} == true",
                                  arguments=[data_tag, t_convert.get_artifact("exported"),
                                             dataset])
    return wf


def render(cfg: Config, kind: str = "workflow") -> str:
    return build(cfg, kind).to_yaml()
