"""The pipeline as a Hera DAG, and its command line.

    python workflows/unet.py render [--kind workflow|template] [-o FILE] [--golden]
    python workflows/unet.py lint
    python workflows/unet.py submit [--watch] [--from-template]
    python workflows/unet.py publish
    python workflows/unet.py run --local [--output-dir DIR]

Every command takes ``--config config/pipeline.yaml``, ``--profile NAME`` and
``-p key=value`` (see :mod:`workflows.config`).

DAG: download --raw--> preprocess --dataset--> train --model--> convert --exported-->
models/<model_name>/<workflow name>/ (convert also reads ``dataset``). Artifact paths reach a
command only as ``{{inputs.artifacts.X.path}}`` / ``{{outputs.artifacts.X.path}}``, so the
local runner can remap them. With ``resources.train.nodes > 1`` train becomes a Kubeflow
PyTorchJob (see :mod:`workflows.multinode`).
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `workflows` and `steps` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hera.workflows import (DAG, Artifact, Container, Parameter, S3Artifact, Task, Workflow,
                            WorkflowTemplate, models as m)
from hera.workflows.archive import NoneArchiveStrategy

from steps.errors import EXIT_INPUT_ERROR
from workflows.config import Config, seconds

DATA = "/data"  # artifact paths inside a pod; the local runner remaps them
WORK_VOLUME = "work"  # the emptyDir at DATA that holds every artifact of a step pod
TRAIN_OUTPUTS = ("mean_dice", "best_epoch", "img_per_s")
CONVERT_OUTPUTS = ("max_abs_diff", "argmax_agreement")
OUTPUTS_DIR = "argo-outputs"  # steps write Argo output-parameter files here
GOLDEN = Path(__file__).resolve().parent / "golden"


def wf_param(name: str) -> str:
    return "{{workflow.parameters.%s}}" % name


def arg(name: str) -> str:
    return "{{inputs.parameters.%s}}" % name


def memo_key(stage: str, names: list[str]) -> str:
    """A ConfigMap-safe memoization key: sha256 over the inputs that determine the output.

    Argo accepts only [-a-zA-Z0-9] keys and the inputs hold URIs, hence the hash.
    """
    joined = " + '|' + ".join(f"inputs.parameters['{n}']" for n in names)
    return f"{stage}-{{{{=sprig.sha256sum({joined})}}}}"


def workflow_parameters(cfg: Config) -> list[Parameter]:
    """What a user reruns with; descriptions and enums make the UI's submit form usable."""
    t, pre = cfg.train, cfg.preprocess
    most = max(1, cfg.train.devices)
    devices = [str(n) for n in (1, 2, 4, 8, 16, 32, 64) if n <= most] or ["1"]
    return [
        Parameter(name="source", value=cfg.download.source,
                  description="dataset source: https://, s3://, file:// or synthetic://?cases=N"),
        Parameter(name="md5", value=cfg.download.md5,
                  description="md5 of the source tar, checked before extraction (empty: skip)"),
        Parameter(name="image-dtype", value=pre.image_dtype, enum=["float16", "float32"],
                  description="dtype of the preprocessed image arrays"),
        Parameter(name="patch-size", value=pre.patch_size,
                  description="in-plane patch HxW recorded in the dataset (multiples of 32)"),
        Parameter(name="fold", value=str(t.fold), enum=[str(i) for i in range(5)],
                  description="validation fold of the 5-fold split"),
        Parameter(name="devices", value=str(t.devices), enum=devices,
                  description=f"accelerators used per node (the pod requests {t.devices})"),
        Parameter(name="batch-size", value=str(t.batch_size),
                  description="global training batch, in 2D slices"),
        Parameter(name="min-epochs", value=str(t.min_epochs),
                  description="epochs before early stopping may end training"),
        Parameter(name="max-epochs", value=str(t.max_epochs), description="epoch limit"),
        Parameter(name="learning-rate", value=f"{t.learning_rate:g}",
                  description="peak learning rate"),
        Parameter(name="optimizer", value=t.optimizer, enum=["adamw", "fusedadamw", "sgd"],
                  description="fusedadamw is Habana's FusedAdamW (Gaudi only)"),
        Parameter(name="precision", value=t.precision, enum=["auto", "fp32", "bf16", "fp16"],
                  description="training precision; auto picks bf16 on HPU/GPU, fp32 on CPU"),
        Parameter(name="resume-from", value=t.resume_from,
                  description="checkpoint URI of an earlier run to continue from (resubmit); "
                              "empty starts fresh"),
        Parameter(name="data-image-tag", value=cfg.images.cpu.tag,
                  description=f"tag of {cfg.images.cpu.repository} (download, preprocess, "
                              "convert)"),
        Parameter(name="train-image-tag", value=cfg.image(cfg.train_image_kind).tag,
                  description=f"tag of {cfg.image(cfg.train_image_kind).repository} (train)"),
    ]


def retry(cfg: Config) -> m.RetryStrategy:
    """Retry with backoff on any failure except an input error (exit 2): retrying cannot fix
    bad input, and its one-line error should reach the user at once.

    The waits are capped, and there is no ``maxDuration``: Argo measures it from the first
    attempt's start and stops a later attempt when it passes (operator.go
    ``processNodeRetries``), which would leave a long train step without its retry. Each
    attempt is bounded by its own ``activeDeadlineSeconds`` instead.
    """
    r = cfg.retry
    return m.RetryStrategy(limit=r.limit, retry_policy="Always",
                           expression=f"asInt(lastRetry.exitCode) != {EXIT_INPUT_ERROR}",
                           backoff=m.Backoff(duration=r.backoff_duration,
                                             factor=r.backoff_factor, cap=r.backoff_cap))


def memoize(cfg: Config, stage: str, names: list[str]) -> m.Memoize:
    return m.Memoize(key=memo_key(stage, names), max_age=cfg.memoize.max_age,
                     cache=m.Cache(config_map=m.LocalObjectReference(name=cfg.memoize.config_map)))


def directory(name: str, output: bool = False) -> Artifact:
    """A directory artifact at /data/<name>, stored unarchived (re-gzipping .npy is waste)."""
    return Artifact(name=name, path=f"{DATA}/{name}", archive=NoneArchiveStrategy() if output
                    else None)


def file_outputs(artifact: str, names: tuple[str, ...]) -> list[Parameter]:
    """Output parameters read from files the step writes under its output artifact."""
    return [Parameter(name=n.replace("_", "-"), global_name=n.replace("_", "-"),
                      value_from=m.ValueFrom(
                          path=f"{{{{outputs.artifacts.{artifact}.path}}}}/{OUTPUTS_DIR}/{n}"))
            for n in names]


def s3_env(cfg: Config) -> list[m.EnvVar]:
    """Checkpoint-store connection: references only, never values.

    Both references are optional, so one compiled workflow starts on every overlay: where the
    Secret does not exist (aws-s3, IRSA) boto3 takes the pod's role, and where the overlay's
    ConfigMap has no ``endpoint`` the steps talk to AWS S3. A literal ``storage.endpoint``
    replaces the ConfigMap's.
    """
    s = cfg.storage
    secret = lambda key: m.EnvVarSource(secret_key_ref=m.SecretKeySelector(  # noqa: E731
        name=s.credentials_secret, key=key, optional=True))
    env = [m.EnvVar(name="AWS_ACCESS_KEY_ID", value_from=secret(s.access_key_key)),
           m.EnvVar(name="AWS_SECRET_ACCESS_KEY", value_from=secret(s.secret_key_key)),
           m.EnvVar(name="AWS_REGION", value=s.region)]
    if s.endpoint:
        env.append(m.EnvVar(name="AWS_ENDPOINT_URL", value=s.endpoint))
    else:
        env.append(m.EnvVar(name="AWS_ENDPOINT_URL", value_from=m.EnvVarSource(
            config_map_key_ref=m.ConfigMapKeySelector(name=s.settings_configmap,
                                                      key="endpoint", optional=True))))
    return env


def extra_env(cfg: Config) -> list[m.EnvVar]:
    return [m.EnvVar(name=k, value=v) for k, v in sorted(cfg.resources.extra_env.items())]


def work_volume(cfg: Config) -> tuple[m.Volume, m.VolumeMount]:
    """The emptyDir at /data that holds a pod's artifacts.

    The images run as a non-root uid and Argo mounts only the input artifacts and the
    declared volumes, so without it /data is a root-owned directory that the runtime made
    for the input mounts and no step can create its output there. Argo's init container
    also writes inputs under a volume straight into it, and outputs on a volume are uploaded
    from the mount instead of being tarred by the emissary first (``FindOverlappingVolume``).
    """
    return (m.Volume(name=WORK_VOLUME, empty_dir=m.EmptyDirVolumeSource(
                size_limit=cfg.resources.work_volume_size)),
            m.VolumeMount(name=WORK_VOLUME, mount_path=DATA))


def step_resources(cpu: str, memory: str, scratch: str) -> m.ResourceRequirements:
    requests = {"cpu": cpu, "memory": memory, "ephemeral-storage": scratch}
    return m.ResourceRequirements(requests=requests,
                                  limits={"memory": memory, "ephemeral-storage": scratch})


def image(cfg: Config, kind: str) -> str:
    return f"{cfg.image(kind).repository}:{arg('image-tag')}"


def flags(values: dict[str, object]) -> list[str]:
    """``{"batch_size": 64}`` -> ``["--batch-size", "64"]`` (flag names mirror config keys)."""
    out: list[str] = []
    for key, value in values.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        out += [f"--{key.replace('_', '-')}", text]
    return out


def step(cfg: Config, name: str, kind: str, command: list[str] | None = None,
         resources: str = "", **kw) -> Container:
    """A data-side container template: CPU image, work volume, deadline, retries. The
    command is ``python -m steps.<name>`` unless given; ``resources`` names the config's
    resources section when it is not ``name``."""
    res = getattr(cfg.resources, resources or name)
    volume, mount = work_volume(cfg)
    return Container(
        name=name, image=image(cfg, kind), image_pull_policy=cfg.images.pull_policy,
        command=command or ["python", "-m", f"steps.{name}"],
        resources=step_resources(res.cpu, res.memory, cfg.resources.work_volume_size),
        volumes=[volume], volume_mounts=[mount],
        active_deadline_seconds=seconds(res.timeout), retry_strategy=retry(cfg), **kw)


def download_template(cfg: Config) -> Container:
    names = ["source", "md5", "image-tag"]
    return step(cfg, "download", "cpu",
                args=["--source", arg("source"), "--raw", "{{outputs.artifacts.raw.path}}",
                      "--md5", arg("md5")],
                inputs=[Parameter(name=n) for n in names],
                outputs=[directory("raw", output=True)],
                env=s3_env(cfg) + extra_env(cfg),
                memoize=memoize(cfg, "download", names))


def preprocess_template(cfg: Config) -> Container:
    keyed = ["source", "md5", "image-dtype", "mode", "patch-size", "image-tag"]
    return step(cfg, "preprocess", "cpu",
                args=["--raw", "{{inputs.artifacts.raw.path}}",
                      "--dataset", "{{outputs.artifacts.dataset.path}}",
                      "--workers", arg("workers"), "--image-dtype", arg("image-dtype"),
                      "--mode", arg("mode"), "--patch-size", arg("patch-size")],
                inputs=[Parameter(name=n) for n in keyed + ["workers"]] + [directory("raw")],
                outputs=[directory("dataset", output=True)],
                env=extra_env(cfg),
                memoize=memoize(cfg, "preprocess", keyed))


TRAIN_PARAMS = ("devices", "batch-size", "min-epochs", "max-epochs", "learning-rate",
                "optimizer", "fold", "precision", "resume-from", "image-tag")


def train_args(cfg: Config, dataset: str, model: str) -> list[str]:
    """The train command's flags: DAG parameters as inputs, the rest fixed from the config.

    ``--devices`` is per node and ``--nodes`` is the node count, so the step expects
    ``WORLD_SIZE == nodes * devices`` from ``torch.distributed.run``.
    """
    t = cfg.train
    fixed = {
        "nodes": cfg.resources.train.nodes,
        "device": t.device, "val_batch_size": t.val_batch_size,
        "weight_decay": f"{t.weight_decay:g}", "patience": t.patience,
        "steps_per_epoch": t.steps_per_epoch, "deep_supervision": t.deep_supervision,
        "norm": t.norm, "base_filters": t.base_filters,
        "levels": t.levels, "seed": t.seed,
        "num_workers": t.num_workers, "hpu_mode": t.hpu_mode,
        "checkpoint_uri": checkpoint_uri(cfg), "checkpoint_minutes": f"{t.checkpoint_minutes:g}",
        "resume": t.resume,
    }
    params = {p.replace("-", "_"): arg(p) for p in TRAIN_PARAMS if p != "image-tag"}
    return ["--dataset", dataset, "--model", model] + flags({**params, **fixed})


def checkpoint_uri(cfg: Config) -> str:
    """Per workflow, so an Argo retry of the same workflow resumes where it stopped."""
    s = cfg.storage
    return f"s3://{s.bucket}/{s.checkpoint_prefix}/{{{{workflow.name}}}}/"


def accelerator_resources(cfg: Config) -> tuple[m.ResourceRequirements, list, list]:
    """Train pod resources, volumes and mounts for the configured accelerator.

    Every train pod has the work volume at /data.
    gaudi: ``habana.ai/gaudi`` and ``hugepages-2Mi`` as Habana documents (requests = limits);
    cuda: ``nvidia.com/gpu``; cpu: cpu and memory only. /dev/shm is memory-backed for the
    data loader's shared tensors.
    """
    r, devices = cfg.resources.train, str(cfg.train.devices)
    scratch = cfg.resources.work_volume_size
    limits = {"cpu": r.cpu, "memory": r.memory, "ephemeral-storage": scratch}
    work, work_mount = work_volume(cfg)
    volumes = [work, m.Volume(name="dshm", empty_dir=m.EmptyDirVolumeSource(
        medium="Memory", size_limit=r.shm_size))]
    mounts = [work_mount, m.VolumeMount(name="dshm", mount_path="/dev/shm")]
    if r.accelerator == "gaudi":
        limits |= {"habana.ai/gaudi": devices, "hugepages-2Mi": r.hugepages_2mi}
        volumes.append(m.Volume(name="hugepage", empty_dir=m.EmptyDirVolumeSource(
            medium="HugePages")))
        mounts.append(m.VolumeMount(name="hugepage", mount_path="/hugepages"))
    elif r.accelerator == "cuda":
        limits |= {"nvidia.com/gpu": devices}
    return m.ResourceRequirements(requests=dict(limits), limits=limits), volumes, mounts


DONE = "{{status}} == Succeeded"


def metric_labels(cfg: Config) -> list[m.MetricLabel]:
    return [m.MetricLabel(key="accelerator", value=cfg.resources.train.accelerator),
            m.MetricLabel(key="precision", value=arg("precision"))]


def duration_metric(cfg: Config) -> m.Prometheus:
    """Wall time of the node that trains, once per successful run.

    Under a retryStrategy Argo emits a template's metrics for every attempt that is retried
    (in that attempt's scope) and once more for the retry node when it ends
    (operator.go ``executeTemplate``), so without ``when`` each failed attempt's time would
    be one more observation. The one observation left spans every attempt and backoff of
    the run; ``retries`` says how many attempts it took.
    """
    return m.Prometheus(
        name="unet_train_duration_seconds",
        help="Wall time of the train step until it succeeded, retries included",
        labels=metric_labels(cfg) + [m.MetricLabel(key="retries", value="{{retries}}")],
        when=DONE, histogram=m.Histogram(value="{{duration}}", buckets=[
            60, 300, 900, 1800, 3600, 7200, 14400, 28800, 86400]))


def result_metrics(cfg: Config) -> list[m.Prometheus]:
    """Gauges of the train outputs, on the template that has them as output parameters."""
    gauge = lambda name, help_, out: m.Prometheus(  # noqa: E731
        name=name, help=help_, labels=metric_labels(cfg), when=DONE,
        gauge=m.Gauge(value="{{outputs.parameters.%s}}" % out, realtime=False))
    return [gauge("unet_train_mean_dice", "Best validation mean Dice (x100) of the run",
                  "mean-dice"),
            gauge("unet_train_images_per_second",
                  "Training throughput in 2D slices per second", "img-per-s")]


def model_outputs() -> list:
    report = Artifact(name="report", path="{{outputs.artifacts.model.path}}/report.html",
                      archive=NoneArchiveStrategy())
    return [directory("model", output=True), report] + file_outputs("model", TRAIN_OUTPUTS)


def train_template(cfg: Config) -> Container:
    resources, volumes, mounts = accelerator_resources(cfg)
    r = cfg.resources.train
    return Container(
        name="train", image=image(cfg, cfg.train_image_kind),
        image_pull_policy=cfg.images.pull_policy,
        command=["python", "-m", "steps.train"],
        args=train_args(cfg, "{{inputs.artifacts.dataset.path}}",
                        "{{outputs.artifacts.model.path}}"),
        inputs=[Parameter(name=n) for n in TRAIN_PARAMS] + [directory("dataset")],
        outputs=model_outputs(), env=s3_env(cfg) + extra_env(cfg),
        resources=resources, volumes=volumes, volume_mounts=mounts,
        node_selector=dict(r.node_selector) or None,
        tolerations=[m.Toleration(**t.model_dump(exclude_none=True)) for t in r.tolerations]
        or None, active_deadline_seconds=seconds(r.timeout),
        retry_strategy=retry(cfg),
        metrics=m.Metrics(prometheus=[duration_metric(cfg)] + result_metrics(cfg)))


def convert_template(cfg: Config) -> Container:
    c = cfg.convert
    release = S3Artifact(name="release", path=f"{DATA}/exported", archive=NoneArchiveStrategy(),
                         key=f"{cfg.storage.models_prefix}/{cfg.pipeline.model_name}/"
                             "{{workflow.name}}")
    return step(cfg, "convert", "cpu",
                args=["--model", "{{inputs.artifacts.model.path}}",
                      "--dataset", "{{inputs.artifacts.dataset.path}}",
                      "--exported", "{{outputs.artifacts.exported.path}}"]
                + flags({"opset": c.opset, "parity_slices": c.parity_slices}),
                inputs=[Parameter(name="image-tag"), directory("model"), directory("dataset")],
                outputs=[directory("exported", output=True), release]
                + file_outputs("exported", CONVERT_OUTPUTS),
                env=extra_env(cfg))


def from_task(task: str, artifact: str, name: str | None = None) -> Artifact:
    return Artifact(name=name or artifact, from_=f"{{{{tasks.{task}.outputs.artifacts.{artifact}}}}}")


def params(**values: str) -> list[Parameter]:
    return [Parameter(name=k.replace("_", "-"), value=v) for k, v in values.items()]


def train_task_args() -> list:
    return params(**{p.replace("-", "_"): wf_param("train-image-tag" if p == "image-tag" else p)
                     for p in TRAIN_PARAMS})


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
             arguments=workflow_parameters(cfg),
             service_account_name=cfg.pipeline.service_account,
             artifact_repository_ref=m.ArtifactRepositoryRef(
                 config_map=s.artifact_repository_configmap, key=s.artifact_repository_key),
             security_context=m.PodSecurityContext(
                 run_as_non_root=True, run_as_user=cfg.pipeline.run_as_user,
                 run_as_group=cfg.pipeline.run_as_user, fs_group=cfg.pipeline.run_as_user),
             ) as workflow:
        download, preprocess = download_template(cfg), preprocess_template(cfg)
        convert = convert_template(cfg)
        if cfg.resources.train.nodes > 1:
            from workflows import multinode
            train_tasks = multinode.templates(cfg)
        else:
            train_tasks = None
            train = train_template(cfg)
        data_tag = wf_param("data-image-tag")
        with DAG(name="pipeline"):
            t_download = Task(name="download", template=download, arguments=params(
                source=wf_param("source"), md5=wf_param("md5"), image_tag=data_tag))
            t_pre = Task(name="preprocess", template=preprocess, arguments=params(
                source=wf_param("source"), md5=wf_param("md5"),
                image_dtype=wf_param("image-dtype"), mode=cfg.preprocess.mode,
                patch_size=wf_param("patch-size"), image_tag=data_tag,
                workers=str(cfg.preprocess.workers)) + [from_task("download", "raw")])
            if train_tasks is None:
                t_train = Task(name="train", template=train, arguments=train_task_args()
                               + [from_task("preprocess", "dataset")])
                last = t_train
            else:
                first, last = multinode.tasks(cfg, train_tasks, train_task_args())
                t_train = first
            t_convert = Task(name="convert", template=convert, arguments=params(
                image_tag=data_tag) + [from_task(last.name, "model"),
                                       from_task("preprocess", "dataset")])
            t_download >> t_pre >> t_train
            last >> t_convert
    return workflow


def render(cfg: Config, kind: str = "workflow") -> str:
    return build(cfg, kind).to_yaml()


if __name__ == "__main__":
    from workflows.cli import main
    sys.exit(main())
