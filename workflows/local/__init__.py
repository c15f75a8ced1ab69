"""The local runner: executes the compiled Workflow on this machine (``run --local``).

    from workflows.local.runner import run_workflow
    result = run_workflow(build(cfg).to_dict(), output_dir="outputs")
    sys.exit(result.exit_code)

See :mod:`workflows.local.runner` for what it does in Argo's place, and
:mod:`workflows.local.spec` for what it ignores and what it refuses. The package itself
imports nothing, so its modules can import each other without a cycle through it.
"""
