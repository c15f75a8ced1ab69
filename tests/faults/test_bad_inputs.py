"""Every kind of bad input, through the real command lines, in one table.

Each case runs a step (or the workflow CLI) in a subprocess and must end with exit status 2,
exactly one stderr line starting ``error:`` that names the input, no traceback, no secret,
and nothing published in the output directory.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, assert_one_error_line
from steps import storage, synthetic
from steps.artifacts import write_manifest
from test_download import make_tar, member
from test_preprocess import _set as edit_case, _with, make_raw, small_cases

pytestmark = [pytest.mark.faults, pytest.mark.slow]
TASK = synthetic.TASK
CLI = [sys.executable, "workflows/unet.py"]


@dataclass
class Case:
    name: str
    command: list[str]
    needles: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    output: Path | None = None     # must hold nothing afterwards


def _step(module: str, *args) -> list[str]:
    return [sys.executable, "-m", f"steps.{module}", *map(str, args)]


def _download(tmp: Path, source: str, *extra: str) -> list[str]:
    return _step("download", "--source", source, "--raw", tmp / "raw", "--no-progress", *extra)


# ---- data builders ---------------------------------------------------------------------------
def _tar_cases(tmp: Path, good_tar: Path) -> list[Case]:
    broken = tmp / "broken.tar"
    broken.write_bytes(good_tar.read_bytes()[:20000])
    unsafe = {
        "tar member with ../": ("dotdot.tar", f"{TASK}/../../evil.txt", {}),
        "tar member with an absolute path": ("absolute.tar", "/tmp/faults-evil.txt", {}),
        "tar member that is a symlink": ("symlink.tar", f"{TASK}/link",
                                         {"kind": tarfile.SYMTYPE, "linkname": "/etc/passwd"}),
    }
    cases = [Case("corrupt tar", _download(tmp / "c1", f"file://{broken}"),
                  ("broken.tar", "not a readable tar"), output=tmp / "c1" / "raw"),
             Case("md5 mismatch", _download(tmp / "c2", f"file://{good_tar}", "--md5", "0" * 32),
                  ("Task01_BrainTumour.tar", "md5 mismatch", "0" * 32),
                  output=tmp / "c2" / "raw")]
    for i, (name, (file, entry, kw)) in enumerate(unsafe.items()):
        archive = make_tar(tmp / file, [member(entry, **kw)])
        out = tmp / f"u{i}"
        cases.append(Case(name, _download(out, f"file://{archive}"), (entry,),
                          output=out / "raw"))
    return cases


def _truncate(task: Path) -> None:
    path = task / "imagesTr" / "BRATS_003.nii.gz"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _volume_cases(tmp: Path) -> list[Case]:
    table = {
        "truncated .nii.gz": (None, _truncate, "truncated"),
        "image/label shape mismatch": (edit_case("label", lambda a: a[:, :, :-1]), None,
                                       "does not match"),
        "wrong channel count": (edit_case("image", lambda a: a[..., :3]), None, "3 channels"),
        "NaN voxels": (edit_case("image", lambda a: _with(a, np.nan)), None, "NaN"),
        "labels outside the declared set": (edit_case("label", lambda a: _with(a, 5)), None, "[5]"),
        "empty foreground": (edit_case("image", np.zeros_like), None, "empty foreground"),
    }
    cases = []
    for i, (name, (edit_cases, edit_files, needle)) in enumerate(table.items()):
        volumes = small_cases(5)
        if edit_cases:
            edit_cases(volumes)
        task = make_raw(tmp / f"v{i}" / "raw", volumes)
        if edit_files:
            edit_files(task)
            write_manifest(tmp / f"v{i}" / "raw", "raw", "download", {})
        out = tmp / f"v{i}" / "dataset"
        cases.append(Case(name, _step("preprocess", "--raw", tmp / f"v{i}" / "raw",
                                      "--dataset", out, "--workers", "1"),
                          ("BRATS_003", needle), output=out))
    return cases


def _config_cases() -> list[Case]:
    render = [*CLI, "render", "--profile", "local", "-p"]
    return [
        Case("unknown config key", [*render, "train.learning_rat=0.1"],
             ("train.learning_rat",)),
        Case("negative epochs", [*render, "train.max_epochs=-1"], ("train.max_epochs",)),
        Case("fold 7", [*render, "train.fold=7"], ("train.fold", "7")),
        Case("batch size 0", [*render, "train.batch_size=0"], ("train.batch_size",)),
        Case("argparse: unknown flag", _step("train", "--dataset", "d", "--model", "m",
                                             "--no-such-flag", "1"), ("--no-such-flag",)),
        Case("argparse: bad number", [*CLI, "submit", "--poll", "soon"], ("--poll", "soon")),
        Case("argparse: abbreviated flag", _step("train", "--dataset", "d", "--model", "m",
                                                 "--learning-rat", "1"), ("--learning-rat",)),
    ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _storage_cases(tmp: Path, s3, good_tar: Path) -> list[Case]:
    key = f"faults/{tmp.name}/Task01_BrainTumour.tar"
    storage.upload_file(good_tar, f"s3://{s3.bucket}/{key}", client=s3.client())
    uri = f"s3://{s3.bucket}/{key}"
    good = s3.env()
    no_keys = {k: v for k, v in good.items() if k not in ("AWS_ACCESS_KEY_ID",
                                                           "AWS_SECRET_ACCESS_KEY")}
    table = [
        ("missing credentials", uri, {**no_keys, "AWS_EC2_METADATA_DISABLED": "true",
                                      "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "none"),
                                      "AWS_CONFIG_FILE": str(tmp / "none")},
         (uri, "no S3 credentials")),
        ("wrong secret", uri, {**good, "AWS_SECRET_ACCESS_KEY": "not-" + s3.secret_key},
         (uri, "refused the credentials")),
        ("unreachable endpoint", uri,
         {**good, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{_free_port()}",
          "UNET_S3_MAX_ATTEMPTS": "2"}, (uri, "cannot reach S3")),
        ("missing bucket", f"s3://no-such-bucket-faults/{key}", good,
         ("no-such-bucket-faults", "does not exist")),
    ]
    return [Case(name, _download(tmp / f"s{i}", source), needles, env,
                 output=tmp / f"s{i}" / "raw")
            for i, (name, source, env, needles) in enumerate(table)]


# ---- the table ---------------------------------------------------------------------------------
def _run(case: Case) -> tuple[Case, subprocess.CompletedProcess]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(case.env, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run(case.command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=180)
    return case, done


def _check(case: Case, done: subprocess.CompletedProcess, secret: str) -> str | None:
    try:
        assert done.returncode == 2, f"exit {done.returncode}"
        assert_one_error_line(done.stderr, *case.needles)
        assert secret not in done.stderr + done.stdout
        if case.output is not None:
            assert not case.output.exists() or list(case.output.iterdir()) == [], \
                "something was published"
    except AssertionError as exc:
        return f"{case.name}: {exc}\n{done.stderr[-1500:]}"
    return None


def test_bad_inputs_give_one_line_and_exit_2(s3, tmp_path):
    good_tar = tmp_path / "Task01_BrainTumour.tar"
    synthetic.write_msd_tar(good_tar, cases=2, shape=(32, 32, 16), seed=4, test_cases=1)
    (tmp_path / "tar").mkdir()
    cases = _tar_cases(tmp_path / "tar", good_tar) + _volume_cases(tmp_path / "vol")
    cases += _config_cases()
    cases += _storage_cases(tmp_path / "s3", s3, good_tar)
    assert len({c.name for c in cases}) == len(cases) >= 15
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(_run, cases))
    failures = [f for f in (_check(c, d, s3.secret_key) for c, d in results) if f]
    print(f"bad-input table: {len(cases)} cases run, {len(cases) - len(failures)} passed")
    for case, done in results:
        print(f"  {case.name:35s} {done.stderr.strip().splitlines()[-1][:110]}")
    assert not Path("/tmp/faults-evil.txt").exists()
    assert not failures, "\n\n".join(failures)
