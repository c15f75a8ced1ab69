"""4. Artifact hand-off through a real local SeaweedFS: upload then download of a dataset.

- ours: ``steps.storage.upload_dir`` / ``download_dir`` (manifest last, sha256 verified on
  download) of our ``dataset`` artifact (float16, whole in-plane extent);
- baseline: the anchors' layout (float32 192×160 ``.npy``) moved file by file with a plain
  boto3 client's ``upload_file`` / ``download_file`` and boto3's default ``TransferConfig``;
- best plain boto3: the same per-file loop on our files with the best of a few
  (part size, concurrency) settings;
- floor: ``shutil.copytree`` of our files on local disk.

It also records the S3 server's own CPU time for our upload and for our download, per GiB:
where the server shares the node's cores with the steps (the test cluster), what it spends on a
write is time the steps cannot use. SeaweedFS 4.48 hashes written bytes with MD5 in several
places (the S3 ETag, each chunk's, the volume server's parse of each upload: ``go tool pprof``
of its debug endpoint, 2026-11-30), so a write costs it several times a read.

Every plain boto3 client here gets ``steps.storage.harden`` (it removes ``Expect:
100-continue`` from empty PUTs, which otherwise stalls SeaweedFS connections); the
baseline needs it too, so the comparison is not skewed by it.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import boto3
from boto3.s3.transfer import TransferConfig

from benchmarks.common import Row, Settings, dataset_dir, environ
from steps import storage
from steps.artifacts import list_files
from workflows.s3server import SeaweedServer

MiB = 1 << 20
BUCKET = "bench-handoff"
GRID = [(16, 8), (16, 16), (64, 4), (64, 8)]   # (part MiB, threads) tried for "best"


def plain_client(server: SeaweedServer):
    return storage.harden(boto3.session.Session().client(
        "s3", endpoint_url=server.endpoint, region_name=server.region,
        aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key))


def _size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def plain_roundtrip(s3, root: Path, prefix: str, dest: Path,
                    config: TransferConfig | None) -> tuple[float, float]:
    """(upload s, download s) of every file under ``root``, one file after another."""
    files = list_files(root)
    kwargs = {"Config": config} if config else {}
    start = time.perf_counter()
    for rel in files:
        s3.upload_file(str(root / rel), BUCKET, f"{prefix}/{rel.as_posix()}", **kwargs)
    up = time.perf_counter() - start
    start = time.perf_counter()
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(BUCKET, f"{prefix}/{rel.as_posix()}", str(dest / rel), **kwargs)
    return up, time.perf_counter() - start


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ours_roundtrip(root: Path, prefix: str, dest: Path,
                   server_pid: int) -> tuple[float, float, dict]:
    """(upload s, download s, the server's CPU s for each) of our upload_dir/download_dir."""
    uri = f"s3://{BUCKET}/{prefix}"
    cpu0, start = cpu_s(server_pid), time.perf_counter()
    storage.upload_dir(root, uri, progress=False)
    up, cpu1 = time.perf_counter() - start, cpu_s(server_pid)
    start = time.perf_counter()
    storage.download_dir(uri, dest, artifact="dataset", progress=False)
    down, cpu2 = time.perf_counter() - start, cpu_s(server_pid)
    return up, down, {"server_cpu_s_upload": cpu1 - cpu0, "server_cpu_s_download": cpu2 - cpu1}


def _entry(up: float, down: float, nbytes: int) -> dict:
    return {"upload_s": up, "download_s": down, "wall_s": up + down, "bytes": nbytes,
            "upload_mib_s": nbytes / MiB / up, "download_mib_s": nbytes / MiB / down}


def run(settings: Settings) -> dict:
    ours_dir, anchor_dir = dataset_dir(settings, "default"), dataset_dir(settings, "anchor")
    scratch = settings.workdir / "handoff"
    shutil.rmtree(scratch, ignore_errors=True)
    results = {}
    with SeaweedServer(scratch / "s3", buckets=[BUCKET]) as server, environ(server.env()):
        s3 = plain_client(server)

        def fresh(name: str) -> Path:
            path = scratch / "down" / name
            shutil.rmtree(path, ignore_errors=True)
            return path

        results["anchor_layout_boto3_defaults"] = _entry(
            *plain_roundtrip(s3, anchor_dir, "anchor-defaults", fresh("a"), None),
            _size(anchor_dir))
        up, down, server_cpu = ours_roundtrip(ours_dir, "ours", fresh("o"), server.pid)
        gib = _size(ours_dir) / (1 << 30)
        results["ours"] = {**_entry(up, down, _size(ours_dir)), **server_cpu,
                           "server_cpu_s_per_gib_written": server_cpu["server_cpu_s_upload"] / gib,
                           "server_cpu_s_per_gib_read": server_cpu["server_cpu_s_download"] / gib}
        grid = GRID[:1] if settings.smoke else GRID
        for part, threads in grid:
            config = TransferConfig(multipart_threshold=part * MiB, multipart_chunksize=part * MiB,
                                    max_concurrency=threads)
            results[f"ours_files_boto3_{part}MiB_x{threads}"] = _entry(
                *plain_roundtrip(s3, ours_dir, f"best-{part}-{threads}", fresh("b"), config),
                _size(ours_dir))
        results["ours_files_boto3_defaults"] = _entry(
            *plain_roundtrip(s3, ours_dir, "ours-defaults", fresh("d"), None), _size(ours_dir))
    start = time.perf_counter()
    shutil.copytree(ours_dir, fresh("copy"))
    results["disk_copy_floor"] = {"wall_s": time.perf_counter() - start, "bytes": _size(ours_dir)}
    shutil.rmtree(scratch, ignore_errors=True)

    best_name = min((k for k in results if k.startswith("ours_files_boto3_")),
                    key=lambda k: results[k]["wall_s"])
    ours = results["ours"]["wall_s"]
    rows = [
        Row("hand-off", "wall s, upload + download (ours vs anchors' layout, boto3 defaults)",
            "s", ours, results["anchor_layout_boto3_defaults"]["wall_s"],
            "anchors' float32 layout, plain boto3 defaults", "<= 0.5"),
        Row("hand-off", f"wall s, same files (ours vs best plain boto3: {best_name[17:]})",
            "s", ours, results[best_name]["wall_s"], "best plain boto3 config", "<= 1.1"),
        Row("hand-off", "wall s (ours vs local disk copy, the floor)", "s", ours,
            results["disk_copy_floor"]["wall_s"], "shutil.copytree"),
    ]
    return {"rows": rows, "details": {"transfers": results, "best_plain_boto3": best_name,
                                      "grid_part_mib_x_threads": grid,
                                      "server": "SeaweedFS (weed mini) on loopback, "
                                                "sharing the machine's cores",
                                      "harden": "every plain boto3 client uses storage.harden",
                                      "ours_includes": "manifest-last upload, sha256 check "
                                                       "of every file after download"}}
