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
convert --exported--> quantize --quantized--> models/<model_name>/<workflow name>/int8/; with
``evaluate`` convert --exported--> evaluate --evaluation--> (the held-out fold's whole volumes,
scored). With ``pipeline.folds`` the DAG fans out after preprocess: per fold k,
train-fold-k --> convert-fold-k --> evaluate-fold-k; then every fold's exported model -->
ensemble --exported--> models/<model_name>/<workflow name>/ (and quantize), and every fold's
evaluation --> pool --pooled--> ensemble (the cross-validation table and its postprocessing
decision). The templates are
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

from steps import params
from workflows import multinode, templates as t
from workflows.config import Config

GOLDEN = Path(__file__).resolve().parent / "golden"
WHEN = {"quantize": "{{workflow.parameters.quantize}} == true"}


class _Wiring:
    """The DAG's edges from ``params.IO``: each input artifact comes from the task that
    writes it, and a task depends on those writers, less any that another already follows
    (so ``convert`` waits for ``train`` alone, though it also reads the dataset)."""

    def __init__(self) -> None:
        self.writer: dict[str, str] = {}         # artifact -> step that writes it
        self.last: dict[str, Task] = {}          # step -> the task its outputs come from
        self.before: dict[str, set[str]] = {}    # step -> the steps it follows

    def inputs(self, step: str) -> list:
        """Each input artifact from its writer's task (:meth:`input`)."""
        return [self.input(step, a) for a in params.IO[step].reads]

    def input(self, step: str, artifact: str):
        """``step``'s input ``artifact`` from its writer's task; read by key, as its URI
        parameter."""
        writer = self.last[self.writer[artifact]]
        return writer.get_parameter(t.uri_parameter(artifact)) \
            if artifact in params.IO[step].by_key else writer.get_artifact(artifact)

    @classmethod
    def after(cls, shared: "_Wiring") -> "_Wiring":
        """A wiring that continues ``shared`` (a fold's, from the data steps on)."""
        out = cls()
        out.writer, out.last, out.before = (dict(shared.writer), dict(shared.last),
                                            dict(shared.before))
        return out

    def add(self, step: str, first: Task, last: Task) -> None:
        parents = {self.writer[a] for a in params.IO[step].reads}
        direct = [p for p in parents if not any(p in self.before[q] for q in parents)]
        for parent in sorted(direct, key=list(self.last).index):
            self.last[parent] >> first
        self.before[step] = parents.union(*(self.before[p] for p in parents))
        self.writer[params.IO[step].writes] = step
        self.last[step] = last


def _extra_arguments(wf, cfg: Config, dag: _Wiring, step: str) -> tuple[list, list]:
    """A task's arguments before and after its own parameters, image tag and artifacts:
    preprocess's memo key includes the download's inputs, and convert takes the precision
    and train's results for its metrics."""
    if step == "preprocess":
        return t.task_params(wf, cfg, "download", t.memo_names("download")), []
    if step == "convert":
        return [], [wf.get_parameter("precision")] + [
            dag.last["train"].get_parameter(n) for n in t.RESULTS]
    return [], []


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
             security_context=t.pod_security(cfg),
             ) as wf:
        multi = cfg.resources.train.nodes > 1
        templates = {"download": t.download_template(cfg),   # the YAML's template order
                     "preprocess": t.preprocess_template(cfg),
                     "convert": t.convert_template(cfg)}
        if cfg.quantizes:
            templates["quantize"] = t.quantize_template(cfg)
        if cfg.evaluates:
            templates["evaluate"] = t.evaluate_template(cfg)
        templates["train"] = multinode.templates(cfg) if multi else t.train_template(cfg)
        tags = {"data": wf.get_parameter("data-image-tag").with_name("image-tag"),
                "train": wf.get_parameter("train-image-tag").with_name("image-tag")}
        if cfg.fans_out:
            templates |= {"ensemble": t.ensemble_template(cfg), "pool": t.pool_template(cfg)}
        with DAG(name="pipeline"):
            dag = _Wiring()
            for name in [n for n in params.IO if n in templates]:   # in DAG order
                if cfg.fans_out and name in t.FOLD_STEPS + ("quantize",):
                    continue
                template = templates[name]
                own = t.task_params(wf, cfg, name) + [tags["train" if name == "train" else "data"]]
                if name == "train" and multi:
                    first, last = multinode.tasks(wf, template, own, *dag.inputs(name))
                else:
                    before, after = _extra_arguments(wf, cfg, dag, name)
                    first = last = Task(name=name, template=template, when=WHEN.get(name),
                                        arguments=before + own + dag.inputs(name) + after)
                dag.add(name, first, last)
            if cfg.fans_out:
                _folds(wf, cfg, templates, tags, dag)
    return wf


def _folds(wf, cfg: Config, templates: dict, tags: dict, shared: _Wiring) -> None:
    """nnU-Net's cross-validation after preprocess: per fold k, ``train-fold-k`` (fold k
    held out, its own checkpoints) -> ``convert-fold-k`` -> ``evaluate-fold-k``, the folds
    side by side; then ``pool`` (every fold's evaluation as the cross-validation table and
    its postprocessing decision) and ``ensemble`` (every fold's model as one, with the pool's
    figures and decision, released) -> ``quantize``."""
    last: dict[str, list[Task]] = {step: [] for step in t.FOLD_STEPS}
    for k in cfg.pipeline.folds:
        dag = _Wiring.after(shared)
        for name in t.FOLD_STEPS:
            own = t.task_params(wf, cfg, name, fixed={t.FOLD: str(k)} if name == "train"
                                else None) + [tags["train" if name == "train" else "data"]]
            before, after = _extra_arguments(wf, cfg, dag, name)
            task = Task(name=f"{name}-fold-{k}", template=templates[name],
                        arguments=before + own + dag.inputs(name) + after)
            dag.add(name, task, task)
            last[name].append(task)
    dataset = shared.last["preprocess"].get_artifact("dataset")
    pool = Task(name="pool", template=templates["pool"], arguments=[
        tags["data"], *_per_fold(last["evaluate"], "evaluation", cfg.pipeline.folds)])
    ensemble = Task(name="ensemble", template=templates["ensemble"], arguments=[
        tags["data"], *_per_fold(last["convert"], "exported", cfg.pipeline.folds), dataset,
        pool.get_artifact("pooled")])
    last["evaluate"] >> pool
    [*last["convert"], pool] >> ensemble
    if cfg.quantizes:
        quantize = Task(name="quantize", template=templates["quantize"], when=WHEN["quantize"],
                        arguments=t.task_params(wf, cfg, "quantize") + [tags["data"]] + [
                            ensemble.get_artifact("exported"),
                            shared.input("quantize", "dataset")])
        ensemble >> quantize


def _per_fold(tasks: list[Task], artifact: str, folds: list[int]) -> list:
    """Each fold's ``artifact`` as the input ``<artifact>-fold-<k>`` (templates.fold_inputs)."""
    return [task.get_artifact(artifact).with_name(f"{artifact}-fold-{k}")
            for task, k in zip(tasks, folds)]


def render(cfg: Config, kind: str = "workflow") -> str:
    return build(cfg, kind).to_yaml()
