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
- **Deadlines.** The job's ``runPolicy.activeDeadlineSeconds`` is the train timeout; the
  resource node's own deadline is a little longer (the job is created and scheduled after
  the node starts) and stops the wait if the operator never reports at all.
"""
from __future__ import annotations

import shlex

import yaml
from hera.workflows import Parameter, Resource, S3Artifact, Task
from hera.workflows import models as m
from hera.workflows.archive import NoneArchiveStrategy

from workflows.config import Config, seconds
from workflows import templates as t

POD_DATA = t.DATA  # inside the job's pods (not an Argo artifact path): the work volume
MASTER_PORT = 23456  # the operator's default; its Master must name the port pytorchjob-port
RESOURCE_GRACE_S = 900  # the resource node waits this much longer than the job may run
CONDITION_INDEXES = range(6)  # Created, Running/Restarting, Suspended, Succeeded|Failed, ...


def shared_key(what: str) -> str:
    return "{{workflow.name}}/shared/%s" % what


def shared_uri(cfg: Config, what: str) -> str:
    return f"s3://{cfg.storage.bucket}/{shared_key(what)}"


def _worker_script(cfg: Config) -> str:
    train = t.train_args(cfg, f"{POD_DATA}/dataset", f"{POD_DATA}/model")
    return " && ".join([
        "set -e",
        shlex.join(["python", "-m", "steps.handoff", "fetch", "--artifact", "dataset",
                    shared_uri(cfg, "dataset"), f"{POD_DATA}/dataset"]),
        shlex.join(["python", "-m", "torch.distributed.run", "-m", "steps.train"] + train),
        'if [ "${PET_NODE_RANK:-0}" = "0" ]; then '
        + shlex.join(["python", "-m", "steps.handoff", "push", "--artifact", "model",
                      f"{POD_DATA}/model", shared_uri(cfg, "model")]) + "; fi",
    ])


def _pod(cfg: Config, replicas: int, master: bool) -> dict:
    resources, volumes, mounts = t.accelerator_resources(cfg)
    r = cfg.resources.train
    env = [e.model_dump(by_alias=True, exclude_none=True)
           for e in t.s3_env(cfg) + t.extra_env(cfg)]
    pod = {
        "serviceAccountName": cfg.pipeline.service_account,
        "securityContext": {"runAsNonRoot": True, "runAsUser": cfg.pipeline.run_as_user,
                            "runAsGroup": cfg.pipeline.run_as_user,
                            "fsGroup": cfg.pipeline.run_as_user},
        "containers": [{
            "name": "pytorch",  # the operator requires this container name
            "image": t.image(cfg, cfg.train_image_kind),
            "imagePullPolicy": cfg.images.pull_policy,
            "command": ["sh", "-c", _worker_script(cfg)],
            "env": env,
            "resources": resources.model_dump(by_alias=True, exclude_none=True),
            "volumeMounts": [v.model_dump(by_alias=True, exclude_none=True) for v in mounts],
        }],
        "volumes": [v.model_dump(by_alias=True, exclude_none=True) for v in volumes],
    }
    security, host_ipc = t.gaudi_pod(cfg)
    if security is not None:
        pod["containers"][0]["securityContext"] = security.model_dump(by_alias=True,
                                                                       exclude_none=True)
    if host_ipc:
        pod["hostIPC"] = True
    if r.node_selector:
        pod["nodeSelector"] = dict(r.node_selector)
    if r.tolerations:
        pod["tolerations"] = [t.model_dump(exclude_none=True) for t in r.tolerations]
    if master:
        pod["containers"][0]["ports"] = [{"name": "pytorchjob-port",
                                          "containerPort": MASTER_PORT}]
    return {"replicas": replicas, "restartPolicy": "ExitCode", "template": {"spec": pod}}


def job_manifest(cfg: Config) -> str:
    nodes = cfg.resources.train.nodes
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"generateName": "{{workflow.name}}-train-",
                     "labels": {"app.kubernetes.io/name": "unet-argo",
                                "workflows.argoproj.io/workflow": "{{workflow.name}}"}},
        "spec": {
            "nprocPerNode": t.arg("devices"),
            "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": cfg.retry.limit,
                          "activeDeadlineSeconds": seconds(cfg.resources.train.timeout)},
            "pytorchReplicaSpecs": {"Master": _pod(cfg, 1, master=True),
                                    "Worker": _pod(cfg, nodes - 1, master=False)},
        },
    }
    return yaml.safe_dump(job, sort_keys=False, width=1000)


def failure_condition() -> str:
    """A ``Failed`` condition at any index the operator can put it (ORed by Argo)."""
    return ", ".join(f"status.conditions.{i}.type == Failed" for i in CONDITION_INDEXES)


def templates(cfg: Config) -> dict:
    """The three templates that replace the single train container."""
    verify = lambda artifact: ["python", "-m", "steps.handoff", "verify",  # noqa: E731
                               "--artifact", artifact,
                               "{{inputs.artifacts.%s.path}}" % artifact]
    share = t.step(
        cfg, "share-dataset", "cpu", verify("dataset"), resources="handoff",
        inputs=[Parameter(name="image-tag"), t.directory("dataset")],
        outputs=[S3Artifact(name="dataset", path=f"{t.DATA}/dataset",
                            key=shared_key("dataset"), archive=NoneArchiveStrategy())])
    train = Resource(
        name="train", action="create", set_owner_reference=True,
        manifest=job_manifest(cfg),
        success_condition="status.replicaStatuses.Master.succeeded > 0",
        failure_condition=failure_condition(),
        inputs=t.train_inputs(),
        active_deadline_seconds=seconds(cfg.resources.train.timeout) + RESOURCE_GRACE_S,
        retry_strategy=t.retry(cfg), metrics=m.Metrics(prometheus=[
            t.duration_metric(cfg)]))
    collect = t.step(
        cfg, "collect-model", "cpu", verify("model"), resources="handoff",
        inputs=[Parameter(name="image-tag"), Parameter(name="precision"),
                S3Artifact(name="model", path=f"{t.DATA}/model", key=shared_key("model"))],
        outputs=t.model_outputs(),
        metrics=m.Metrics(prometheus=t.result_metrics(cfg)))
    return {"share": share, "train": train, "collect": collect}


def tasks(wf, tmpl: dict, train_args: list[Parameter], dataset) -> tuple[Task, Task]:
    """Create the tasks inside the open DAG; return (first, last) for the caller's wiring."""
    data_tag = wf.get_parameter("data-image-tag").with_name("image-tag")
    share = Task(name="share-dataset", template=tmpl["share"], arguments=[data_tag, dataset])
    train = Task(name="train", template=tmpl["train"], arguments=train_args)
    collect = Task(name="collect-model", template=tmpl["collect"],
                   arguments=[data_tag, wf.get_parameter("precision")])
    share >> train >> collect
    return share, collect
