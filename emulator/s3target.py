"""Which S3 a local run uses, the artifact bucket in it, and share links.

``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) set: that server, e.g. the MinIO of
``docker-compose.yml``, with the ``AWS_*`` credentials beside it. Unset: an embedded
SeaweedFS (:mod:`workflows.s3server`) started for the run, its data under ``<run_dir>/s3``
so results outlive the run, with credentials generated for this run and never printed.
The minio SDK is the control plane here: it creates the bucket and presigns links.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator, Mapping
from urllib.parse import urlsplit

from emulator.errors import LocalRunError
from steps import uris
from steps.storage import CONNECTION_VARS, DEFAULT_REGION, ENDPOINT_VARS
from workflows.s3server import SeaweedError, SeaweedServer


@dataclass
class S3Target:
    endpoint: str
    access_key: str
    secret_key: str
    region: str
    bucket: str
    embedded: bool = False

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": self.region}

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def minio(self):
        # minio is imported where used: benchmarks.common imports this module on the GPU
        # session's machine, which need not have minio.
        from minio import Minio
        parts = urlsplit(self.endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise LocalRunError(f"AWS_ENDPOINT_URL={self.endpoint!r} is not an http(s) URL")
        return Minio(parts.netloc, access_key=self.access_key, secret_key=self.secret_key,
                     secure=parts.scheme == "https", region=self.region)

    def ensure_bucket(self) -> bool:
        """Create the artifact bucket if it is missing; True when it was created."""
        from minio.error import MinioException
        client = self.minio()
        try:
            if client.bucket_exists(self.bucket):
                return False
            client.make_bucket(self.bucket)
            return True
        except (MinioException, OSError) as exc:
            # A concurrent run's creation: either the server says so, or (SeaweedFS, seen
            # under six racing creators) it answers NoSuchBucket and the bucket exists after.
            if getattr(exc, "code", None) == "BucketAlreadyOwnedByYou" or self._exists(client):
                return False
            raise LocalRunError(f"artifact bucket {self.bucket!r} at {self.endpoint}: "
                                f"{type(exc).__name__}: {_scrub(str(exc), self)}") from None

    def _exists(self, client) -> bool:
        from minio.error import MinioException
        try:
            return client.bucket_exists(self.bucket)
        except (MinioException, OSError):
            return False

    def presign(self, key: str, days: int = 7) -> str:
        return self.minio().presigned_get_object(self.bucket, key, expires=timedelta(days=days))


def _scrub(text: str, target: S3Target) -> str:
    return " ".join(text.replace(target.secret_key, "***").split())


@contextlib.contextmanager
def open_target(env: Mapping[str, str], bucket: str, state_dir: Path,
                log: Callable[[str], None]) -> Iterator[S3Target]:
    """Yield the run's S3; an embedded server lives exactly as long as the ``with``."""
    name = next((n for n in ENDPOINT_VARS if env.get(n)), None)
    endpoint = env[name] if name else None
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or DEFAULT_REGION
    if endpoint:
        # Printed below, recorded in result.json and handed to every step, which refuses it.
        uris.refuse_credentials(endpoint, name, "set AWS_ACCESS_KEY_ID and "
                                                "AWS_SECRET_ACCESS_KEY instead")
        key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
        if not key or not secret:
            raise LocalRunError(f"AWS_ENDPOINT_URL is {endpoint} but AWS_ACCESS_KEY_ID or "
                                "AWS_SECRET_ACCESS_KEY is not set (see .env.example)")
        target = S3Target(endpoint.rstrip("/"), key, secret, region, bucket)
        if target.ensure_bucket():
            log(f"created bucket {bucket} at {target.endpoint}")
        yield target
        return
    root = state_dir / "s3"
    try:
        server = SeaweedServer(root, buckets=[bucket], region=region)
        log(f"starting the embedded S3 server (SeaweedFS, data in {root}) ...")
        server.start()
    except SeaweedError as exc:
        raise LocalRunError(f"embedded S3: {exc} (or set AWS_ENDPOINT_URL, e.g. the MinIO "
                            "of docker-compose.yml)") from None
    try:
        target = S3Target(server.endpoint, server.access_key, server.secret_key, region,
                          bucket, embedded=True)   # the server made the bucket as it started
        log(f"embedded S3 at {server.endpoint}")
        yield target
    finally:
        server.stop()


@contextlib.contextmanager
def environ(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set ``values`` in os.environ for the ``with`` (None unsets), then restore the old ones."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        _set_environ(values)
        yield
    finally:
        _set_environ(saved)


def _set_environ(values: Mapping[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def process_env(target: S3Target):
    """Point :mod:`steps.storage` in this process at ``target`` for the ``with``; restore."""
    return environ({**dict.fromkeys(CONNECTION_VARS), **target.env()})
