"""The local runner: executes the compiled Workflow on this machine (``run --local``).

    from emulator.runner import run_workflow
    result = run_workflow(build(cfg).to_dict(), output_dir="outputs")
    sys.exit(result.exit_code)

See :mod:`emulator.runner` for what it does in Argo's place, and
:mod:`emulator.spec` for what it ignores and what it refuses. The package itself
imports nothing, so its modules can import each other without a cycle through it.

**Checked against Argo Workflows v4.0.5** (the controller, argoexec and ``argo server``
built from the Go module, on the single-node Kubernetes v1.35.4 of ``cluster/``), by
``tests/test_cluster.py``: the pipeline's compiled Workflow under one workflow name on both,
in six scenarios (a plain run, a train attempt that fails once and resumes, an exit-2 input
error, memoization hits, a hit whose artifacts were deleted, an attempt past its deadline).
Node phases, attempt counts, per-attempt exit codes, output parameters (values where they do
not depend on the machine), artifact keys and the workflow's phase agree. That check changed
two things here: a step stopped by a signal reports 128 + N as a container does (143 at a
deadline, not -15), and a run whose failed branch ended in Error is Error, not Failed.
What still differs, on purpose:

- Argo adds a ``main-logs`` artifact (``<workflow>/<pod>/main.log``) to every pod when the
  artifact repository says ``archiveLogs``, a cluster setting the Workflow does not carry;
  the emulator keeps each pod's log in its run directory.
- Messages differ in wording. A memoization hit whose ``archive: none`` directory is gone
  fails Argo's init container with exit code 64 and ``rename …/<name>.tmp …: no such file or
  directory``; here ``artifact <name> failed to load: …``. Phase (Error), attempts and exit
  codes (none: the step never ran) agree.
- The memoization cache is an object in the artifact bucket, not a ConfigMap in the
  controller's namespace (``memo``).
"""
