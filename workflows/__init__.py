"""Workflow side: Hera definitions, the CLI, the local runner and its embedded S3 server."""
