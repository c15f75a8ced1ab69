"""Multi-node training (``resources.train.nodes > 1``) through a Kubeflow PyTorchJob.

Why PyTorchJob and not MPIJob: the train step is launched with ``torch.distributed.run``
(DESIGN.md), and the Training Operator's PyTorchJob sets exactly what torchrun reads on each
pod (``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``,
``PET_MASTER_PORT``), so every pod runs the same ``python -m torch.distributed.run -m
steps.train`` and HCCL/NCCL rendezvous through torch's own store. Habana's examples use
MPIJob because they launch with ``mpirun``; that needs a launcher pod, SSH keys between
workers and OpenMPI in the image, none of which this step uses.

The DAG becomes ``preprocess -> share-dataset -> train (resource) -> collect-model ->
convert``. The job's pods are not Argo pods, so ``share-dataset`` re-stores the dataset at a
fixed key under the workflow's name, the workers fetch it (``steps.handoff fetch``), rank 0
pushes the model (``steps.handoff push``), and ``collect-model`` turns that key back into the
ordinary ``model`` artifact with the train output parameters and metrics. The checkpoint URI
is the single-node one, so an Argo retry of the resource step resumes.

What the operator and Argo do, and what the job is built for (kubeflow/training-operator
v1.9.0, argo-workflows v4.1.2):

- **World size.** The operator hands ``nprocPerNode`` to torchrun as ``PET_NPROC_PER_NODE`` and
  the pod count as ``PET_NNODES`` (``pytorch/envvar.go``); torchrun gives every worker
  ``WORLD_SIZE = nnodes * nproc``. ``nprocPerNode`` is therefore the ``devices`` parameter
  itself, and the step is told ``--devices`` (per node) and ``--nodes``.
- **Failure.** Under ``restartPolicy: OnFailure`` the kubelet restarts a failed container in
  place, its pod never becomes Failed, and ``replicaStatuses.Master.failed`` never counts
  it. ``ExitCode`` lets the pod fail: exit codes 1-127 (torchrun exits 1 when a worker
  fails, the step 2 on bad input) fail the job at once, 128 and above (OOM kill, eviction)
  make the operator recreate the pod (``train_util.IsRetryableExitCode``). A job that fails
  through ``backoffLimit`` or ``activeDeadlineSeconds`` keeps its replica counts frozen and
  only appends a ``Failed`` condition, so the failure condition looks for that condition at
  each index it can take (Argo's conditions are label-selector requirements over JSON paths,
  ORed for failure; no list filters).
- **Deadlines.** The job's ``runPolicy.activeDeadlineSeconds`` is the train timeout, but
  v1.9.3 checks it only when something else makes it reconcile the job: the re-check it
  schedules goes to a ``FakeWorkQueue`` that drops it (``pytorchjob_controller.go``
  ``UpdateJobStatus``; kubeflow/trainer#3358), so a hung job with no pod changes ran on. Every
  replica's pod therefore has the same ``activeDeadlineSeconds``, which the kubelet enforces:
  the pod fails at the deadline, the operator reconciles, fails the job and deletes its pods
  (a worker that never started included). The resource node's own deadline is a little longer
  (the job is created and scheduled after the node starts) and stops the wait if the operator
  never reports at all.

What a failure does (issue 26; training-operator v1.9.3 and Argo v4.0.5, the versions that ran
it in ``tests/test_multinode.py``):

- **Every replica ``restartPolicy: Never``.** Under ``ExitCode`` the operator deletes and
  recreates a pod that exits with 128 or more (``common/pod.go`` ``ReconcilePods``,
  ``train_util.IsRetryableExitCode``), and ``runPolicy.backoffLimit`` never stops that: it
  sums container ``restartCount`` of Running pods only (``core/job.go``
  ``PastBackoffLimit``), which stays 0 for recreated pods. A recreated rank cannot rejoin a
  running static rendezvous anyway. Under ``Never`` one failed replica fails the job
  (``pytorch/pytorchjob_controller.go`` ``UpdateJobStatus``), and Argo's ``retryStrategy.limit``
  is the one bound on attempts; each attempt resumes from the checkpoint.
- **``cleanPodPolicy: All``.** When the job is finished (Failed, Succeeded, past its deadline)
  the operator deletes every pod (``common/job.go`` ``ReconcileJobs`` ->
  ``DeletePodsAndServices``); with ``None`` the surviving replicas keep their cards.
- **One job per workflow, by name.** The job is ``{{workflow.name}}-train`` and the resource
  action is ``apply``: the operator names pods ``<job>-master-0``, ``<job>-worker-N``, and the
  API server keeps a name until the kubelet has stopped that pod, so a retry's rank 0 cannot
  start while the previous one still runs: two attempts never write the checkpoint at once.
  ``ttlSecondsAfterFinished`` deletes a finished job (``common/job.go`` ``CleanupJob``) before
  Argo's first retry wait ends (``JOB_TTL_S`` < ``retry.backoff_duration``, a lint rule), so
  the retry creates a fresh job; a retry after the resource pod itself died re-attaches to the
  job that still runs (``apply`` of an unchanged manifest changes nothing).
- **``argo stop``.** Stopping kills the resource pod but not the job; the workflow's exit
  handler ``release-train`` deletes this workflow's jobs by label and waits until their pods
  are gone (``kubectl delete --cascade=foreground --wait``; Argo runs exit handlers on
  ``stop``, not on ``terminate``). The job is also owned by the Workflow
  (``setOwnerReference``), so deleting the Workflow deletes it.
- **Bad input fails once.** A resource node's ``lastRetry.exitCode`` is argoexec's, never the
  step's 2, and the job object carries no exit code, so Argo cannot tell bad input from a
  crash. Instead the step writes its one ``error:`` line to ``UNET_INPUT_ERROR_FILE``
  (``steps.errors.run_main``); every rank then exits 0, rank 0 stores that line where the model
  would go (``steps.handoff refuse``), the job ends Succeeded with no pod left, and
  ``collect-model`` fails with exit 2 and that line, which is not retried.
"""
from __future__ import annotations

import shlex

import yaml
from hera.workflows import Parameter, Resource, S3Artifact, Task
from hera.workflows import models as m
from hera.workflows.archive import NoneArchiveStrategy

from steps import params
from workflows.config import Config, seconds
from workflows import templates as t

POD_DATA = t.DATA  # inside the job's pods (not an Argo artifact path): the work volume
MASTER_PORT = 23456  # the operator's default; its Master must name the port pytorchjob-port
RESOURCE_GRACE_S = 900  # the resource node waits this much longer than the job may run
CONDITION_INDEXES = range(6)  # Created, Running/Restarting, Suspended, Succeeded|Failed, ...
JOB_TTL_S = 20  # a finished job is deleted after this; > the 5 s argoexec poll, < the retry wait
INPUT_ERROR_FILE = f"{POD_DATA}/input-error"  # the step's one error line on bad input
JOB_LABEL = "workflows.argoproj.io/workflow"
TRAIN_IO = params.IO["train"]   # one input artifact, handed to the job and back by key


def shared_key(what: str) -> str:
    return "{{workflow.name}}/shared/%s" % what


def shared_uri(cfg: Config, what: str) -> str:
    return f"s3://{cfg.storage.bucket}/{shared_key(what)}"


def pod_path(name: str, output: bool = False) -> str:
    """An artifact's directory inside a replica's pod (the job's pods are not Argo's); in
    place of ``templates.artifact_path``, whose signature it keeps."""
    return f"{POD_DATA}/{name}"


def _worker_script(cfg: Config) -> str:
    """Fetch the dataset, train under torchrun, then: bad input -> rank 0 stores the error
    line as the model's verdict and every rank exits 0; any other failure -> torchrun's exit
    status (the job fails, Argo retries); success -> rank 0 pushes the model."""
    (dataset,), model = TRAIN_IO.reads, TRAIN_IO.writes
    rank0 = 'if [ "${PET_NODE_RANK:-0}" = "0" ]; then %s; fi'
    handoff = lambda *a: shlex.join(["python", "-m", "steps.handoff", *a])  # noqa: E731
    return "\n".join([
        "set -e",
        handoff("fetch", "--artifact", dataset, shared_uri(cfg, dataset), pod_path(dataset)),
        "rc=0",
        f"UNET_INPUT_ERROR_FILE={INPUT_ERROR_FILE} "
        + shlex.join(["python", "-m", "torch.distributed.run", "-m", "steps.train"]
                     + t.train_args(cfg, pod_path)) + " || rc=$?",
        f"if [ -s {INPUT_ERROR_FILE} ]; then "
        + rank0 % handoff("refuse", "--artifact", model, INPUT_ERROR_FILE,
                          shared_uri(cfg, model)) + "; exit 0; fi",
        '[ "$rc" = 0 ] || exit "$rc"',
        rank0 % handoff("push", "--artifact", model, pod_path(model), shared_uri(cfg, model)),
    ])


def _replicas(cfg: Config, replicas: int, master: bool) -> dict:
    """One replica spec: the train pod (``templates.train_pod``) running the worker script;
    the master also names the rendezvous port."""
    pod = t.train_pod(cfg, "pytorch",   # the operator requires this container name
                      ["sh", "-c", _worker_script(cfg)])
    if master:
        pod.container.ports = [m.ContainerPort(name="pytorchjob-port",
                                               container_port=MASTER_PORT)]
    return {"replicas": replicas, "restartPolicy": "Never", "template": {"spec": pod.spec(cfg)}}


def job_name() -> str:
    return "{{workflow.name}}-train"


def job_manifest(cfg: Config) -> str:
    nodes = cfg.resources.train.nodes
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": job_name(),
                     "labels": {"app.kubernetes.io/name": "unet-argo",
                                JOB_LABEL: "{{workflow.name}}"}},
        "spec": {
            "nprocPerNode": t.arg("devices"),
            "runPolicy": {"cleanPodPolicy": "All", "ttlSecondsAfterFinished": JOB_TTL_S,
                          "activeDeadlineSeconds": seconds(cfg.resources.train.timeout)},
            "pytorchReplicaSpecs": {"Master": _replicas(cfg, 1, master=True),
                                    "Worker": _replicas(cfg, nodes - 1, master=False)},
        },
    }
    return yaml.safe_dump(job, sort_keys=False, width=1000)


def failure_condition() -> str:
    """A ``Failed`` condition at any index the operator can put it (ORed by Argo)."""
    return ", ".join(f"status.conditions.{i}.type == Failed" for i in CONDITION_INDEXES)


def release_template() -> Resource:
    """The exit handler: delete this workflow's PyTorchJobs and wait until their pods are gone
    (a delete action may have flags and no manifest: workflow/validate/validate.go; argoexec
    runs ``kubectl delete --ignore-not-found FLAGS``: workflow/executor/resource.go)."""
    return Resource(name="release-train", action="delete", active_deadline_seconds=900, flags=[
        "pytorchjobs.kubeflow.org", "--selector", JOB_LABEL + "={{workflow.name}}",
        "--cascade=foreground", "--wait=true", "--timeout=10m"])


def templates(cfg: Config) -> dict:
    """The templates that replace the single train container, and the exit handler."""
    verify = lambda artifact: ["python", "-m", "steps.handoff", "verify",  # noqa: E731
                               "--artifact", artifact, t.artifact_path(artifact)]
    (dataset,), model = TRAIN_IO.reads, TRAIN_IO.writes
    share = t.step(
        cfg, "share-dataset", "cpu", verify(dataset), resources="handoff",
        inputs=[Parameter(name="image-tag"), t.directory(dataset)],
        outputs=[S3Artifact(name=dataset, path=f"{t.DATA}/{dataset}",
                            key=shared_key(dataset), archive=NoneArchiveStrategy())])
    train = Resource(
        name="train", action="apply", set_owner_reference=True,
        manifest=job_manifest(cfg),
        success_condition="status.replicaStatuses.Master.succeeded > 0",
        failure_condition=failure_condition(),
        inputs=t.step_parameters("train"),
        active_deadline_seconds=seconds(cfg.resources.train.timeout) + RESOURCE_GRACE_S,
        retry_strategy=t.retry(cfg), metrics=m.Metrics(prometheus=[
            t.duration_metric(cfg)]))
    collect = t.step(
        cfg, "collect-model", "cpu", verify(model), resources="handoff",
        inputs=[Parameter(name="image-tag"), Parameter(name="precision"),
                S3Artifact(name=model, path=f"{t.DATA}/{model}", key=shared_key(model))],
        outputs=t.step_outputs(cfg, "train"))
    return {"share": share, "train": train, "collect": collect, "release": release_template()}


def tasks(wf, tmpl: dict, train_args: list[Parameter], dataset) -> tuple[Task, Task]:
    """Create the tasks inside the open DAG; return (first, last) for the caller's wiring."""
    data_tag = wf.get_parameter("data-image-tag").with_name("image-tag")
    share = Task(name="share-dataset", template=tmpl["share"], arguments=[data_tag, dataset])
    train = Task(name="train", template=tmpl["train"], arguments=train_args)
    collect = Task(name="collect-model", template=tmpl["collect"],
                   arguments=[data_tag, wf.get_parameter("precision")])
    share >> train >> collect
    wf.on_exit = tmpl["release"]
    return share, collect
