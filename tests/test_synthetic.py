"""The synthetic BraTS-like generator: layout, determinism and anatomy."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile

import nibabel as nib
import numpy as np
import pytest
from numpy._core import _multiarray_umath as umath

from steps import synthetic

SHAPE = (48, 48, 24)


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_msd_layout_and_dataset_json(tmp_path):
    task = synthetic.write_msd_task(tmp_path, cases=2, shape=SHAPE, seed=3, test_cases=1)
    assert task == tmp_path / "Task01_BrainTumour"
    meta = json.loads((task / "dataset.json").read_text())
    assert meta["modality"] == {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"}
    assert meta["labels"] == {"0": "background", "1": "edema", "2": "non-enhancing tumor",
                              "3": "enhancing tumour"}
    assert (meta["numTraining"], meta["numTest"]) == (2, 1)
    assert meta["training"][0] == {"image": "./imagesTr/BRATS_001.nii.gz",
                                   "label": "./labelsTr/BRATS_001.nii.gz"}
    assert meta["test"] == ["./imagesTs/BRATS_003.nii.gz"]
    for entry in meta["training"]:
        assert (task / entry["image"]).is_file() and (task / entry["label"]).is_file()
    assert (task / meta["test"][0]).is_file()
    assert not (task / "labelsTr" / "BRATS_003.nii.gz").exists()


def test_nifti_headers_shapes_and_dtypes(tmp_path):
    task = synthetic.write_msd_task(tmp_path, cases=1, shape=SHAPE, seed=0)
    image = nib.load(task / "imagesTr" / "BRATS_001.nii.gz")
    label = nib.load(task / "labelsTr" / "BRATS_001.nii.gz")
    assert image.shape == SHAPE + (4,) and label.shape == SHAPE
    assert image.get_data_dtype() == np.float32 and label.get_data_dtype() == np.uint8
    assert image.header.get_zooms()[:3] == (1.0, 1.0, 1.0)
    assert image.header.get_xyzt_units()[0] == "mm"
    np.testing.assert_allclose(image.affine, label.affine)
    np.testing.assert_allclose(np.abs(np.diag(image.affine)[:3]), 1.0)
    assert int(image.header["sform_code"]) == 1 and int(image.header["qform_code"]) == 1


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = synthetic.write_msd_task(tmp_path / "a", cases=2, shape=SHAPE, seed=7)
    b = synthetic.write_msd_task(tmp_path / "b", cases=2, shape=SHAPE, seed=7)
    c = synthetic.write_msd_task(tmp_path / "c", cases=2, shape=SHAPE, seed=8)
    assert _files(a) == _files(b)
    # gzip headers carry mtime 0, so the bytes do not depend on when they were written.
    header = (a / "imagesTr" / "BRATS_001.nii.gz").read_bytes()[:8]
    assert header[:2] == b"\x1f\x8b" and header[4:8] == b"\x00\x00\x00\x00"
    files_c = _files(c)
    assert files_c["imagesTr/BRATS_001.nii.gz"] != _files(a)["imagesTr/BRATS_001.nii.gz"]
    assert files_c["labelsTr/BRATS_002.nii.gz"] != _files(a)["labelsTr/BRATS_002.nii.gz"]


def test_case_does_not_depend_on_case_count():
    one = synthetic.generate_case(SHAPE, seed=5, index=2)
    again = synthetic.generate_case(SHAPE, seed=5, index=2)
    other = synthetic.generate_case(SHAPE, seed=5, index=3)
    np.testing.assert_array_equal(one.image, again.image)
    assert not np.array_equal(one.label, other.label)


@pytest.mark.parametrize("shape,index", [(SHAPE, 1), (SHAPE, 2), ((64, 56, 32), 4),
                                         ((40, 72, 30), 9)])
def test_brain_and_nested_tumour_regions(shape, index):
    case = synthetic.generate_case(shape, seed=11, index=index)
    image, label = case.image, case.label
    assert image.shape == shape + (4,) and image.dtype == np.float32
    assert label.dtype == np.uint8 and set(np.unique(label)) == {0, 1, 2, 3}
    brain = np.any(image != 0, axis=-1)
    # Foreground: every channel positive inside, exactly zero outside, well inside the grid.
    assert np.all(image[brain] > 0) and np.all(image[~brain] == 0)
    for axis in range(3):
        extent = np.flatnonzero(brain.any(axis=tuple(a for a in range(3) if a != axis)))
        assert extent[0] > 0 and extent[-1] < shape[axis] - 1
    # Nesting: enhancing ⊂ tumour core (2 ∪ 3) ⊂ whole tumour (1 ∪ 2 ∪ 3) ⊂ brain.
    whole = label > 0
    assert np.all(brain[whole])
    enhancing = label == 3
    core = (label == 2) | enhancing
    assert np.all(core[enhancing]) and np.all(whole[core])
    assert enhancing.sum() < core.sum() < whole.sum() < brain.sum()


def test_modality_signatures_separate_the_classes():
    """Edema bright on FLAIR, enhancing bright on t1gd, core dark on T1 (per-class means)."""
    case = synthetic.generate_case((96, 96, 48), seed=2, index=1)
    brain = np.any(case.image != 0, axis=-1)
    means = {}
    for name, mask in {"tissue": brain & (case.label == 0), "edema": case.label == 1,
                       "core": case.label == 2, "enhancing": case.label == 3}.items():
        means[name] = case.image[mask].mean(axis=0)  # (4,) FLAIR, T1w, t1gd, T2w
    flair, t1, t1gd, t2 = range(4)
    assert means["edema"][flair] > 1.2 * means["tissue"][flair]
    assert means["edema"][t2] > 1.2 * means["tissue"][t2]
    assert means["enhancing"][t1gd] > 1.3 * max(means[k][t1gd] for k in ("tissue", "edema",
                                                                          "core"))
    assert means["core"][t1] < 0.8 * min(means[k][t1] for k in ("tissue", "edema",
                                                                "enhancing"))


def test_texture_and_noise_vary_within_a_tissue():
    case = synthetic.generate_case(SHAPE, seed=0, index=1)
    edema = case.image[case.label == 1][:, 0]
    assert edema.std() > 0.01 * edema.mean()
    assert np.all(case.image == np.rint(case.image))


def test_full_size_shape_is_supported():
    case = synthetic.generate_case(synthetic.FULL_SHAPE, seed=0, index=1)
    assert case.image.shape == (240, 240, 155, 4)
    assert set(np.unique(case.label)) == {0, 1, 2, 3}


def test_rejects_tiny_grid():
    with pytest.raises(ValueError, match="shape"):
        synthetic.generate_case((8, 8, 8))


def test_tar_is_deterministic_and_carries_macos_junk(tmp_path):
    md5 = synthetic.write_msd_tar(tmp_path / "a.tar", cases=2, shape=SHAPE, seed=1,
                                  test_cases=1)
    again = synthetic.write_msd_tar(tmp_path / "b.tar", cases=2, shape=SHAPE, seed=1,
                                    test_cases=1, workers=2)
    data = (tmp_path / "a.tar").read_bytes()
    assert data == (tmp_path / "b.tar").read_bytes()
    assert md5 == again == hashlib.md5(data).hexdigest()
    with tarfile.open(tmp_path / "a.tar") as tar:
        names = tar.getnames()
        assert tar.getmember("Task01_BrainTumour/imagesTr").isdir()
    assert "Task01_BrainTumour/dataset.json" in names
    assert "Task01_BrainTumour/imagesTr/BRATS_002.nii.gz" in names
    assert "Task01_BrainTumour/imagesTr/._BRATS_002.nii.gz" in names
    assert "Task01_BrainTumour/imagesTs/._BRATS_003.nii.gz" in names
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tar", "b.tar"]


_KERNEL_PROBE = """
import hashlib
import numpy as np
from steps import synthetic
rng = np.random.default_rng(0)
a = rng.standard_normal((64, 64), dtype=np.float32)
x = rng.standard_normal(4096).astype(np.float32)
case = hashlib.md5()
for knots in ((3, 3, 3), (5, 5, 4), (12, 12, 8), (16, 16, 10)):
    field = synthetic.smooth_field((48, 40, 24), np.random.default_rng(list(knots)), knots)
    case.update(field.tobytes())
for number in (1, 2):
    for _, data in synthetic.case_files((48, 48, 24), 3, number, training=True):
        case.update(data)
print(hashlib.md5((a @ a).tobytes()).hexdigest(), hashlib.md5(np.exp(x).tobytes()).hexdigest(),
      case.hexdigest())
"""


def _kernel_probe(**env: str) -> tuple[str, str, str]:
    """(md5 of a float32 matmul, of a float32 exp, of smooth fields and two cases' files),
    each made in a fresh process."""
    done = subprocess.run([sys.executable, "-c", _KERNEL_PROBE], capture_output=True,
                          text=True, check=True, env={**os.environ, **env})
    return tuple(done.stdout.split())  # type: ignore[return-value]


def test_cases_have_the_same_bytes_whichever_blas_kernel_and_simd_path_runs():
    """OpenBLAS picks its kernel by CPU and numpy its exp by SIMD level, and both round
    otherwise on other CPUs; the variables below make this CPU take those other paths. The
    probes show that each variable took effect, and the fields' and cases' bytes must not move."""
    matmul, exp, case = _kernel_probe()
    other_blas = _kernel_probe(OPENBLAS_CORETYPE="Prescott")
    if other_blas[0] == matmul:
        pytest.skip("OPENBLAS_CORETYPE changed no matmul here (numpy's BLAS is not "
                    "OpenBLAS with DYNAMIC_ARCH)")
    assert other_blas[2] == case
    dispatch = [f for f in umath.__cpu_dispatch__ if umath.__cpu_features__.get(f)]
    baseline = _kernel_probe(NPY_DISABLE_CPU_FEATURES=" ".join(dispatch))
    if baseline[1] == exp:
        pytest.skip(f"turning off {dispatch or 'nothing'} changed no exp on this CPU")
    assert baseline[2] == case


def test_tar_holds_the_files_write_msd_task_and_nib_save_write(tmp_path):
    """One generator: the tar's members are the task's files byte for byte, and each volume
    is what nibabel itself writes for the case."""
    synthetic.write_msd_tar(tmp_path / "t.tar", cases=2, shape=SHAPE, seed=5, test_cases=1,
                            macos_junk=False)
    with tarfile.open(tmp_path / "t.tar") as tar:
        tar.extractall(tmp_path / "from-tar", filter="data")
    task = synthetic.write_msd_task(tmp_path / "task", cases=2, shape=SHAPE, seed=5,
                                    test_cases=1)
    assert _files(tmp_path / "from-tar") == _files(tmp_path / "task")
    case = synthetic.generate_case(SHAPE, seed=5, index=3)
    nib.save(synthetic._nifti(case.image, case.affine), tmp_path / "saved.nii.gz")
    assert ((task / "imagesTs" / "BRATS_003.nii.gz").read_bytes()
            == (tmp_path / "saved.nii.gz").read_bytes())


def test_failed_tar_leaves_nothing(tmp_path, monkeypatch):
    made = synthetic.case_files

    def fail_on_second(shape, seed, number, training):
        if number == 2:
            raise RuntimeError("case 2 failed")
        return made(shape, seed, number, training)

    monkeypatch.setattr(synthetic, "case_files", fail_on_second)
    with pytest.raises(RuntimeError, match="case 2"):
        synthetic.write_msd_tar(tmp_path / "t.tar", cases=3, shape=SHAPE)
    assert list(tmp_path.iterdir()) == []


def test_full_split_is_task01s():
    meta = json.loads(synthetic._dataset_json_bytes(synthetic.TRAINING_CASES,
                                                    synthetic.TEST_CASES))
    assert (meta["numTraining"], meta["numTest"]) == (484, 266)
    assert meta["training"][-1]["label"] == "./labelsTr/BRATS_484.nii.gz"
    assert (meta["test"][0], meta["test"][-1]) == ("./imagesTs/BRATS_485.nii.gz",
                                                   "./imagesTs/BRATS_750.nii.gz")


def test_cached_tar_is_made_once_and_remade_when_stale(tmp_path, monkeypatch):
    monkeypatch.setenv(synthetic.CACHE_ENV, str(tmp_path))
    tar, md5 = synthetic.cached_tar(2, 1, SHAPE, seed=2, workers=1)
    assert tar == tmp_path / "2+1-48x48x24-seed2" / "Task01_BrainTumour.tar"
    assert md5 == hashlib.md5(tar.read_bytes()).hexdigest()
    record = tar.with_name(f"{synthetic.TASK}.tar.md5")
    assert record.read_text() == (f"{md5}  {tar.stat().st_size}  "
                                  f"{synthetic.generator_digest()}\n")
    made = []
    real = synthetic.write_msd_tar
    monkeypatch.setattr(synthetic, "write_msd_tar",
                        lambda *a, **k: made.append(a) or real(*a, **k))
    assert synthetic.cached_tar(2, 1, SHAPE, seed=2, workers=1) == (tar, md5)
    assert made == []                                    # cached: not made again
    for stale in (record.read_text().replace(synthetic.generator_digest(), "0" * 64),
                  "garbage\n"):
        record.write_text(stale)
        assert synthetic.cached_tar(2, 1, SHAPE, seed=2, workers=1) == (tar, md5)
    tar.write_bytes(tar.read_bytes()[:-512])             # cut short: size no longer matches
    assert synthetic.cached_tar(2, 1, SHAPE, seed=2, workers=1) == (tar, md5)
    assert len(made) == 3
    assert sorted(p.name for p in tar.parent.iterdir()) == [tar.name, record.name]


def test_cli_prints_md5_and_path_and_refuses_bad_shape(tmp_path):
    out = tmp_path / "x.tar"
    done = subprocess.run([sys.executable, "-m", "steps.synthetic", "--cases", "1", "--test",
                           "1", "--shape", "48x48x24", "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, check=True)
    assert done.stdout == f"{hashlib.md5(out.read_bytes()).hexdigest()}  {out}\n"
    bad = subprocess.run([sys.executable, "-m", "steps.synthetic", "--shape", "4x4x4",
                          "--out", str(tmp_path / "y.tar")], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1
    assert "shape=4x4x4 is smaller than the minimum 24x24x12" in bad.stderr
    assert not (tmp_path / "y.tar").exists()




def test_cli_says_how_many_workers_made_the_tar_and_when_the_cache_had_it(tmp_path,
                                                                         monkeypatch):
    """By default one worker process per CPU the CLI is given (``UNET_CPUS``, as a pod's);
    ``--workers`` overrides it; a tar already in the cache is said to be, not made again."""
    def cli(*args: str, cpus: str = "2") -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "steps.synthetic", "--cases", "3",
                               "--test", "0", "--shape", "32x32x16", "--no-progress", *args],
                              capture_output=True, text=True, check=True,
                              env={**{k: v for k, v in os.environ.items()
                                      if k != "OMP_NUM_THREADS"},
                                   synthetic.CACHE_ENV: str(tmp_path), "UNET_CPUS": cpus,
                                   "UNET_ADAPT_THREADS": "0"})

    made = synthetic.MADE.search(cli("--out", str(tmp_path / "a.tar")).stderr)
    assert made and made.groups() == ("3", "2")
    made = synthetic.MADE.search(cli("--out", str(tmp_path / "b.tar"), "--workers", "1").stderr)
    assert made and made.groups() == ("3", "1")
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()
    first, again = cli(cpus="1"), cli(cpus="1")
    assert synthetic.MADE.search(first.stderr)[2] == "1"
    assert not synthetic.MADE.search(again.stderr) and "was in the cache" in again.stderr
    assert first.stdout == again.stdout
    monkeypatch.setenv(synthetic.CACHE_ENV, str(tmp_path))
    record = synthetic.cached_path(3, 0, (32, 32, 16), 0).with_name(f"{synthetic.TASK}.tar.md5")
    record.write_text("stale\n")                    # a bad record: made again, and said so
    stale = cli(cpus="1")
    assert synthetic.MADE.search(stale.stderr) and stale.stdout == first.stdout
    one = cli("--cases", "1", "--out", str(tmp_path / "c.tar"), "--workers", "4")
    assert synthetic.MADE.search(one.stderr).groups() == ("1", "1")   # never more than cases
