"""The Hera templates of the pipeline: one container per step, their volumes, retries,
memoization, metrics and the workflow parameters of the Argo UI.

Every step parameter comes from ``steps.params``: its flag, the template input that carries
it, the DAG task's value (a workflow parameter, or the config's literal) and the UI's
description and enum; so do each step's artifacts and output parameters (``params.IO``).
One function builds the train pod (:func:`train_pod`) for this container template and for
the PyTorchJob. :mod:`workflows.unet` wires these templates into the DAG, and
:mod:`workflows.multinode` reuses them for a PyTorchJob.

Commands name their inputs as ``{{inputs.parameters.X}}`` strings (:func:`arg`): Hera's
``get_parameter`` reads a template that already exists, and a command is part of the
template being built.
"""
from __future__ import annotations

from dataclasses import dataclass

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
FOLD = "fold"
FOLD_STEPS = ("train", "convert", "evaluate")   # one task each per fold of pipeline.folds


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
            if p.ui and not (cfg.fans_out and p.name == FOLD):
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


def task_params(wf, cfg: Config, section: str, only: list[str] | None = None,
                fixed: dict[str, str] | None = None) -> list[Parameter]:
    """A step's input parameters on its DAG task: the workflow parameter (Hera's
    ``get_parameter``, which checks that it exists), the config's value, or the task's own
    (``fixed``: a fold's number)."""
    out, fixed = [], fixed or {}
    for p in params.STEPS[section]:
        if only is not None and p.dashed not in only or not as_input(section, p):
            continue
        if p.dashed in fixed:
            out.append(Parameter(name=p.dashed, value=fixed[p.dashed]))
        else:
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


def memoize(cfg: Config, stage: str, names: list[str]) -> dict:
    """A memoized template's ``memoize`` and ``synchronization``: a mutex named by the memo
    key, so that runs submitted together with the same inputs do not all miss the cache and
    run the step at once. The one that holds the mutex runs; each next one, when it gets
    the mutex, looks the key up again and hits (Argo v4.0.5 workflow/controller/operator.go
    executeTemplate: the cache is checked "if the node is about to be created, or was
    created in the past but is only now allowed to run due to acquiring a lock"). Without it
    Argo has no lock around a miss: every run saves its own entry (cache/configmap_cache.go
    Save, the last writer wins). A step whose output is read by key keeps entries of its own
    (``<stage>-uri-…``): an entry saved before it handed that output on as a URI lacks the
    parameter, and its readers would get none."""
    key = memo_key(f"{stage}-uri" if params.IO[stage].writes in BY_KEY else stage, names)
    return {"memoize": m.Memoize(key=key, max_age=cfg.memoize.max_age, cache=m.Cache(
                config_map=m.LocalObjectReference(name=cfg.memoize.config_map))),
            "synchronization": m.Synchronization(mutexes=[m.Mutex(name=key)])}


# Artifacts that a step reads by key (``params.StepIO.by_key``): the reader takes the S3 prefix
# as a parameter and fetches what it needs itself, where Argo's executor would copy the whole
# artifact into its pod (v4.0.5 workflow/artifacts/s3/s3.go GetDirectory).
BY_KEY = frozenset(a for io in params.IO.values() for a in io.by_key)


def artifact_key(artifact: str) -> str:
    """The key an artifact read by key is saved at, stated on its output rather than left to
    the repository's keyFormat: the same ``<workflow>/<pod>/<artifact>`` Argo would give it."""
    return "{{workflow.name}}/{{pod.name}}/" + artifact


def artifact_uri(cfg: Config, artifact: str) -> str:
    """The S3 URI of :func:`artifact_key` in the workflow's bucket."""
    return f"s3://{cfg.storage.bucket}/{artifact_key(artifact)}"


def saves_by_key_args(cfg: Config, step_name: str) -> list[str]:
    """``--<output>-uri`` for a step that saves its output by key as it works
    (``params.StepIO.saves_by_key``): the key its output artifact is saved at, where the
    executor then adds what is left in the folder. The controller renders the pod's name
    into the arguments and the output's key alike, in one pass over the template (v4.0.5
    workflow/controller/operator.go executeTemplate, ProcessArgs with localParams)."""
    io = params.IO[step_name]
    return [f"--{io.writes}-uri", artifact_uri(cfg, io.writes)] if io.saves_by_key else []


def uri_parameter(artifact: str) -> str:
    """The parameter that carries an artifact read by key from its writer to its readers."""
    return f"{artifact}-uri"


def directory(name: str, output: bool = False) -> Artifact:
    """A directory artifact at /data/<name>, stored unarchived (re-gzipping .npy is waste)."""
    return Artifact(name=name, path=f"{DATA}/{name}", archive=NoneArchiveStrategy() if output
                    else None)


def artifact_path(name: str, output: bool = False) -> str:
    """Where Argo puts an input artifact, or takes an output artifact from."""
    return "{{%s.artifacts.%s.path}}" % ("outputs" if output else "inputs", name)


def artifact_args(step_name: str, path=artifact_path) -> list[str]:
    """``--<artifact> DIR`` for the step's inputs, then its output (``params.IO``)."""
    io = params.IO[step_name]
    return ([word for name in io.reads for word in (
                f"--{name}", "{{inputs.parameters.%s}}" % uri_parameter(name)
                if name in io.by_key else path(name))]
            + [f"--{io.writes}", path(io.writes, output=True)])


def step_parameters(step_name: str) -> list[Parameter]:
    """A step template's input parameters: its step parameters, then its image tag."""
    return param_inputs(step_name) + [Parameter(name="image-tag")]


def step_inputs(step_name: str) -> list:
    io = params.IO[step_name]
    return step_parameters(step_name) + [Parameter(name=uri_parameter(a)) if a in io.by_key
                                         else directory(a) for a in io.reads]


def step_outputs(cfg: Config, step_name: str) -> list:
    """The output artifact, the parts of it shown on their own, its release copy, and the
    output parameters read from the files the step writes under it. A step run once per
    fold (:data:`FOLD_STEPS` under ``pipeline.folds``) has no release and sets no workflow
    output: the ensemble and the pool do."""
    io = params.IO[step_name]
    per_fold = cfg.fans_out and step_name in FOLD_STEPS
    out = (by_key_output(cfg, io.writes) if io.writes in BY_KEY
           else [keyed_directory(io.writes)] if io.saves_by_key
           else [directory(io.writes, output=True)]) + [
        Artifact(name=name, path=f"{artifact_path(io.writes, output=True)}/{file}",
                 archive=NoneArchiveStrategy()) for name, file in io.files.items()]
    if io.release is not None and not per_fold:
        out.append(release(cfg, f"{DATA}/{io.writes}", io.release))
    return out + result_parameters(io.writes, io.outputs, not per_fold)


def by_key_output(cfg: Config, artifact: str) -> list:
    """An output that a later step reads by key: saved at :func:`artifact_key`, and that
    key's URI as the output parameter :func:`uri_parameter`. The step writes no such file,
    so the executor takes the parameter's default (v4.0.5 workflow/executor/executor.go
    SaveParameters), which the controller has rendered with this pod's name before the pod
    exists, as it renders the whole template (workflow/controller/operator.go
    executeTemplate, localParams). A memoized writer's cache entry keeps both, so a cache hit
    hands its readers the key of the run that wrote it."""
    return [keyed_directory(artifact),
            Parameter(name=uri_parameter(artifact), value_from=m.ValueFrom(
                path=f"{DATA}/{artifact}/{params.OUTPUTS_DIR}/{uri_parameter(artifact)}",
                default=artifact_uri(cfg, artifact)))]


def keyed_directory(artifact: str) -> S3Artifact:
    """An output directory saved at :func:`artifact_key`, stated rather than left to the
    repository's keyFormat, because a step or a reader also names it."""
    return S3Artifact(name=artifact, path=f"{DATA}/{artifact}", archive=NoneArchiveStrategy(),
                      key=artifact_key(artifact))


def release(cfg: Config, path: str, suffix: str) -> S3Artifact:
    """The copy of a model at ``models/<model_name>/<workflow name><suffix>``."""
    return S3Artifact(name="release", path=path, archive=NoneArchiveStrategy(),
                      key=f"{cfg.storage.models_prefix}/{cfg.pipeline.model_name}/"
                          "{{workflow.name}}" + suffix)


def result_parameters(artifact: str, names, workflow_outputs: bool = True) -> list[Parameter]:
    """Output parameters from the files ``<artifact>/OUTPUTS_DIR/<name>`` that a step writes
    under its output artifact, also the workflow's outputs."""
    folder = f"{artifact_path(artifact, output=True)}/{params.OUTPUTS_DIR}"
    return [Parameter(name=n.replace("_", "-"), value_from=m.ValueFrom(path=f"{folder}/{n}"),
                      global_name=n.replace("_", "-") if workflow_outputs else None)
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


def data_step(cfg: Config, name: str, **kw) -> Container:
    """A CPU step whose command line, inputs and outputs all derive from ``params``."""
    io = params.IO[name]
    by_key = s3_env(cfg) if io.by_key or io.saves_by_key else []
    return step(cfg, name, "cpu",
                args=artifact_args(name) + saves_by_key_args(cfg, name) + param_args(cfg, name),
                inputs=kw.pop("inputs", []) + step_inputs(name), outputs=step_outputs(cfg, name),
                env=kw.pop("env", by_key + extra_env(cfg)), **kw)


def download_template(cfg: Config) -> Container:
    return data_step(cfg, "download", env=s3_env(cfg) + extra_env(cfg),
                     **memoize(cfg, "download", memo_names("download") + ["image-tag"]))


def preprocess_template(cfg: Config) -> Container:
    """Keyed by the download's inputs too: they determine the ``raw`` it reads."""
    keyed = memo_names("download") + memo_names("preprocess") + ["image-tag"]
    return data_step(cfg, "preprocess",
                     inputs=[Parameter(name=n) for n in memo_names("download")],
                     **memoize(cfg, "preprocess", keyed))


def train_args(cfg: Config, path=artifact_path) -> list[str]:
    """The train command: artifacts, wiring, then every train parameter.

    ``--devices`` is per node and ``--nodes`` is the node count, so the step expects
    ``WORLD_SIZE == nodes * devices`` from ``torch.distributed.run``.
    """
    return (artifact_args("train", path) + ["--nodes", str(cfg.resources.train.nodes),
                                            "--checkpoint-uri", checkpoint_uri(cfg)]
            + param_args(cfg, "train"))


def checkpoint_uri(cfg: Config) -> str:
    """Per workflow, so an Argo retry of the same workflow resumes where it stopped; per
    fold too under ``pipeline.folds``, where the folds train side by side."""
    s = cfg.storage
    fold = f"fold-{arg('fold')}/" if cfg.fans_out else ""
    return f"s3://{s.bucket}/{s.checkpoint_prefix}/{{{{workflow.name}}}}/{fold}"


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


def pod_security(cfg: Config) -> m.PodSecurityContext:
    """Every pod's: the images' non-root uid, which also owns the volumes."""
    uid = cfg.pipeline.run_as_user
    return m.PodSecurityContext(run_as_non_root=True, run_as_user=uid, run_as_group=uid,
                                fs_group=uid)


@dataclass
class TrainPod:
    """The pod that trains: built once (:func:`train_pod`) for the container template and for
    every replica of the PyTorchJob (``workflows.multinode``)."""
    container: m.Container
    volumes: list[m.Volume]
    node_selector: dict[str, str] | None
    tolerations: list[m.Toleration] | None
    deadline_s: int          # activeDeadlineSeconds of one attempt
    host_ipc: bool           # Gaudi's HCCL

    def spec(self, cfg: Config) -> dict:
        """As a Kubernetes PodSpec, with what Argo adds to its own pods from the workflow:
        the service account and the pod security context."""
        dump = lambda model: model.model_dump(by_alias=True, exclude_none=True)  # noqa: E731
        spec = {"serviceAccountName": cfg.pipeline.service_account,
                "activeDeadlineSeconds": self.deadline_s,
                "securityContext": dump(pod_security(cfg)),
                "containers": [dump(self.container)],
                "volumes": [dump(v) for v in self.volumes]}
        if self.host_ipc:
            spec["hostIPC"] = True
        if self.node_selector:
            spec["nodeSelector"] = self.node_selector
        if self.tolerations:
            spec["tolerations"] = [dump(t) for t in self.tolerations]
        return spec


def train_pod(cfg: Config, container: str, command: list[str],
              args: list[str] | None = None) -> TrainPod:
    """The train image with the checkpoint store's env, the accelerator's resources and
    volumes, node placement, the attempt's deadline and Gaudi's hostIPC."""
    resources, volumes, mounts = accelerator_resources(cfg)
    security, host_ipc = gaudi_pod(cfg)
    r = cfg.resources.train
    return TrainPod(
        container=m.Container(
            name=container, image=image(cfg, cfg.train_image_kind),
            image_pull_policy=cfg.images.pull_policy, command=command, args=args,
            env=s3_env(cfg) + extra_env(cfg), resources=resources, volume_mounts=mounts,
            security_context=security),
        volumes=volumes, node_selector=dict(r.node_selector) or None,
        tolerations=[m.Toleration(**t.model_dump(exclude_none=True)) for t in r.tolerations]
        or None, deadline_s=seconds(r.timeout), host_ipc=host_ipc)


def train_template(cfg: Config) -> Container:
    """The single-node train step. Argo takes the service account and the pod security
    context from the workflow, and hostIPC (no Template field) from a pod spec patch."""
    pod = train_pod(cfg, "main", ["python", "-m", "steps.train"], train_args(cfg))
    c = pod.container
    return Container(
        name="train", image=c.image, image_pull_policy=c.image_pull_policy,
        command=c.command, args=c.args,
        inputs=step_inputs("train"), outputs=step_outputs(cfg, "train"), env=c.env,
        resources=c.resources, volumes=pod.volumes, volume_mounts=c.volume_mounts,
        node_selector=pod.node_selector, tolerations=pod.tolerations,
        active_deadline_seconds=pod.deadline_s, security_context=c.security_context,
        pod_spec_patch='{"hostIPC": true}' if pod.host_ipc else None,
        retry_strategy=retry(cfg),
        metrics=m.Metrics(prometheus=[duration_metric(cfg)]))


def convert_template(cfg: Config) -> Container:
    tmpl = data_step(cfg, "convert")
    tmpl.inputs = list(tmpl.inputs) + [Parameter(name="precision")] + [
        Parameter(name=n) for n in RESULTS]
    tmpl.metrics = m.Metrics(prometheus=result_metrics(cfg))
    return tmpl


def quantize_template(cfg: Config) -> Container:
    """Beside the FP32 model: ``models/<model_name>/<workflow name>/int8/``."""
    return data_step(cfg, "quantize")


def evaluate_template(cfg: Config) -> Container:
    """The held-out fold's whole volumes through the exported model (steps.evaluate)."""
    return data_step(cfg, "evaluate")


def fold_inputs(artifact: str, folds: list[int]) -> list[Artifact]:
    """One input artifact per fold: ``<artifact>-fold-<k>`` at /data/<artifact>-fold-<k>."""
    return [directory(f"{artifact}-fold-{k}") for k in folds]


def ensemble_template(cfg: Config) -> Container:
    """The folds' models as one (steps.ensemble), an ``exported`` artifact released as the
    run's model: ``--exported`` the first fold's, ``--with-exported`` each other's, and the
    pool's table with its postprocessing decision (``--pooled``)."""
    exported = fold_inputs("exported", cfg.pipeline.folds)
    paths = [artifact_path(a.name) for a in exported]
    args = (["--exported", paths[0]] + [w for p in paths[1:] for w in ("--with-exported", p)]
            + ["--dataset", artifact_path("dataset"), "--pooled", artifact_path("pooled"),
               "--ensemble", artifact_path("exported", output=True)])
    return step(cfg, "ensemble", "cpu", args=args, resources="convert", env=extra_env(cfg),
                inputs=[Parameter(name="image-tag"), *exported, directory("dataset"),
                        directory("pooled")],
                outputs=[directory("exported", output=True),
                         release(cfg, f"{DATA}/exported", "")])


def pool_template(cfg: Config) -> Container:
    """The folds' evaluations pooled into the cross-validation table (steps.evaluate pool);
    its means, named as one evaluation's, are the workflow's outputs."""
    evaluations = fold_inputs("evaluation", cfg.pipeline.folds)
    args = (["pool", "--evaluation", *[artifact_path(a.name) for a in evaluations],
             "--pooled", artifact_path("pooled", output=True)])
    return step(cfg, "pool", "cpu", command=["python", "-m", "steps.evaluate"], args=args,
                env=extra_env(cfg),
                inputs=[Parameter(name="image-tag"), *evaluations],
                outputs=[directory("pooled", output=True),
                         *result_parameters("pooled", params.IO["evaluate"].outputs)])
