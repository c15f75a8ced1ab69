"""Workflow side: the Hera definitions and their compiler, the CLI, the Argo client and the
embedded S3 server (the local runner is ``emulator/``, which only the CLI's ``run --local``
imports)."""
