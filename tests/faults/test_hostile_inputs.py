"""Hostile inputs: data crafted to escape, exhaust or confuse the steps, through the real CLIs.

Every case runs a step in a subprocess (cwd = the repository, no ``AWS_*`` variables, its own
``TMPDIR`` inside ``tmp_path``). A refused input must end with exit status 2 and exactly one
``error:`` line that names it, no traceback, nothing published in the output directory, no
``.<out>.download`` cache left beside it, no temporary file left in ``TMPDIR`` and no new entry
(such as a folder named ``file:``) in the working directory. Inputs that are hostile only in
what they hide (unlisted links, loops, a big-endian volume) must be accepted, with nothing but
the listed data published.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import nibabel as nib
import numpy as np
import pytest

from conftest import REPO, assert_one_error_line, error_lines
from steps import synthetic
from steps.artifacts import MANIFEST, require, write_manifest
from test_preprocess import make_raw, small_cases
from train_data import make_dataset

pytestmark = [pytest.mark.faults, pytest.mark.slow]
TASK = synthetic.TASK
SHAPE = (32, 32, 16)
VICTIM = "BRATS_003"                   # the case whose files the preprocess tests replace
GiB = 1 << 30
# Tiny CPU training: 32x32 patches, 4 levels (size multiple 8), one step of two slices.
TINY_TRAIN = ["--device", "cpu", "--base-filters", "4", "--levels", "4", "--num-workers", "0",
              "--batch-size", "2", "--val-batch-size", "16", "--steps-per-epoch", "1",
              "--max-epochs", "1", "--patience", "0", "--checkpoint-minutes", "0"]
# What libraries drop in TMPDIR whatever the input: torch's compile cache, onnxruntime's
# telemetry session id. Anything else left there is a step's own leftover.
_LIBRARY_TMP = ("torchinductor_", ".ses")


# ---- running cases -------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    command: list[str]
    home: Path                                   # this case's own directory under tmp_path
    needles: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    output: Path | None = None                   # nothing may be published there on a refusal
    status: int | None = 2                       # None: 0 or 2 are both acceptable
    timeout: float = 60
    max_seconds: float | None = None             # a refusal that must come quickly
    leftovers: tuple[Path, ...] = ()             # paths that must not exist afterwards
    check: Callable[[subprocess.CompletedProcess], None] | None = None


def _step(module: str, *args) -> list[str]:
    return [sys.executable, "-m", f"steps.{module}", *map(str, args)]


def _download_case(name: str, home: Path, source: str, *extra: str, **kw) -> Case:
    raw = home / "raw"
    return Case(name, _step("download", "--source", source, "--raw", raw, "--no-progress",
                            *extra), home, output=raw,
                leftovers=(home / ".raw.download",), **kw)


def _preprocess_case(name: str, home: Path, raw: Path, *extra: str, **kw) -> Case:
    out = home / "dataset"
    return Case(name, _step("preprocess", "--raw", raw, "--dataset", out, "--workers", "1",
                            "--patch-size", "32x32", *extra), home, output=out, **kw)


def _train_case(name: str, home: Path, dataset: Path, *extra: str, **kw) -> Case:
    model = home / "model"
    return Case(name, _step("train", "--dataset", dataset, "--model", model, *TINY_TRAIN,
                            *extra), home, output=model, **kw)


def _env(case: Case) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "UNET_MAX_"))}
    scratch = case.home / ".tmp"
    scratch.mkdir(parents=True, exist_ok=True)
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TMPDIR=str(scratch))
    env.update(case.env)
    return env


def _run(case: Case):
    start = time.monotonic()
    try:
        done = subprocess.run(case.command, cwd=REPO, env=_env(case), capture_output=True,
                              text=True, timeout=case.timeout)
    except subprocess.TimeoutExpired as exc:
        done = exc
    return case, done, time.monotonic() - start


def _published(path: Path) -> list[str]:
    if not path.exists():
        return []
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*"))


def _verify(case: Case, done, seconds: float) -> str | None:
    try:
        if isinstance(done, subprocess.TimeoutExpired):
            raise AssertionError(f"still running after {case.timeout:.0f} s (killed)")
        if case.status is not None:
            assert done.returncode == case.status, f"exit {done.returncode}"
        else:
            assert done.returncode in (0, 2), f"exit {done.returncode}"
        if done.returncode == 2:
            assert_one_error_line(done.stderr, *case.needles)
            if case.output is not None:
                assert not _published(case.output), \
                    f"something was published: {_published(case.output)[:5]}"
        else:
            assert "Traceback" not in done.stderr
        if case.max_seconds is not None:
            assert seconds <= case.max_seconds, \
                f"took {seconds:.1f} s, more than {case.max_seconds:.0f} s"
        for path in case.leftovers:
            assert not path.exists(), f"{path} was left behind: {_published(path)[:5]}"
        scratch = case.home / ".tmp"
        left = [p for p in _published(scratch) if not p.startswith(_LIBRARY_TMP)]
        assert not left, f"left in TMPDIR: {left[:5]}"
        if case.check is not None:
            case.check(done)
    except AssertionError as exc:
        stderr = done.stderr if isinstance(done.stderr, str) else (
            done.stderr or b"").decode(errors="replace")
        return f"{case.name}: {exc}\n    stderr: {stderr[-1500:]!r}"
    return None


def _repo_entries() -> set[str]:
    """Top-level entries of the working directory that a step could have left there: tools'
    dot-directories (.pytest_cache, .hypothesis, ...) of concurrent runs are not counted, a
    download cache (``.<name>.download``) is."""
    return {name for name in os.listdir(REPO)
            if name != "__pycache__" and (not name.startswith(".")
                                          or name.endswith(".download"))}


def run_cases(cases: list[Case], workers: int = 2) -> list[tuple]:
    """Run ``cases`` in parallel; fail with every broken expectation at once."""
    assert len({c.name for c in cases}) == len(cases)
    before = _repo_entries()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(_run, cases))
    stray = sorted(_repo_entries() - before)
    for name in stray:   # clean up what a hostile URI made in the repository (e.g. 'file:')
        if ":" in name:
            shutil.rmtree(REPO / name, ignore_errors=True)
    failures = [f for f in (_verify(*r) for r in results) if f]
    for case, done, seconds in results:
        tail = "TIMEOUT" if isinstance(done, subprocess.TimeoutExpired) else \
            f"exit {done.returncode}: " + ((done.stderr.strip().splitlines() or [""])[-1])[:110]
        print(f"  {case.name:42s} {seconds:5.1f} s  {tail!r}")
    if stray:
        failures.append(f"new entries in the working directory {REPO}: {stray}")
    assert not failures, "\n\n".join(failures)
    return results


# ---- data builders -------------------------------------------------------------------------
def _task(root: Path, cases: int = 2, test: int = 1) -> Path:
    return synthetic.write_msd_task(root, cases=cases, shape=SHAPE, seed=1, test_cases=test)


def _listed(task: Path) -> set[str]:
    """TASK-relative paths of dataset.json and every file it lists."""
    meta = json.loads((task / "dataset.json").read_text())
    paths = {e[k] for e in meta["training"] for k in ("image", "label")}
    paths |= {e if isinstance(e, str) else e["image"] for e in meta.get("test", [])}
    return {f"{TASK}/{Path(p).as_posix().removeprefix('./')}" for p in paths} | \
        {f"{TASK}/dataset.json"}


def _only_listed(raw: Path, task: Path) -> Callable:
    """A check: the published raw artifact holds exactly the listed files, no link."""
    def check(_done) -> None:
        files = {p.relative_to(raw).as_posix() for p in raw.rglob("*")
                 if p.is_file() or p.is_symlink()}
        assert files == _listed(task) | {MANIFEST}, \
            f"published beyond the listed files: {sorted(files - _listed(task) - {MANIFEST})}"
        assert not [p for p in raw.rglob("*") if p.is_symlink()], "a link was published"
        require(raw, "raw")
    return check


def _replace(path: Path, data: bytes) -> None:
    path.unlink()
    path.write_bytes(data)


def _nifti_bytes(data: np.ndarray, affine: np.ndarray, endianness: str | None = None) -> bytes:
    header = nib.Nifti1Header(endianness=endianness) if endianness else None
    if endianness:
        data = data.astype(data.dtype.newbyteorder(endianness))
    return nib.Nifti1Image(data, affine, header=header).to_bytes()


def _edit_header(raw_bytes: bytes, **fields) -> bytes:
    """The single-file NIfTI ``raw_bytes`` with header fields overwritten, unchecked."""
    header = nib.Nifti1Header.from_fileobj(io.BytesIO(raw_bytes))
    for key, value in fields.items():
        header[key] = value
    return header.binaryblock + raw_bytes[348:]


def _raw_with(home: Path, image: bytes | None = None, label: bytes | None = None,
              compress: bool = True) -> Path:
    """A valid 5-case raw artifact whose VICTIM image and/or label files are replaced."""
    root = home / "raw"
    task = make_raw(root, small_cases(5, SHAPE))
    for sub, data in (("imagesTr", image), ("labelsTr", label)):
        if data is not None:
            _replace(task / sub / f"{VICTIM}.nii.gz",
                     gzip.compress(data, compresslevel=1) if compress else data)
    write_manifest(root, "raw", "download", {})
    return root


def _victim() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    image, label, affine, _ = small_cases(5, SHAPE)[VICTIM]
    return image, label, affine


def _sparse_member(name: str, body: bytes, realsize: int) -> bytes:
    """A GNU sparse ('S') tar member by hand: ``body`` stored, ``realsize`` claimed."""
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mode = tarfile.GNUTYPE_SPARSE, len(body), 0o644
    block = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    assert len(block) == 512
    block[386:398] = b"%011o\0" % 0               # sparse[0].offset
    block[398:410] = b"%011o\0" % len(body)       # sparse[0].numbytes
    block[482] = 0                                # isextended
    block[483:495] = b"%011o\0" % realsize        # realsize
    block[148:156] = b" " * 8
    block[148:155] = b"%06o\0" % sum(block)
    return bytes(block) + body + b"\0" * (-len(body) % 512)


def _tar_of(task: Path, path: Path) -> Path:
    with tarfile.open(path, "w") as tar:
        tar.add(task, arcname=TASK)
    return path


# ---- shared dataset --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A valid 5-case dataset artifact (32x32x16, patch 32x32) from the real steps."""
    return make_dataset(tmp_path_factory.mktemp("hostile-data"), cases=5, shape="32x32x16",
                        seed=3, patch="32x32")


def _dataset_copy(dataset: Path, home: Path) -> tuple[Path, dict, str]:
    """A copy of ``dataset`` under ``home``, its dataset.json, and a fold-0 training case."""
    copy = home / "dataset"
    shutil.copytree(dataset, copy)
    meta = json.loads((copy / "dataset.json").read_text())
    return copy, meta, meta["folds"][0]["train"][0]


def _save(copy: Path, meta: dict) -> None:
    (copy / "dataset.json").write_text(json.dumps(meta, indent=1) + "\n")
    write_manifest(copy, "dataset", "preprocess", {})


# ---- 1-4: file:// directory sources ------------------------------------------------------------
def test_unlisted_links_in_a_directory_source_are_not_copied(tmp_path):
    """imagesTr/notes.txt -> /etc/passwd and imagesTr/ssl -> /etc/ssl are not in dataset.json:
    the download succeeds and publishes the listed files only."""
    cases = []
    for name, link, target in (("file link to /etc/passwd", "notes.txt", "/etc/passwd"),
                               ("directory link to /etc/ssl", "ssl", "/etc/ssl")):
        home = tmp_path / link.replace(".", "_")
        task = _task(home / "src")
        (task / "imagesTr" / link).symlink_to(target)
        case = _download_case(name, home, f"file://{task}", status=0)
        case.check = _only_listed(case.output, task)
        cases.append(case)
    run_cases(cases)
    passwd = Path("/etc/passwd").read_bytes().splitlines()[0]
    for case in cases:
        for path in case.output.rglob("*"):
            assert not path.is_file() or passwd not in path.read_bytes(), path


def test_listed_file_linked_outside_the_source_is_refused(tmp_path):
    task = _task(tmp_path / "src")
    outside = tmp_path / "outside" / "BRATS_001.nii.gz"
    outside.parent.mkdir()
    listed = task / "imagesTr" / "BRATS_001.nii.gz"
    shutil.copyfile(listed, outside)
    listed.unlink()
    listed.symlink_to(outside)
    run_cases([_download_case("listed image -> outside the source", tmp_path,
                              f"file://{task}", needles=("imagesTr/BRATS_001.nii.gz",))])


def test_directory_links_to_parent_do_not_loop(tmp_path):
    task = _task(tmp_path / "src")
    (task / "loop1").symlink_to("..")
    (task / "imagesTr" / "loop2").symlink_to("..")
    case = _download_case("two links to ..", tmp_path, f"file://{task}", status=0,
                          timeout=60, max_seconds=45)
    case.check = _only_listed(case.output, task)
    run_cases([case])


def test_listed_fifo_is_refused_without_blocking(tmp_path):
    task = _task(tmp_path / "src")
    listed = task / "imagesTr" / "BRATS_001.nii.gz"
    listed.unlink()
    os.mkfifo(listed)
    run_cases([_download_case("listed image is a FIFO", tmp_path, f"file://{task}",
                              needles=("imagesTr/BRATS_001.nii.gz",), timeout=60,
                              max_seconds=45)])


# ---- 5-7: dataset artifacts that point outside themselves or hold NaN -----------------------
def test_dataset_case_path_outside_the_artifact_is_refused(dataset, tmp_path):
    cases = []
    for label, absolute in (("absolute", True), ("dotdot", False)):
        home = tmp_path / label
        copy, meta, victim = _dataset_copy(dataset, home)
        entry = next(c for c in meta["cases"] if c["name"] == victim)
        outside = home / "outside" / f"{victim}_image.npy"
        outside.parent.mkdir()
        shutil.move(copy / entry["image"], outside)
        entry["image"] = str(outside) if absolute else f"../outside/{outside.name}"
        _save(copy, meta)
        cases.append(_train_case(f"case image path {label}", home, copy,
                                 needles=(f"outside/{outside.name}",), timeout=120))
    run_cases(cases)


def test_manifest_path_outside_the_artifact_is_refused(dataset, tmp_path):
    cases = []
    for label, absolute in (("dotdot", False), ("absolute", True)):
        home = tmp_path / label
        copy, _, _ = _dataset_copy(dataset, home)
        outside = home / "outside.txt"
        outside.write_bytes(b"not part of the artifact\n")
        listed = str(outside) if absolute else "../outside.txt"
        manifest = json.loads((copy / MANIFEST).read_text())
        manifest["files"].append({"path": listed, "size": outside.stat().st_size,
                                  "sha256": hashlib.sha256(outside.read_bytes()).hexdigest()})
        (copy / MANIFEST).write_text(json.dumps(manifest, indent=1))
        cases.append(Case(f"MANIFEST lists {label} path", _step(
            "handoff", "verify", "--artifact", "dataset", copy), home, needles=(listed,)))
    run_cases(cases)


def test_nan_case_in_the_dataset_is_refused(dataset, tmp_path):
    copy, meta, victim = _dataset_copy(dataset, tmp_path)
    path = copy / next(c for c in meta["cases"] if c["name"] == victim)["image"]
    image = np.load(path)
    np.save(path, np.full(image.shape, np.nan, dtype=image.dtype))
    _save(copy, meta)
    run_cases([_train_case("all-NaN image", tmp_path, copy, needles=(victim,), timeout=120)])


def test_dataset_that_would_validate_on_training_data_is_refused(dataset, tmp_path):
    """A one-case dataset has no fold to train on, and a fold whose validation cases are
    also training cases would report a validation Dice measured on training data."""
    cases = []
    home = tmp_path / "one"
    copy, meta, victim = _dataset_copy(dataset, home)
    meta["cases"] = [c for c in meta["cases"] if c["name"] == victim]
    meta["folds"] = [{"train": [], "val": [victim]}]
    _save(copy, meta)
    cases.append(_train_case("one-case dataset", home, copy,
                             needles=("--fold 0", "0 training and 1 validation"), timeout=120))
    home = tmp_path / "shared"
    copy, meta, victim = _dataset_copy(dataset, home)
    meta["folds"][0]["val"].append(victim)
    _save(copy, meta)
    cases.append(_train_case("fold validates on a training case", home, copy,
                             needles=("fold 0", victim), timeout=120))
    run_cases(cases)


# ---- 8, 18: train's URIs and batch size -------------------------------------------------------
def test_checkpoint_and_resume_uris(dataset, tmp_path):
    ck = tmp_path / "file" / "ck"

    def file_uri_result(done) -> None:
        if done.returncode == 0:
            assert any(ck.glob("ckpt-*.pt")), f"file:// accepted but {ck} holds no checkpoint"
        else:
            assert "file://" in error_lines(done.stderr)[0]

    cases = [
        _train_case("--checkpoint-uri file://", tmp_path / "file", dataset,
                    "--checkpoint-uri", f"file://{ck}", status=None, timeout=180,
                    check=file_uri_result),
        _train_case("--checkpoint-uri ftp://", tmp_path / "ftp", dataset,
                    "--checkpoint-uri", "ftp://x/y", needles=("ftp",), timeout=120),
        _train_case("--resume-from gs://", tmp_path / "gs", dataset,
                    "--resume-from", "gs://b/k", needles=("gs",), timeout=120),
    ]
    run_cases(cases, workers=3)
    assert not (REPO / "file:").exists()


def test_huge_batch_size_is_refused_before_allocating(dataset, tmp_path):
    run_cases([_train_case("--batch-size 10000000", tmp_path, dataset,
                           "--batch-size", "10000000", needles=("--batch-size",),
                           timeout=120, max_seconds=60)])


# ---- 9-12: NIfTI volumes ------------------------------------------------------------------------
def test_nifti_gzip_bombs_are_refused(tmp_path):
    image, _, affine = _victim()
    good = _nifti_bytes(image, affine)
    huge = _edit_header(good, dim=[3, 4000, 4000, 4000, 1, 1, 1, 1])
    huge = huge[:352 + 4096]                      # a small body
    cases = [
        _preprocess_case("64 MiB after the voxel data", tmp_path / "trailing",
                         _raw_with(tmp_path / "trailing", image=good + bytes(64 << 20)),
                         needles=(VICTIM,), timeout=120),
        _preprocess_case("header declares 4000^3 voxels", tmp_path / "huge",
                         _raw_with(tmp_path / "huge", image=huge), needles=(VICTIM,),
                         timeout=60, max_seconds=30),
        _preprocess_case("1.6 MB that inflates to 1.5 GiB", tmp_path / "bomb",
                         _raw_with(tmp_path / "bomb", image=_inflating_bomb(good),
                                   compress=False),
                         needles=(VICTIM, "max_volume_bytes"), timeout=60, max_seconds=30),
    ]
    run_cases(cases)


def _inflating_bomb(good: bytes) -> bytes:
    """The issue's example: a .nii.gz of about 1.6 MB whose header honestly declares
    1024x1024x96x4 float32 voxels (1.5 GiB), all zeros."""
    header = _edit_header(good, dim=[4, 1024, 1024, 96, 4, 1, 1, 1])[:352]
    pack = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts, zeros = [pack.compress(header)], bytes(64 << 20)
    for _ in range(24):
        parts.append(pack.compress(zeros))
    parts.append(pack.flush())
    return b"".join(parts)


def test_nifti_headers_with_bad_fields_are_refused(tmp_path):
    image, _, affine = _victim()
    good = _nifti_bytes(image, affine)
    zero_srow = np.zeros(4, dtype=np.float32)
    nan_srow = np.array([np.nan, 0, 0, 0], dtype=np.float32)
    rgb = np.zeros(image.shape, dtype=[("R", "u1"), ("G", "u1"), ("B", "u1")])
    rgb["R"] = np.clip(image, 0, 255).astype(np.uint8)
    variants = {
        "a dim of 0": _edit_header(good, dim=[4, 32, 32, 0, 4, 1, 1, 1]),
        "dims overflow int64": _edit_header(good, dim=[7] + [32767] * 7),
        "NaN pixdim": _edit_header(good, pixdim=[1, np.nan, 1, 1, 1, 1, 1, 1]),
        "all-zero affine": _edit_header(good, sform_code=1, qform_code=0, srow_x=zero_srow,
                                        srow_y=zero_srow, srow_z=zero_srow),
        "NaN in the sform": _edit_header(good, sform_code=1, qform_code=0, srow_x=nan_srow),
        "complex64 voxels": _nifti_bytes(image.astype(np.complex64), affine),
        "RGB24 voxels": _nifti_bytes(rgb, affine),
    }
    cases = [_preprocess_case(name, tmp_path / f"h{i}",
                              _raw_with(tmp_path / f"h{i}", image=data), needles=(VICTIM,))
             for i, (name, data) in enumerate(variants.items())]
    run_cases(cases)


@pytest.mark.parametrize("mode", ["anchor", "default"])
def test_big_endian_volume_gives_the_same_dataset(tmp_path, mode):
    image, label, affine = _victim()
    little = _raw_with(tmp_path / "little")
    big = _raw_with(tmp_path / "big", image=_nifti_bytes(image, affine, ">"),
                    label=_nifti_bytes(label, affine, ">"))
    cases = [_preprocess_case(f"{name}-endian {mode}", tmp_path / name, raw, "--mode", mode,
                              status=0, timeout=120)
             for name, raw in (("little", little), ("big", big))]
    run_cases(cases)
    for kind in ("image", "label"):
        a, b = (np.load(tmp_path / name / "dataset" / "cases" / f"{VICTIM}_{kind}.npy")
                for name in ("little", "big"))
        assert a.shape == b.shape and a.dtype == b.dtype, kind
        assert np.allclose(a.astype(np.float32), b.astype(np.float32)), kind


def test_label_with_another_affine_is_refused(tmp_path):
    _, label, affine = _victim()
    shifted = affine.copy()
    shifted[0, 3] += 10.0                          # 10 mm along x
    flipped = affine.copy()
    flipped[1, 1] = -flipped[1, 1]                 # y axis reversed
    cases = [_preprocess_case(f"label affine {name}", tmp_path / name,
                              _raw_with(tmp_path / name, label=_nifti_bytes(label, other)),
                              needles=(VICTIM,))
             for name, other in (("translated", shifted), ("flipped", flipped))]
    run_cases(cases)


# ---- 13-14: tar archives --------------------------------------------------------------------------
def test_sparse_tar_member_is_refused(tmp_path):
    """A GNU sparse member that stores 512 bytes and inflates to 2 GiB, before a valid task."""
    name = f"{TASK}/imagesTr/BRATS_900.nii.gz"
    good = _tar_of(_task(tmp_path / "src"), tmp_path / "good.tar")
    archive = tmp_path / "sparse.tar"
    archive.write_bytes(_sparse_member(name, b"\1" * 512, 2 * GiB) + good.read_bytes())
    run_cases([_download_case("sparse member claiming 2 GiB", tmp_path / "run",
                              f"file://{archive}", needles=(name,), timeout=120,
                              max_seconds=30)])


def test_tar_over_the_limits_is_refused(tmp_path):
    task = _task(tmp_path / "src")
    plain = _tar_of(task, tmp_path / "plain.tar")
    extra = tmp_path / "many" / TASK
    shutil.copytree(task, extra)
    for i in range(60):
        (extra / "imagesTs" / f"note{i:02d}.txt").write_text("x")
    many = _tar_of(extra, tmp_path / "many.tar")
    table = [
        ("over max_members", many, {"UNET_MAX_MEMBERS": "50"}, "max_members"),
        ("over max_member_bytes", plain, {"UNET_MAX_MEMBER_BYTES": "1000"}, "max_member_bytes"),
        ("over max_extract_bytes", plain, {"UNET_MAX_EXTRACT_BYTES": "50000"},
         "max_extract_bytes"),
    ]
    run_cases([_download_case(name, tmp_path / f"t{i}", f"file://{archive}", env=env,
                              needles=(needle,))
               for i, (name, archive, env, needle) in enumerate(table)], workers=3)


# ---- 15: synthetic sources --------------------------------------------------------------------------
def test_synthetic_source_over_the_limits_is_refused(tmp_path):
    def names_shape_or_limit(done) -> None:
        line = error_lines(done.stderr)[0]
        assert "shape" in line or "max_" in line, line

    run_cases([
        _download_case("cases=100000000", tmp_path / "cases",
                       "synthetic://?cases=100000000", needles=("cases",), timeout=30,
                       max_seconds=20),
        _download_case("shape=5000x5000x5000", tmp_path / "shape",
                       "synthetic://?cases=2&shape=5000x5000x5000", timeout=30, max_seconds=20,
                       check=names_shape_or_limit),
    ])


# ---- 16-17: HTTP sources ---------------------------------------------------------------------------
class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files: dict[str, bytes] = {}
        self.stop = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"          # a body without Content-Length ends at close
    ENDLESS_CAP = 256 << 20                # 'forever' for a 1 MB limit, and the disk survives

    def log_message(self, *args):
        pass

    def do_GET(self):
        server: _Server = self.server       # type: ignore[assignment]
        path = self.path.split("?", 1)[0]
        try:
            if path.startswith("/endless/"):
                self._body(None, self.ENDLESS_CAP, pause_after=None)
            elif path.startswith("/huge/"):
                self._body(10_000_000, 10_000_000, pause_after=1000)
            elif path in server.files:
                self._body(len(server.files[path]), None, data=server.files[path])
            else:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
        except (BrokenPipeError, ConnectionResetError):
            pass                               # the client gave up: what a refusal looks like

    def _body(self, length: int | None, total: int | None, pause_after: int | None = None,
              data: bytes | None = None) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()
        if data is not None:
            self.wfile.write(data)
            return
        chunk, sent = b"\0" * 65536, 0
        while sent < total and not self.server.stop.is_set():   # type: ignore[attr-defined]
            if pause_after is not None and sent >= pause_after:
                self.server.stop.wait(20)                       # type: ignore[attr-defined]
                pause_after = None
            piece = chunk if pause_after is None else chunk[:pause_after - sent]
            piece = piece[:total - sent]
            self.wfile.write(piece)
            sent += len(piece)


@pytest.fixture
def server():
    srv = _Server()
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield srv
    srv.stop.set()
    srv.shutdown()
    srv.server_close()


def test_http_body_over_max_download_bytes_is_refused(tmp_path, server):
    limit = {"UNET_MAX_DOWNLOAD_BYTES": "1000000"}
    run_cases([
        _download_case("body that never ends", tmp_path / "endless",
                       f"{server.url}/endless/Task01_BrainTumour.tar", "--md5", "", env=limit,
                       needles=("max_download_bytes",), timeout=60, max_seconds=30),
        _download_case("Content-Length over the limit", tmp_path / "huge",
                       f"{server.url}/huge/big.tar", env=limit,
                       needles=("max_download_bytes",), timeout=60, max_seconds=15),
    ])
    for run in ("endless", "huge"):
        beside = sorted(set(os.listdir(tmp_path / run)) - {"raw", ".tmp"})
        assert not beside, f"left beside the output directory: {beside}"


def test_failed_download_is_not_reused_from_the_cache(tmp_path, server):
    path = "/data/Task01_BrainTumour.tar"
    server.files[path] = b"this is not a tar archive\n" * 4000
    cache = tmp_path / "cache"
    args = (f"{server.url}{path}", "--md5", "", "--cache-dir", str(cache))
    run_cases([_download_case("garbage download", tmp_path, *args,
                              needles=("Task01_BrainTumour.tar",))])
    good = tmp_path / "good" / "Task01_BrainTumour.tar"
    synthetic.write_msd_tar(good, cases=2, shape=SHAPE, seed=4, test_cases=1)
    server.files[path] = good.read_bytes()
    case = _download_case("same URI and cache, now a valid tar", tmp_path, *args, status=0)
    case.check = lambda done: require(tmp_path / "raw", "raw")
    run_cases([case])


# ---- 19: an output path that cannot exist ------------------------------------------------------------
def test_raw_under_proc_is_refused(tmp_path):
    raw = Path("/proc/unet-test/raw")
    case = Case("--raw under /proc", _step("download", "--source",
                                           "synthetic://?cases=2&shape=32x32x16", "--raw", raw,
                                           "--no-progress"),
                tmp_path, needles=(str(raw),), output=raw,
                leftovers=(raw, raw.parent / ".raw.download"))
    run_cases([case])


def test_predict_out_under_proc_is_refused(tmp_path):
    onnx_file = _foreign_onnx(tmp_path / "model.onnx", len(synthetic.LABELS))
    case = synthetic.generate_case(SHAPE, seed=1, index=1)
    image = tmp_path / "CASE.nii.gz"
    nib.save(nib.Nifti1Image(case.image, case.affine), image)
    out = Path("/proc/unet-test/OUT.nii.gz")
    run_cases([Case("predict --out under /proc",
                    _step("convert", "predict", "--onnx", onnx_file, "--image", image,
                          "--out", out), tmp_path, needles=("--out", str(out)),
                    leftovers=(out.parent,))])


# ---- 20: a foreign ONNX model ---------------------------------------------------------------------------
def _foreign_onnx(path: Path, classes: int) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from steps.convert import onnx_metadata

    weight = np.random.default_rng(0).standard_normal((classes, 4, 1, 1)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["image", "W"], ["logits"])], "foreign",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 4, "H", "W"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes, "H", "W"])],
        [numpy_helper.from_array(weight, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    contract = {"channels": list(synthetic.MODALITIES.values()), "mode": "default",
                "size_multiple": 8, "normalisation": {"method": "zscore"}}
    for key, value in sorted(onnx_metadata(contract, dict(synthetic.LABELS)).items()):
        model.metadata_props.add(key=key, value=value)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def test_foreign_onnx_with_300_classes_is_refused(tmp_path):
    onnx_file = _foreign_onnx(tmp_path / "foreign.onnx", 300)
    case = synthetic.generate_case(SHAPE, seed=1, index=1)
    image = tmp_path / "CASE.nii.gz"
    nib.save(nib.Nifti1Image(case.image, case.affine), image)
    out = tmp_path / "out" / "OUT.nii.gz"
    run_cases([Case("ONNX with 300 output classes",
                    _step("convert", "predict", "--onnx", onnx_file, "--image", image,
                          "--out", out), tmp_path, needles=("300",), output=out.parent,
                    leftovers=(out,))])


# ---- 21: control characters in what an error line quotes --------------------------------------------
def test_control_characters_do_not_reach_the_terminal(tmp_path):
    def no_control_characters(done) -> None:
        bad = sorted({repr(c) for c in done.stderr if (ord(c) < 32 and c != "\n")
                      or 127 <= ord(c) < 160})
        assert not bad, f"raw control characters on stderr: {bad}"
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr

    table = {"ESC sequence": "\x1b[31m", "newline": "\n", "carriage return": "\r",
             "bell": "\x07"}
    run_cases([_download_case(f"{name} in a file:// path", tmp_path / f"c{i}",
                              f"file://{tmp_path}/bad{ctrl}name.tar",
                              needles=("bad", "name.tar"), check=no_control_characters)
               for i, (name, ctrl) in enumerate(table.items())], workers=2)
