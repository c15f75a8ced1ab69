"""The Hera templates of the pipeline: one container per step, their volumes, retries,
memoization, metrics and the workflow parameters of the Argo UI.

Every step parameter comes from ``steps.params``: its flag, the template input that carries
it, the DAG task's value (a workflow parameter, or the config's literal) and the UI's
description and enum. :mod:`workflows.unet` wires these templates into the DAG, and
:mod:`workflows.multinode` reuses them for a PyTorchJob.

Commands name their inputs as ``{{inputs.parameters.X}}`` strings (:func:`arg`): Hera's
``get_parameter`` reads a template that already exists, and a command is part of the
template being built.
"""
from __future__ import annotations

from hera.workflows import Artifact, Container, Parameter, S3Artifact, models as m
from hera.workflows.archive import NoneArchiveStrategy

from steps import params
from steps.errors import EXIT_INPUT_ERROR
from steps.limits import CPUS_ENV
from workflows.config import Config, seconds

DATA = "/data"  # artifact paths inside a pod; the local runner remaps them
WORK_VOLUME = "work"  # the emptyDir at DATA that holds every artifact of a step pod
# Templates that memoize take every parameter as an input: the memo key hashes inputs only.
MEMOIZED = ("download", "preprocess")


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
    """What a user reruns with: the ``ui`` step parameters, with their help as the
    description and their choices (or a short integer range) as the UI's enum; then the
    image tags."""
    out = []
    for section, spec in params.STEPS.items():
        for p in spec:
            if p.ui:
                out.append(Parameter(name=p.dashed, value=p.text(value(cfg, section, p)),
                                     description=p.help, enum=_enum(cfg, p)))
    if cfg.quantizes:
        out.append(Parameter(name="quantize", value="true", enum=["true", "false"],
                             description="also publish a calibrated INT8 model, released only "
                                         "if its Dice is within the gate of the FP32 model's"))
    return out + [
        Parameter(name="data-image-tag", value=cfg.images.cpu.tag,
                  description=f"tag of {cfg.images.cpu.repository} (download, preprocess, "
                              "convert)"),
        Parameter(name="train-image-tag", value=cfg.image(cfg.train_image_kind).tag,
                  description=f"tag of {cfg.image(cfg.train_image_kind).repository} (train)"),
    ]


def _enum(cfg: Config, p: params.Param) -> list[str] | None:
    if p.name == "devices":   # the pod requests cfg's count: fewer may be used, never more
        return [str(n) for n in (1, 2, 4, 8, 16, 32, 64) if n <= cfg.train.devices]
    if p.choices:
        return list(p.choices)
    if p.type is int and p.ge is not None and p.le is not None and p.le - p.ge < 10:
        return [str(n) for n in range(int(p.ge), int(p.le) + 1)]
    return None


def value(cfg: Config, section: str, p: params.Param):
    return getattr(getattr(cfg, section), p.name)


def as_input(section: str, p: params.Param) -> bool:
    """Whether the template takes ``p`` as an input parameter (else a literal in its args)."""
    return p.ui or section in MEMOIZED


def param_args(cfg: Config, section: str) -> list[str]:
    """The step's parameter flags: an input reference, or the config's value as a literal."""
    out: list[str] = []
    for p in params.STEPS[section]:
        out += [p.flag, arg(p.dashed) if as_input(section, p) else p.text(value(cfg, section, p))]
    return out


def param_inputs(section: str) -> list[Parameter]:
    return [Parameter(name=p.dashed) for p in params.STEPS[section] if as_input(section, p)]


def task_params(wf, cfg: Config, section: str, only: list[str] | None = None) -> list[Parameter]:
    """A step's input parameters on its DAG task: the workflow parameter (Hera's
    ``get_parameter``, which checks that it exists) or the config's value."""
    out = []
    for p in params.STEPS[section]:
        if only is not None and p.dashed not in only or not as_input(section, p):
            continue
        out.append(wf.get_parameter(p.dashed) if p.ui else
                   Parameter(name=p.dashed, value=p.text(value(cfg, section, p))))
    return out


def memo_names(section: str) -> list[str]:
    """The inputs that determine a memoized step's output."""
    return [p.dashed for p in params.STEPS[section] if p.shapes_output]


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


def file_outputs(artifact: str, step: str) -> list[Parameter]:
    """Output parameters read from the files the step writes under its output artifact."""
    folder = f"{{{{outputs.artifacts.{artifact}.path}}}}/{params.OUTPUTS_DIR}"
    return [Parameter(name=n.replace("_", "-"), global_name=n.replace("_", "-"),
                      value_from=m.ValueFrom(path=f"{folder}/{n}"))
            for n in params.OUTPUTS[step]]


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
    """What every step's container gets: the config's literal ``extra_env``, and
    ``UNET_CPUS`` from the pod's own CPU request (downward API, rounded up to whole CPUs).
    The step templates set a CPU request but no CPU limit, so no cgroup quota tells a step
    its share; with this its threads and workers (``steps.limits.cpu_count``) match the
    request instead of the node's cores. Train's request equals its limit. A literal
    ``UNET_CPUS`` in ``extra_env`` overrides it."""
    literal = [m.EnvVar(name=k, value=v) for k, v in sorted(cfg.resources.extra_env.items())]
    if CPUS_ENV in cfg.resources.extra_env:
        return literal
    return literal + [m.EnvVar(name=CPUS_ENV, value_from=m.EnvVarSource(
        resource_field_ref=m.ResourceFieldSelector(resource="requests.cpu", divisor="1")))]


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


def step(cfg: Config, name: str, kind: str, command: list[str] | None = None,
         resources: str = "", **kw) -> Container:
    """A data-side container template: CPU image, work volume, deadline, retries. The
    command is ``python -m steps.<name>`` unless given; ``resources`` names the config's
    resources section when it is not ``name``."""
    res = getattr(cfg.resources, resources or name)
    volume, mount = work_volume(cfg)
    # A memoized step gets no retryStrategy: on a cache hit Argo (v4.0.5 to v4.1.2) makes a
    # Retry node without attempts, whose dependents are never linked to it
    # (workflow/controller/operator.go getOutboundNodes: a Retry node's outbound node is its
    # last attempt), so the DAG stays Running forever (dag.go assessDAGPhase walks children
    # only). Seen on the real controller (issue 23); pod_rules.memoized_retries keeps it so.
    retries = None if kw.get("memoize") else retry(cfg)
    return Container(
        name=name, image=image(cfg, kind), image_pull_policy=cfg.images.pull_policy,
        command=command or ["python", "-m", f"steps.{name}"],
        resources=step_resources(res.cpu, res.memory, cfg.resources.work_volume_size),
        volumes=[volume], volume_mounts=[mount],
        active_deadline_seconds=seconds(res.timeout), retry_strategy=retries, **kw)


def download_template(cfg: Config) -> Container:
    names = memo_names("download") + ["image-tag"]
    return step(cfg, "download", "cpu",
                args=["--raw", "{{outputs.artifacts.raw.path}}"] + param_args(cfg, "download"),
                inputs=param_inputs("download") + [Parameter(name="image-tag")],
                outputs=[directory("raw", output=True)],
                env=s3_env(cfg) + extra_env(cfg),
                memoize=memoize(cfg, "download", names))


def preprocess_template(cfg: Config) -> Container:
    """Keyed by the download's inputs too: they determine the ``raw`` it reads."""
    keyed = memo_names("download") + memo_names("preprocess") + ["image-tag"]
    return step(cfg, "preprocess", "cpu",
                args=["--raw", "{{inputs.artifacts.raw.path}}",
                      "--dataset", "{{outputs.artifacts.dataset.path}}"]
                + param_args(cfg, "preprocess"),
                inputs=[Parameter(name=n) for n in memo_names("download")]
                + param_inputs("preprocess") + [Parameter(name="image-tag"), directory("raw")],
                outputs=[directory("dataset", output=True)],
                env=extra_env(cfg),
                memoize=memoize(cfg, "preprocess", keyed))


def train_args(cfg: Config, dataset: str, model: str) -> list[str]:
    """The train command: artifacts, wiring, then every train parameter.

    ``--devices`` is per node and ``--nodes`` is the node count, so the step expects
    ``WORLD_SIZE == nodes * devices`` from ``torch.distributed.run``.
    """
    return (["--dataset", dataset, "--model", model,
             "--nodes", str(cfg.resources.train.nodes),
             "--checkpoint-uri", checkpoint_uri(cfg)] + param_args(cfg, "train"))


def train_inputs() -> list[Parameter]:
    return param_inputs("train") + [Parameter(name="image-tag")]


def checkpoint_uri(cfg: Config) -> str:
    """Per workflow, so an Argo retry of the same workflow resumes where it stopped."""
    s = cfg.storage
    return f"s3://{s.bucket}/{s.checkpoint_prefix}/{{{{workflow.name}}}}/"


def accelerator_resources(cfg: Config) -> tuple[m.ResourceRequirements, list, list]:
    """Train pod resources, volumes and mounts for the configured accelerator.

    Every train pod has the work volume at /data.
    gaudi: ``habana.ai/gaudi`` and ``hugepages-2Mi`` (per card x cards) as Habana documents
    (requests = limits; see :func:`gaudi_pod` for the rest of Habana's pod);
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
        per_card = int(r.hugepages_2mi_per_card[:-2])
        limits |= {"habana.ai/gaudi": devices,
                   "hugepages-2Mi": f"{per_card * cfg.train.devices}Mi"}
        volumes.append(m.Volume(name="hugepage", empty_dir=m.EmptyDirVolumeSource(
            medium="HugePages")))
        mounts.append(m.VolumeMount(name="hugepage", mount_path="/hugepages"))
    elif r.accelerator == "cuda":
        limits |= {"nvidia.com/gpu": devices}
    return m.ResourceRequirements(requests=dict(limits), limits=limits), volumes, mounts


# Intel Gaudi docs, "Pull Prebuilt Containers": --ipc=host "is required for distributed
# training using HCCL" (hostIPC here). Their examples also add SYS_NICE, but they run as root;
# our pods run as uid 1000, and Kubernetes puts an added capability only in a non-root
# process's bounding and inheritable sets, never its effective set (kubernetes/kubernetes
# #56374; no ambient capabilities), so SYS_NICE would do nothing: it is not asked for
# (issue 26). The cards come from the device plugin (habana.ai/gaudi), memory from hugepages.
GAUDI_CAPABILITIES: tuple[str, ...] = ()


def gaudi_pod(cfg: Config) -> tuple[m.SecurityContext | None, bool]:
    """(the train container's securityContext, hostIPC) for the configured accelerator."""
    if cfg.resources.train.accelerator != "gaudi":
        return None, False
    if not GAUDI_CAPABILITIES:
        return None, True
    return m.SecurityContext(capabilities=m.Capabilities(add=list(GAUDI_CAPABILITIES))), True


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
    the run.

    Every placeholder here exists on every node the metric is computed for. Argo fills a
    metric's placeholders strictly before it reads ``when`` (operator.go ``computeMetrics``:
    ``template.Replace(..., false)``, then ``shouldExecute``), and an attempt node has no
    ``{{retries}}`` (steps.go ``prepareMetricScope`` sets it only for a node with children), so
    a ``retries`` label made every failed attempt add a ``MetricsError`` to the Workflow
    (issue 26; pod_rules.metric_fields keeps it so).
    """
    return m.Prometheus(
        name="unet_train_duration_seconds",
        help="Wall time of the train step until it succeeded, retries included",
        labels=metric_labels(cfg),
        when=DONE, histogram=m.Histogram(value="{{duration}}", buckets=[
            60, 300, 900, 1800, 3600, 7200, 14400, 28800, 86400]))


RESULTS = ("mean-dice", "img-per-s")   # train outputs that convert takes in for the gauges


def result_metrics(cfg: Config) -> list[m.Prometheus]:
    """Gauges of the train results, on ``convert``, which takes them in as input parameters.

    Not on train (or collect-model) from its output parameters: Argo fills every placeholder
    of a metric before it reads ``when`` (operator.go ``computeMetrics``), and a failed attempt
    has no output parameters, so each one added a ``MetricsError`` to the Workflow (issue 26).
    A convert node only exists once training succeeded, so its inputs are always there; the
    gauges are set when convert succeeds."""
    gauge = lambda name, help_, out: m.Prometheus(  # noqa: E731
        name=name, help=help_, labels=metric_labels(cfg), when=DONE,
        gauge=m.Gauge(value="{{inputs.parameters.%s}}" % out, realtime=False))
    return [gauge("unet_train_mean_dice", "Best validation mean Dice (x100) of the run",
                  "mean-dice"),
            gauge("unet_train_images_per_second",
                  "Training throughput in 2D slices per second", "img-per-s")]


def model_outputs() -> list:
    report = Artifact(name="report", path="{{outputs.artifacts.model.path}}/report.html",
                      archive=NoneArchiveStrategy())
    return [directory("model", output=True), report] + file_outputs("model", "train")


def train_template(cfg: Config) -> Container:
    resources, volumes, mounts = accelerator_resources(cfg)
    security, host_ipc = gaudi_pod(cfg)
    r = cfg.resources.train
    return Container(
        name="train", image=image(cfg, cfg.train_image_kind),
        image_pull_policy=cfg.images.pull_policy,
        command=["python", "-m", "steps.train"],
        args=train_args(cfg, "{{inputs.artifacts.dataset.path}}",
                        "{{outputs.artifacts.model.path}}"),
        inputs=train_inputs() + [directory("dataset")],
        outputs=model_outputs(), env=s3_env(cfg) + extra_env(cfg),
        resources=resources, volumes=volumes, volume_mounts=mounts,
        node_selector=dict(r.node_selector) or None,
        tolerations=[m.Toleration(**t.model_dump(exclude_none=True)) for t in r.tolerations]
        or None, active_deadline_seconds=seconds(r.timeout),
        security_context=security,
        pod_spec_patch='{"hostIPC": true}' if host_ipc else None,  # no Template field for it
        retry_strategy=retry(cfg),
        metrics=m.Metrics(prometheus=[duration_metric(cfg)]))


def release_step(cfg: Config, name: str, reads: tuple[str, ...], writes: str,
                 key_suffix: str = "") -> Container:
    """A CPU step that reads the artifacts ``reads``, writes ``writes`` and also releases it
    to the stable key ``models/<model_name>/<workflow name><key_suffix>``."""
    release = S3Artifact(name="release", path=f"{DATA}/{writes}", archive=NoneArchiveStrategy(),
                         key=f"{cfg.storage.models_prefix}/{cfg.pipeline.model_name}/"
                             "{{workflow.name}}" + key_suffix)
    args = [word for artifact in reads
            for word in (f"--{artifact}", "{{inputs.artifacts.%s.path}}" % artifact)]
    return step(cfg, name, "cpu",
                args=args + [f"--{writes}", "{{outputs.artifacts.%s.path}}" % writes]
                + param_args(cfg, name),
                inputs=[Parameter(name="image-tag")] + [directory(a) for a in reads],
                outputs=[directory(writes, output=True), release] + file_outputs(writes, name),
                env=extra_env(cfg))


def convert_template(cfg: Config) -> Container:
    tmpl = release_step(cfg, "convert", ("model", "dataset"), "exported")
    tmpl.inputs = list(tmpl.inputs) + [Parameter(name="precision")] + [
        Parameter(name=n) for n in RESULTS]
    tmpl.metrics = m.Metrics(prometheus=result_metrics(cfg))
    return tmpl


def quantize_template(cfg: Config) -> Container:
    """Beside the FP32 model: ``models/<model_name>/<workflow name>/int8/``."""
    return release_step(cfg, "quantize", ("exported", "dataset"), "quantized", "/int8")
