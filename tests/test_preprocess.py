"""The preprocess step: raw MSD NIfTI → dataset artifact.

Outputs are checked against independent re-computations: nibabel's own ``get_fdata`` and
``as_closest_canonical`` for the default mode, MONAI's ``CropForegroundd`` and
``NormalizeIntensity`` plus the anchors' pad and centre crop for ``--mode anchor``.
"""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from steps import bykey, limits, nifti, storage
from steps import preprocess as preprocess_step
from steps.artifacts import MANIFEST, write_manifest
from steps.dataset import open_cases, read_metadata
from steps.errors import run_main
from steps.preprocess import main
from steps.synthetic import generate_case, write_msd_task

REPO = Path(__file__).resolve().parents[1]
SHAPE = (48, 48, 24)
PATCH = (32, 32)  # smaller than the crop along one axis, larger along the other


# ----------------------------------------------------------------------------- helpers

def make_raw(root: Path, cases: dict[str, tuple], modalities: int = 4) -> Path:
    """An MSD task under ``root`` from {name: (image, label, affine, slope)} plus its manifest."""
    task = root / "Task01_BrainTumour"
    for sub in ("imagesTr", "labelsTr"):
        (task / sub).mkdir(parents=True)
    for name, (image, label, affine, slope) in cases.items():
        img = nib.Nifti1Image(image, affine)
        if slope is not None:
            img.header.set_slope_inter(slope, 0.0)
        nib.save(img, task / "imagesTr" / f"{name}.nii.gz")
        nib.save(nib.Nifti1Image(label, affine), task / "labelsTr" / f"{name}.nii.gz")
    spec = {
        "name": "BRATS",
        "modality": {str(i): ["FLAIR", "T1w", "t1gd", "T2w"][i] for i in range(modalities)},
        "labels": {"0": "background", "1": "edema", "2": "non-enhancing tumor",
                   "3": "enhancing tumour"},
        "training": [{"image": f"./imagesTr/{n}.nii.gz", "label": f"./labelsTr/{n}.nii.gz"}
                     for n in cases],
    }
    (task / "dataset.json").write_text(json.dumps(spec))
    write_manifest(root, "raw", "download", {})
    return task


def small_cases(n: int = 5, shape=(24, 24, 12)) -> dict[str, tuple]:
    cases = {}
    for i in range(1, n + 1):
        case = generate_case(shape, seed=7, index=i)
        cases[f"BRATS_{i:03d}"] = (case.image, case.label, case.affine, None)
    return cases


def run_cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "steps.preprocess", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def pair(task: Path, name: str) -> tuple[Path, Path]:
    return task / "imagesTr" / f"{name}.nii.gz", task / "labelsTr" / f"{name}.nii.gz"


def crop_box(image_cdhw: np.ndarray, positive: bool = False) -> list[tuple[int, int]]:
    fg = (image_cdhw > 0 if positive else image_cdhw != 0).any(axis=0)
    coords = np.argwhere(fg)
    return list(zip(coords.min(axis=0).tolist(), (coords.max(axis=0) + 1).tolist()))


def reference_default(image_path: Path, label_path: Path, patch) -> tuple:
    """Default mode recomputed with nibabel: canonical order, crop, z-score, background pad."""
    img = nib.as_closest_canonical(nib.load(image_path))
    lab = nib.as_closest_canonical(nib.load(label_path))
    x = img.get_fdata().astype(np.float32)
    if x.ndim == 3:
        x = x[..., None]
    x = x.transpose(3, 2, 1, 0)
    y = lab.get_fdata().astype(np.uint8).transpose(2, 1, 0)
    box = crop_box(x)
    sl = tuple(slice(a, b) for a, b in box)
    x, y = x[(slice(None),) + sl], y[sl]
    mean = x.astype(np.float64).mean(axis=(1, 2, 3))
    std = x.astype(np.float64).std(axis=(1, 2, 3))
    pads = []
    for size, want in zip(x.shape[2:], patch):
        extra = max(want - size, 0)
        pads.append((extra // 2, extra - extra // 2))
    z = np.stack([np.pad(((c - m) / s).astype(np.float32), [(0, 0)] + pads,
                         constant_values=np.float32(-m / s))
                  for c, m, s in zip(x, mean, std)])
    y = np.pad(y, [(0, 0)] + pads)
    spacing = list(img.header.get_zooms()[:3])[::-1]
    return z, y, box, mean, std, spacing


def reference_anchor(image_path: Path, label_path: Path, patch) -> tuple:
    """The anchors' pipeline: MONAI crop and z-score, then their pad and centre crop."""
    from monai.transforms import CropForegroundd, NormalizeIntensity
    x = nib.load(image_path).get_fdata().astype(np.float32).transpose(3, 2, 1, 0)
    y = nib.load(label_path).get_fdata().astype(np.uint8)[None].transpose(0, 3, 2, 1)
    data = CropForegroundd(keys=["image", "label"], source_key="image")({"image": x, "label": y})
    x = np.asarray(NormalizeIntensity(nonzero=False, channel_wise=True)(data["image"]))
    y = np.asarray(data["label"])
    pads = [(0, 0), (0, 0)]
    for size, want in zip(x.shape[2:], patch):
        extra = max(want - size, 0) / 2
        pads.append((int(np.floor(extra)), int(np.ceil(extra))))
    x, y = np.pad(x, pads), np.pad(y, pads)
    h0 = (x.shape[2] - patch[0]) // 2
    w0 = (x.shape[3] - patch[1]) // 2
    window = (slice(None), slice(None), slice(h0, h0 + patch[0]), slice(w0, w0 + patch[1]))
    return x[window], y[window][0]


def all_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert result.stderr.rstrip().endswith(errors[0])
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("raw")
    write_msd_task(root, cases=6, shape=SHAPE, seed=1)
    write_manifest(root, "raw", "download", {})
    return root


def preprocess(raw: Path, out: Path, *extra: str) -> dict:
    patch = f"{PATCH[0]}x{PATCH[1]}"
    assert main(["--raw", str(raw), "--dataset", str(out), "--patch-size", patch, *extra]) == 0
    return read_metadata(out)


@pytest.fixture(scope="module")
def default_out(raw, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ds") / "default"
    preprocess(raw, out)
    return out


# ----------------------------------------------------------------------------- format

def test_output_format_and_values(raw, default_out):
    from sklearn.model_selection import KFold
    meta = read_metadata(default_out)
    task = raw / "Task01_BrainTumour"
    names = sorted(p.name[: -len(".nii.gz")] for p in (task / "imagesTr").iterdir())
    assert [c["name"] for c in meta["cases"]] == names
    assert meta["channels"] == ["FLAIR", "T1w", "t1gd", "T2w"]
    assert meta["labels"]["3"] == "enhancing tumour"
    assert meta["patch_size"] == list(PATCH)
    assert (meta["image_dtype"], meta["label_dtype"]) == ("float16", "uint8")
    assert meta["mode"] == "default"
    assert meta["normalisation"]["nonzero"] is False
    assert "population std" in meta["normalisation"]["statistics"]
    anchors_split = KFold(5, shuffle=True, random_state=12345).split(names)
    for fold, (train, val) in zip(meta["folds"], anchors_split):
        assert fold["val"] == [names[i] for i in val]
        assert fold["train"] == [names[i] for i in train]

    for case, entry in zip(open_cases(default_out, meta), meta["cases"]):
        assert case.image.dtype == np.float16 and case.label.dtype == np.uint8
        assert list(case.image.shape) == entry["shape"] and case.label.shape == case.image.shape[1:]
        assert min(case.image.shape[2:]) >= min(PATCH)
        z, y, box, mean, std, spacing = reference_default(*pair(task, case.name), PATCH)
        assert [tuple(b) for b in entry["crop"]] == box
        assert entry["spacing"] == spacing == [1.0, 1.0, 1.0]
        np.testing.assert_allclose(entry["mean"], mean, rtol=1e-9)
        np.testing.assert_allclose(entry["std"], std, rtol=1e-9)
        assert np.abs(case.image.astype(np.float32) - z).max() <= 2e-3
        np.testing.assert_array_equal(case.label, y)
        # z-score over the crop (the window minus its padding): mean 0, std 1 per channel
        (h0, _), (w0, _) = entry["window"]
        hs = slice(-h0, -h0 + box[1][1] - box[1][0])
        ws = slice(-w0, -w0 + box[2][1] - box[2][0])
        inner = case.image[:, :, hs, ws].astype(np.float64)
        np.testing.assert_allclose(inner.mean(axis=(1, 2, 3)), 0, atol=1e-3)
        np.testing.assert_allclose(inner.std(axis=(1, 2, 3)), 1, atol=1e-3)
        # no tumour voxel is lost by the foreground crop
        source = nib.load(task / "labelsTr" / f"{case.name}.nii.gz").get_fdata()
        for value in (1, 2, 3):
            assert np.count_nonzero(case.label == value) == np.count_nonzero(source == value)


def test_float16_error_is_measured_and_bounded(raw, default_out, tmp_path):
    meta16 = read_metadata(default_out)
    meta32 = preprocess(raw, tmp_path / "f32", "--image-dtype", "float32")
    assert meta32["image_dtype"] == "float32"
    assert meta32["normalisation"]["image_dtype_error"]["max_abs"] == 0.0
    worst = 0.0
    for c16, c32 in zip(open_cases(default_out, meta16), open_cases(tmp_path / "f32", meta32)):
        assert c32.image.dtype == np.float32
        diff = np.abs(c16.image.astype(np.float32) - c32.image)
        assert (diff <= 2.0 ** -11 * np.abs(c32.image) + 2.0 ** -25).all()
        worst = max(worst, float(diff.max()))
        np.testing.assert_array_equal(c16.label, c32.label)
    print(f"float16 vs float32 max abs diff: {worst:.3g}")
    assert 0 < worst == meta16["normalisation"]["image_dtype_error"]["max_abs"] < 2e-3


@pytest.mark.slow  # imports torch and MONAI
def test_anchor_mode_matches_monai_pipeline(raw, tmp_path):
    meta = preprocess(raw, tmp_path / "anchor", "--mode", "anchor")
    assert (meta["mode"], meta["image_dtype"]) == ("anchor", "float32")
    task = raw / "Task01_BrainTumour"
    worst = 0.0
    for case in open_cases(tmp_path / "anchor", meta):
        x, y = reference_anchor(*pair(task, case.name), PATCH)
        assert case.image.shape == x.shape == (4, x.shape[1], *PATCH)
        worst = max(worst, float(np.abs(case.image - x).max()))
        np.testing.assert_array_equal(case.label, y)
    print(f"anchor mode vs MONAI pipeline max abs diff: {worst:.3g}")
    assert worst < 1e-5


@pytest.mark.slow
def test_output_bytes_do_not_depend_on_worker_count(raw, default_out, tmp_path):
    result = run_cli("--raw", str(raw), "--dataset", str(tmp_path / "w2"), "--workers", "2",
                     "--patch-size", f"{PATCH[0]}x{PATCH[1]}")
    assert result.returncode == 0, result.stderr
    assert "6 cases" in result.stderr.splitlines()[-1]
    one, two = all_bytes(default_out), all_bytes(tmp_path / "w2")
    assert MANIFEST in one and "dataset.json" in one
    assert one == two


# ----------------------------------------------------------------------------- real-world NIfTI

def test_real_world_storage_spacing_and_orientation(tmp_path):
    cases = small_cases(5)
    # int16 storage with scl_slope 2: values must come back scaled
    image, label, affine, _ = cases["BRATS_001"]
    cases["BRATS_001"] = (np.round(image / 2).astype(np.int16), label, affine, 2.0)
    # anisotropic spacing on a non-cubic grid
    aniso = generate_case((30, 26, 14), seed=7, index=2)
    cases["BRATS_002"] = (aniso.image, aniso.label, np.diag([0.8, 1.2, 3.0, 1.0]), None)
    # non-canonical orientation: voxel axes (x, y, z) run along world -y, +x, -z (PRI)
    turned = np.array([[0, 1.5, 0, 0], [-1.0, 0, 0, 0], [0, 0, -2.5, 0], [0, 0, 0, 1]])
    image, label, _, _ = cases["BRATS_003"]
    cases["BRATS_003"] = (image, label, turned, None)
    # float64 storage
    image, label, affine, _ = cases["BRATS_004"]
    cases["BRATS_004"] = (image.astype(np.float64), label, affine, None)
    task = make_raw(tmp_path / "raw", cases)
    meta = preprocess(tmp_path / "raw", tmp_path / "ds", "--image-dtype", "float32")
    entries = {c["name"]: c for c in meta["cases"]}
    assert entries["BRATS_003"]["source_orientation"] == "PRI"
    assert entries["BRATS_003"]["spacing"] == [2.5, 1.0, 1.5]
    assert entries["BRATS_002"]["spacing"] == pytest.approx([3.0, 1.2, 0.8])
    assert entries["BRATS_002"]["original_shape"] == [30, 26, 14]
    for case in open_cases(tmp_path / "ds", meta):
        z, y, box, _, _, spacing = reference_default(*pair(task, case.name), PATCH)
        assert entries[case.name]["spacing"] == pytest.approx(spacing)
        assert case.image.shape == z.shape, case.name
        assert np.abs(case.image - z).max() < 1e-5, case.name
        np.testing.assert_array_equal(case.label, y)


def test_single_channel_3d_images(tmp_path):
    cases = {n: (image[..., 0], label, affine, None)
             for n, (image, label, affine, _) in small_cases(5).items()}
    task = make_raw(tmp_path / "raw", cases, modalities=1)
    meta = preprocess(tmp_path / "raw", tmp_path / "ds")
    assert meta["channels"] == ["FLAIR"]
    for case in open_cases(tmp_path / "ds", meta):
        z, y, *_ = reference_default(*pair(task, case.name), PATCH)
        assert case.image.shape[0] == 1 and case.image.shape == z.shape
        assert np.abs(case.image.astype(np.float32) - z).max() < 2e-3
        np.testing.assert_array_equal(case.label, y)


# ----------------------------------------------------------------------------- bad input

def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle: middle + 64] = bytes(64)
    path.write_bytes(bytes(data))


def _set(part: str, change):
    def edit(cases: dict) -> None:
        image, label, affine, slope = cases["BRATS_003"]
        image, label = image.copy(), label.copy()
        if part == "image":
            image = change(image)
        else:
            label = change(label)
        cases["BRATS_003"] = (image, label, affine, slope)
    return edit


def _with(array: np.ndarray, value) -> np.ndarray:
    array[5, 6, 4, ...] = value
    return array


BAD_INPUTS = {
    "truncated": (None, lambda task: _truncate(task / "imagesTr/BRATS_003.nii.gz"), "truncated"),
    "corrupt": (None, lambda task: _corrupt(task / "labelsTr/BRATS_003.nii.gz"), "corrupt"),
    "shape": (_set("label", lambda a: a[:, :, :-1]), None, "does not match"),
    "channels": (_set("image", lambda a: a[..., :3]), None, "3 channels"),
    "nan": (_set("image", lambda a: _with(a, np.nan)), None, "NaN/Inf"),
    "inf": (_set("image", lambda a: _with(a, np.inf)), None, "NaN/Inf"),
    "label_value": (_set("label", lambda a: _with(a, 5)), None, "[5]"),
    "empty": (_set("image", np.zeros_like), None, "empty foreground"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_naming_the_case(kind, tmp_path):
    edit_cases, edit_files, needle = BAD_INPUTS[kind]
    cases = small_cases(5)
    if edit_cases:
        edit_cases(cases)
    task = make_raw(tmp_path / "raw", cases)
    if edit_files:
        edit_files(task)
        write_manifest(tmp_path / "raw", "raw", "download", {})
    workers = "2" if kind in ("truncated", "label_value") else "1"
    out = tmp_path / "ds"
    result = run_cli("--raw", str(tmp_path / "raw"), "--dataset", str(out), "--workers", workers)
    assert_one_line_error(result, "BRATS_003", needle)
    assert not out.exists()      # the folder the step made is gone, with anything staged in it


@pytest.mark.slow
def test_gzip_truncation_is_caught_before_numpy(tmp_path):
    # A stream cut exactly at a member boundary decompresses but lacks voxel bytes.
    cases = small_cases(5)
    task = make_raw(tmp_path / "raw", cases)
    path = task / "imagesTr/BRATS_002.nii.gz"
    data = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(data[: len(data) - 100]))
    write_manifest(tmp_path / "raw", "raw", "download", {})
    result = run_cli("--raw", str(tmp_path / "raw"), "--dataset", str(tmp_path / "ds"))
    assert_one_line_error(result, "BRATS_002", "truncated voxel data")


def test_gzip_is_read_as_zlib_reads_it_one_member_or_several(raw, tmp_path, gzip_backend):
    path = raw / "Task01_BrainTumour/imagesTr/BRATS_001.nii.gz"
    plain = zlib.decompress(path.read_bytes(), 31)
    (tmp_path / "plain.nii").write_bytes(plain)
    cut = len(plain) // 3      # the second member starts inside the voxel data
    (tmp_path / "two.nii.gz").write_bytes(gzip.compress(plain[:cut]) + gzip.compress(plain[cut:]))
    expected = nifti.load(tmp_path / "plain.nii").data
    for name in ("two.nii.gz", path):
        loaded = nifti.load(tmp_path / name).data
        assert loaded.dtype == expected.dtype and np.array_equal(loaded, expected)


def test_a_bad_gzip_checksum_is_one_line_with_each_decoder(tmp_path, gzip_backend, capsys,
                                                           monkeypatch):
    """isal raises its own IsalError, not zlib.error: a wrong CRC32 in a trailer is still the
    step's one ``error:`` line and exit 2 with either decoder. In process (one worker), so
    that the decoder forced here is the one the step uses."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)   # the step sets it; restored after
    task = make_raw(tmp_path / "raw", small_cases(2))
    path = task / "imagesTr/BRATS_002.nii.gz"
    data = bytearray(path.read_bytes())
    data[-8] ^= 0xFF                    # the trailer is CRC32, then ISIZE
    path.write_bytes(bytes(data))
    write_manifest(tmp_path / "raw", "raw", "download", {})
    code = run_main(main, ["--raw", str(tmp_path / "raw"), "--dataset", str(tmp_path / "ds")])
    out, err = capsys.readouterr()
    assert_one_line_error(subprocess.CompletedProcess([], code, out, err), "BRATS_002",
                          "corrupt gzip")


def test_missing_raw_manifest_is_refused(raw, tmp_path):
    bare = tmp_path / "bare"
    make_raw(bare, small_cases(5))
    (bare / MANIFEST).unlink()
    result = run_cli("--raw", str(bare), "--dataset", str(tmp_path / "ds"))
    assert_one_line_error(result, "'raw'", MANIFEST)
    assert not (tmp_path / "ds").exists() or list((tmp_path / "ds").iterdir()) == []


# ----------------------------------------------------------------------------- raw read by key

@pytest.fixture
def raw_in_s3(s3_env, tmp_path):
    """A raw artifact of 4 training and 2 test cases, on disk and uploaded as Argo saves it:
    (its directory, its S3 prefix)."""
    root = tmp_path / "raw"
    write_msd_task(root, cases=4, shape=SHAPE, seed=1, test_cases=2)
    write_manifest(root, "raw", "download", {})
    uri = f"s3://{s3_env.bucket}/{tmp_path.name}/download-pod/raw"
    storage.upload_dir(root, uri, progress=False)
    return root, uri


@pytest.mark.slow
def test_raw_read_by_key_gives_the_same_dataset_and_reads_no_test_image(raw_in_s3, tmp_path):
    """``--raw s3://…``: the dataset is byte for byte the one made from the directory; the test
    images are never fetched (deleted from S3 first, still listed in the manifest); no
    scratch file is left in the output."""
    root, uri = raw_in_s3
    patch = f"{PATCH[0]}x{PATCH[1]}"
    assert main(["--raw", str(root), "--dataset", str(tmp_path / "from-dir"),
                 "--patch-size", patch]) == 0
    bucket, key = storage.parse_uri(uri)
    tests = storage.list_keys(f"{uri}/Task01_BrainTumour/imagesTs")
    assert len(tests) == 2
    for test_key in tests:
        storage.client_for(uri).delete_object(Bucket=bucket, Key=test_key)
    result = run_cli("--raw", uri, "--dataset", str(tmp_path / "by-key"), "--workers", "2",
                     "--patch-size", patch)
    assert result.returncode == 0, result.stderr
    last = result.stderr.splitlines()[-1]
    assert "4 cases" in last
    assert all_bytes(tmp_path / "by-key") == all_bytes(tmp_path / "from-dir")
    task = root / "Task01_BrainTumour"
    read = [root / MANIFEST, task / "dataset.json", *task.glob("imagesTr/*"),
            *task.glob("labelsTr/*")]
    assert bykey.fetched_bytes(last) == {"raw": sum(p.stat().st_size for p in read)}


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["changed", "missing", "no manifest"])
def test_raw_read_by_key_refuses_what_its_manifest_does_not_vouch_for(raw_in_s3, tmp_path,
                                                                      damage):
    """An object changed after its manifest (same size), one deleted, or a prefix without a
    manifest: one line naming the object, exit 2, nothing published or left behind."""
    _, uri = raw_in_s3
    bucket, key = storage.parse_uri(uri)
    s3 = storage.client_for(uri)
    target = {"changed": "Task01_BrainTumour/imagesTr/BRATS_003.nii.gz",
              "missing": "Task01_BrainTumour/labelsTr/BRATS_002.nii.gz",
              "no manifest": MANIFEST}[damage]
    if damage == "changed":
        body = bytearray(storage.get_bytes(f"{uri}/{target}"))
        body[-1] ^= 0xFF
        s3.put_object(Bucket=bucket, Key=f"{key}/{target}", Body=bytes(body))
    else:
        s3.delete_object(Bucket=bucket, Key=f"{key}/{target}")
    out = tmp_path / "ds"
    result = run_cli("--raw", uri, "--dataset", str(out), "--workers", "2",
                     "--patch-size", f"{PATCH[0]}x{PATCH[1]}")
    line = assert_one_line_error(result, target if damage != "no manifest" else "'raw'")
    assert {"changed": "sha256", "missing": "no such object",
            "no manifest": "is missing"}[damage] in line
    assert not out.exists()


# ----------------------------------------------------------------------------- dataset saved by key

def _dataset_uri(raw_uri: str) -> str:
    """Where the workflow has preprocess save its dataset: beside the raw artifact's pod."""
    return raw_uri.replace("/download-pod/raw", "/preprocess-pod/dataset")


@pytest.mark.slow
def test_dataset_saved_by_key_is_the_same_artifact_and_leaves_the_folder(raw_in_s3, tmp_path):
    """``--dataset-uri``: each case's files are in S3 and not in ``--dataset``, which keeps
    ``dataset.json`` and the manifest of the whole; saved beside the cases as the executor
    saves a folder, the prefix is byte for byte the artifact made without the flag. The last
    line says exactly the bytes saved by key."""
    root, uri = raw_in_s3
    patch = f"{PATCH[0]}x{PATCH[1]}"
    assert main(["--raw", str(root), "--dataset", str(tmp_path / "plain"),
                 "--patch-size", patch]) == 0
    out, saved = tmp_path / "pod", _dataset_uri(uri)
    result = run_cli("--raw", uri, "--dataset", str(out), "--dataset-uri", saved,
                     "--workers", "2", "--patch-size", patch)
    assert result.returncode == 0, result.stderr
    assert sorted(all_bytes(out)) == [MANIFEST, "dataset.json"]
    cases = {rel: data for rel, data in all_bytes(tmp_path / "plain").items()
             if rel.startswith("cases/")}
    assert len(cases) == 8
    assert bykey.saved_bytes(result.stderr.splitlines()[-1]) == {
        "dataset": sum(map(len, cases.values()))}
    storage.upload_dir(out, saved, progress=False)          # the executor's save
    storage.download_dir(saved, tmp_path / "whole", progress=False)
    assert all_bytes(tmp_path / "whole") == all_bytes(tmp_path / "plain")
    # the summary gives the whole artifact's size, not that of the two files left in --dataset
    whole, left = (sum(map(len, all_bytes(root).values())) / 1e6 for root in (tmp_path / "whole", out))
    assert f"{whole:.1f}" != f"{left:.1f}"
    assert f" cases, {whole:.1f} MB -> {out}," in result.stderr.splitlines()[-1]


def test_the_saver_keeps_at_most_ahead_items_begun_and_unsaved(s3_env, tmp_path, monkeypatch):
    """Uploads slower than the work: the work waits, so no more than ``ahead`` items are
    ever on disk at once (and that many are: the bound is what holds them back); every item
    is saved, and listed, in order."""
    upload_file = storage.upload_file

    def slow(*args, **kwargs):
        time.sleep(0.1)
        return upload_file(*args, **kwargs)

    monkeypatch.setattr(storage, "upload_file", slow)
    uri, peak = f"s3://{s3_env.bucket}/{tmp_path.name}/pod/out", 0
    with bykey.Saver(uri, "out") as saver:
        for i in saver.paced(range(12), 3):
            path = tmp_path / f"{i:02d}.bin"
            path.write_bytes(bytes([i]) * 1000)
            peak = max(peak, len(list(tmp_path.glob("*.bin"))))
            saver.save([(path, path.name)])
        entries = saver.saved()
    assert peak == 3
    assert [e["path"] for e in entries] == [f"{i:02d}.bin" for i in range(12)]
    assert len(storage.list_keys(uri)) == 12 and not list(tmp_path.glob("*.bin"))


def test_an_artifact_partly_saved_by_key_counts_every_file_once(s3_env, tmp_path):
    """``bykey.artifact_bytes``: the files under the folder and those saved by key, a file
    kept after its upload (``keep``) counted once, and again once let go."""
    root, uri = tmp_path / "artifact", f"s3://{s3_env.bucket}/{tmp_path.name}/pod/out"
    (root / "cases").mkdir(parents=True)
    (root / "dataset.json").write_bytes(b"x" * 10)
    for keep in (False, True):
        files = [(root / "cases" / f"{i}.npy", f"cases/{i}.npy") for i in range(3)]
        for i, (path, _) in enumerate(files):
            path.write_bytes(b"y" * (100 << i))
        with bykey.Saver(f"{uri}-{keep}", "out", keep=keep) as saver:
            saver.save(files)
            assert bykey.artifact_bytes(root, saver) == 10 + 100 + 200 + 400
            assert bykey.artifact_bytes(root, None) == 10 + (700 if keep else 0)
            if keep:
                saver.let_go(root)
                assert bykey.artifact_bytes(root, saver) == 710
                assert bykey.artifact_bytes(root, None) == 10


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_failed_case_empties_the_prefix_the_dataset_was_saved_at(raw_in_s3, tmp_path, workers,
                                                                    capsys, monkeypatch):
    """The last case fails (its image changed in S3) after the first three were saved: the six
    objects saved are deleted, one line, exit 2, nothing published, and a pool's feeder
    waiting for room lets the pool close. In process, to count what the clean-up deleted."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)   # the step sets it; restored after
    _, uri = raw_in_s3
    saved, out = _dataset_uri(uri), tmp_path / "ds"
    bucket, key = storage.parse_uri(uri)
    s3 = storage.client_for(uri)
    target = f"{key}/Task01_BrainTumour/imagesTr/BRATS_004.nii.gz"
    body = bytearray(s3.get_object(Bucket=bucket, Key=target)["Body"].read())
    body[-1] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=target, Body=bytes(body))
    deleted, delete_prefix = [], storage.delete_prefix
    monkeypatch.setattr(storage, "delete_prefix",
                        lambda *a, **k: deleted.append(delete_prefix(*a, **k)) or deleted[-1])
    # as many CPUs as workers, whatever else the machine runs (limits.FairThreads would
    # measure it), so that two workers are a pool of two; and the pool's size recorded
    monkeypatch.setenv("OMP_NUM_THREADS", str(workers))
    monkeypatch.setattr(limits, "set_threads", lambda count=None: count or workers)
    pools, imap = [], preprocess_step._imap
    monkeypatch.setattr(preprocess_step, "_imap", lambda jobs, n, threads: pools.append(n) or
                        imap(jobs, n, threads))
    code = run_main(main, ["--raw", uri, "--dataset", str(out), "--dataset-uri", saved,
                           "--workers", str(workers), "--patch-size", f"{PATCH[0]}x{PATCH[1]}"])
    err = capsys.readouterr().err
    assert_one_line_error(subprocess.CompletedProcess([], code, "", err), "BRATS_004")
    assert pools == [workers]
    assert deleted == [6] and storage.list_keys(saved) == []
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["not empty", "inside raw"])
def test_a_dataset_prefix_in_use_is_refused_before_any_work(raw_in_s3, tmp_path, case):
    """A prefix that already holds an object (which stays) or lies inside ``--raw``: one
    line, exit 2, nothing published, nothing saved."""
    _, uri = raw_in_s3
    saved = f"{uri}/dataset" if case == "inside raw" else _dataset_uri(uri)
    if case == "not empty":
        storage.put_bytes(b"another run's", f"{saved}/cases/x.npy")
    out = tmp_path / "ds"
    result = run_cli("--raw", uri, "--dataset", str(out), "--dataset-uri", saved,
                     "--patch-size", f"{PATCH[0]}x{PATCH[1]}")
    assert_one_line_error(result, {"not empty": "not empty", "inside raw": "overlap"}[case])
    assert storage.list_keys(saved) == ([f"{storage.parse_uri(saved)[1]}/cases/x.npy"]
                                        if case == "not empty" else [])
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2, 4])
def test_any_number_of_cases_is_preprocessed_with_a_fold_per_case_below_five(tmp_path, n):
    """The split belongs to training: preprocess takes one case or more, and below five
    cases each case validates one fold (leave one out)."""
    raw = tmp_path / "raw"
    make_raw(raw, small_cases(n))
    result = run_cli("--raw", str(raw), "--dataset", str(tmp_path / "ds"), "--patch-size", "16x16")
    assert result.returncode == 0, result.stderr
    meta = read_metadata(tmp_path / "ds")
    assert len(meta["cases"]) == n and len(meta["folds"]) == n
    assert sorted(name for fold in meta["folds"] for name in fold["val"]) == \
        sorted(case["name"] for case in meta["cases"])


@pytest.mark.slow
def test_train_refuses_a_fold_it_cannot_train_on(tmp_path):
    """One case: the dataset is valid, and train says in one line why its fold cannot train."""
    raw = tmp_path / "raw"
    make_raw(raw, small_cases(1))
    assert run_cli("--raw", str(raw), "--dataset", str(tmp_path / "ds"),
                   "--patch-size", "16x16").returncode == 0
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "steps.train", "--dataset", str(tmp_path / "ds"),
                             "--model", str(tmp_path / "model"), "--device", "cpu",
                             "--levels", "4", "--batch-size", "2"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert_one_line_error(result, "--fold 0", "0 training and 1 validation", "has 1")
    assert not (tmp_path / "model").exists()


@pytest.mark.slow
def test_bad_parameters_and_help():
    result = run_cli("--help")
    assert result.returncode == 0
    for flag in ("--raw", "--dataset", "--workers", "--image-dtype", "--mode", "--patch-size"):
        assert flag in result.stdout
    assert_one_line_error(run_cli("--raw", "x", "--dataset", "y", "--patch-size", "192"),
                          "--patch-size")
    assert_one_line_error(run_cli("--raw", "x", "--dataset", "y", "--workers", "0"), "--workers")
    for uri in ("http://user:SECRETX@host/p", "s3://bucket", "s3://AKIA:SECRETX@bucket/p"):
        result = run_cli("--raw", "x", "--dataset", "y", "--dataset-uri", uri)
        assert "SECRETX" not in result.stderr
        assert_one_line_error(result, "--dataset-uri" if "bucket/" not in uri else "credentials")


NIBABEL_DATA = Path(nib.__file__).parent / "tests" / "data"
SCANNER_FILES = ["anatomical.nii", "functional.nii", "example4d.nii.gz", "example_nifti2.nii.gz",
                 "standard.nii.gz", "reoriented_anat_moved.nii"]


@pytest.mark.parametrize("name", SCANNER_FILES)
def test_real_scanner_files_load_as_nibabel_reads_them(name, gzip_backend):
    """Headers written by real scanners and tools (nibabel's own test data) pass every check
    of the strict reader, and give nibabel's values (within the float32 of scaled data)."""
    path = NIBABEL_DATA / name
    if not path.is_file():
        pytest.skip(f"{path} is not installed with this nibabel")
    volume = nifti.load(path)
    reference = np.asarray(nib.load(path).dataobj, dtype=np.float64)
    assert volume.data.shape == reference.shape
    np.testing.assert_allclose(np.asarray(volume.values(), dtype=np.float64), reference,
                               rtol=1e-6, atol=1e-6 * max(1.0, np.abs(reference).max()))
