"""The local runner: executes the compiled Workflow on this machine (``run --local``).

    from workflows.local import run_workflow
    result = run_workflow(build(cfg).to_dict(), output_dir="outputs")
    sys.exit(result.exit_code)

See :mod:`workflows.local.runner` for what it does in Argo's place, and
:mod:`workflows.local.spec` for what it ignores and what it refuses.
"""
from workflows.local.errors import LocalRunError
from workflows.local.results import ArtifactRef, ModelLink, NodeResult, RunResult
from workflows.local.runner import pod_name, run_workflow, validate_workflow

__all__ = ["run_workflow", "validate_workflow", "RunResult", "NodeResult", "ArtifactRef",
           "ModelLink", "LocalRunError", "pod_name"]
