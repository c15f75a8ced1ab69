"""The convert step and ``predict``: a briefly trained model through the real steps.

download (synthetic) → preprocess → train (CLI, a few steps) → convert, then checks parity,
the model card, the .pt2 in a clean process, ``predict`` on a NIfTI case and one-line errors.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import onnx
import pytest
import torch

from steps import convert, download, predict, preprocess
from steps.artifacts import publish, require
from steps.dataset import fold_names, open_cases, read_metadata
from steps.errors import StepError, run_main
from tests.train_data import REPO, assert_ok as _ok, run_step

pytestmark = pytest.mark.slow  # trains a model for its fixture, then exports and runs it

SOURCE = "synthetic://?cases=6&shape=64x64x24&seed=1"
TRAIN_ARGS = ("--device", "cpu", "--base-filters", "8", "--levels", "4", "--batch-size", "8",
              "--max-epochs", "1", "--steps-per-epoch", "12", "--learning-rate", "0.01",
              "--val-batch-size", "32", "--num-workers", "0", "--fold", "0")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(root, raw task dir, dataset dir, model dir, exported dir) from the real steps."""
    root = tmp_path_factory.mktemp("convert")
    raw, dataset, model, exported = (root / n for n in ("raw", "dataset", "model", "exported"))
    assert download.main(["--source", SOURCE, "--raw", str(raw)]) == 0
    assert preprocess.main(["--raw", str(raw), "--dataset", str(dataset),
                            "--patch-size", "64x64"]) == 0
    _ok(run_step("train", "--dataset", str(dataset), "--model", str(model), *TRAIN_ARGS))
    assert convert.main(["--model", str(model), "--dataset", str(dataset),
                         "--exported", str(exported)]) == 0
    return root, raw / "Task01_BrainTumour", dataset, model, exported


@pytest.fixture(scope="module")
def network(built):
    """The eager torch network from the trained checkpoint, and the checkpoint dict."""
    model = built[3]
    ckpt = convert.load_checkpoint(model)
    net, config = convert.inference_network(ckpt, model / convert.CHECKPOINT)
    return net, config, ckpt


def _val_slices(dataset: Path, n: int) -> np.ndarray:
    meta = read_metadata(dataset)
    case = open_cases(dataset, meta, fold_names(meta, 0)[1][:1])[0]
    return np.ascontiguousarray(np.asarray(case.image[:, :n], np.float32).transpose(1, 0, 2, 3))


# --------------------------------------------------------------------------- export

def test_export_is_published_with_parity_within_bounds(built):
    _, _, dataset, model, exported = built
    manifest = require(exported, "exported")
    names = {f["path"] for f in manifest["files"]}
    assert {"unet2d.onnx", "unet2d.pt2", "parity.json", "model-card.json",
            "argo-outputs/max_abs_diff", "argo-outputs/argmax_agreement"} <= names
    parity = json.loads((exported / "parity.json").read_text())
    assert parity["passed"] and parity["slices"] >= 32
    assert sum(len(s) for s in parity["source"]["slices"].values()) == parity["slices"]
    for key in ("onnx", "pt2"):
        fig = parity[key]
        assert fig["max_abs_diff"] <= 1e-3 or fig["rel_diff"] <= 1e-4
        assert fig["rel_diff"] == pytest.approx(fig["max_abs_diff"] / fig["max_abs_logit"])
        assert fig["argmax_agreement"] >= 0.9999
        assert max(abs(a - b) for a, b in zip(fig["dice"], fig["dice_torch"])) <= 1e-4
        assert fig["pixels"] >= 32 * 64 * 64 * 0.5
    # Trained, not trivial: the logits are far from zero and some slices score a Dice.
    assert parity["onnx"]["max_abs_logit"] > 1.0
    argo = exported / "argo-outputs"
    assert float((argo / "max_abs_diff").read_text()) == pytest.approx(
        parity["onnx"]["max_abs_diff"], rel=1e-2)
    assert float((argo / "argmax_agreement").read_text()) >= 0.9999


def test_onnx_graph_is_checked_dynamic_and_matches_torch(built, network):
    exported = built[4]
    net, config, _ = network
    path = exported / "unet2d.onnx"
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path))
    assert next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 17
    (inp,), (out,) = model.graph.input, model.graph.output
    assert (inp.name, out.name) == ("image", "logits")
    dims = [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim]
    assert dims == ["N", 4, "H", "W"]
    assert [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim] == dims
    assert inp.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    # Another batch size and another (multiple-of-8) plane than any parity slice.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 5 * 8, 9 * 8)).astype(np.float32)
    got = predict.open_session(path).run(["logits"], {"image": x})[0]
    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy()
    assert got.shape == (3, 4, 40, 72)
    assert np.max(np.abs(got - want)) <= 1e-3


def test_model_card_states_the_contract(built):
    _, _, dataset, model, exported = built
    card = json.loads((exported / "model-card.json").read_text())
    meta = read_metadata(dataset)
    assert card["inputs"] == [{"name": "image", "shape": ["N", 4, "H", "W"],
                               "dtype": "float32"}]
    assert card["outputs"][0]["name"] == "logits"
    assert card["outputs"][0]["shape"] == ["N", 4, "H", "W"]
    assert card["size_multiple"] == 8  # levels 4 → three downsamplings
    pre = card["preprocessing"]
    assert pre["channels"] == ["FLAIR", "T1w", "t1gd", "T2w"]
    assert pre["normalisation"] == meta["normalisation"]
    assert "zeros included" in pre["normalisation"]["statistics"]
    assert card["labels"] == meta["labels"]
    ckpt = torch.load(model / "best.pt", weights_only=True)
    assert card["training"]["config"] == ckpt["train_config"]
    assert card["model_config"] == ckpt["model_config"]
    assert card["provenance"]["dataset_manifest_sha256"] == ckpt["dataset_manifest_sha256"]
    versions = card["versions"]
    assert versions["torch"] == torch.__version__ and versions["opset"] >= 17
    assert versions["onnx"] == onnx.__version__ and "onnxruntime" in versions
    assert card["parity"] == json.loads((exported / "parity.json").read_text())


# Runs with -I (no PYTHONPATH, no user site) from a directory outside the repository.
_CLEAN = """
import sys, numpy as np, torch
module = torch.export.load(sys.argv[1]).module()
x = np.load(sys.argv[2])
with torch.no_grad():
    np.save(sys.argv[3], module(torch.from_numpy(x)).numpy())
print(",".join(sorted(m for m in sys.modules if m.split(".")[0] in ("steps", "monai"))))
"""


def test_pt2_reloads_without_this_repository(built, network, tmp_path):
    _, _, dataset, _, exported = built
    net, _, _ = network
    x = _val_slices(dataset, 5)
    np.save(tmp_path / "x.npy", x)
    done = subprocess.run([sys.executable, "-I", "-c", _CLEAN, str(exported / "unet2d.pt2"),
                           str(tmp_path / "x.npy"), str(tmp_path / "y.npy")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == ""  # neither steps nor monai was imported
    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy()
    got = np.load(tmp_path / "y.npy")
    assert got.shape == want.shape
    assert np.max(np.abs(got - want)) <= 1e-5


# -------------------------------------------------------------------------- predict

def _dice(pred: np.ndarray, truth: np.ndarray) -> list[float]:
    scores = []
    for cls in (1, 2, 3):
        p, t = pred == cls, truth == cls
        scores.append(1.0 if not (p.any() or t.any()) else 2 * (p & t).sum() / (p.sum() + t.sum()))
    return scores


def _torch_labels(net, prepared: predict.Prepared, multiple: int) -> np.ndarray:
    """The eager network in place of onnxruntime, same preprocessing and restore."""
    x = predict.pad_to_multiple(prepared.image.transpose(1, 0, 2, 3), multiple,
                                predict.background_fill(prepared.image))
    with torch.no_grad():
        logits = net(torch.from_numpy(x)).numpy()
    _, _, h, w = prepared.image.shape
    labels = logits[..., :h, :w].argmax(axis=1).astype(np.uint8)
    return predict.restore(labels, prepared, "default")


def test_predict_round_trips_a_case_like_the_torch_model(built, network, tmp_path):
    _, task, dataset, _, exported = built
    net, config, _ = network
    meta = read_metadata(dataset)
    name = fold_names(meta, 0)[1][0]  # a validation case
    image, label = task / "imagesTr" / f"{name}.nii.gz", task / "labelsTr" / f"{name}.nii.gz"
    out = tmp_path / "pred" / f"{name}.nii.gz"
    done = subprocess.run([sys.executable, "-m", "steps.convert", "predict", "--onnx",
                           str(exported / "unet2d.onnx"), "--image", str(image), "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    source, result = nib.load(image), nib.load(out)
    assert result.shape == source.shape[:3]
    assert np.array_equal(result.affine, source.affine)
    assert result.get_data_dtype() == np.uint8
    pred = np.asarray(result.dataobj)
    truth = np.asarray(nib.load(label).dataobj)
    assert pred.any(), "the briefly trained model should find some tumour"

    # The same preprocessing as the dataset artifact, up to its float16 rounding.
    session = predict.open_session(exported / "unet2d.onnx")
    prepared = predict.prepare(image, predict.read_contract(session, "x"))
    entry = next(c for c in meta["cases"] if c["name"] == name)
    stored = np.asarray(open_cases(dataset, meta, [name])[0].image, np.float32)
    assert [list(b) for b in prepared.box] == entry["crop"]
    (h0, _), (w0, _) = entry["window"]
    _, d, h, w = prepared.image.shape
    window = stored[:, :, -h0:-h0 + h, -w0:-w0 + w]
    tolerance = meta["normalisation"]["image_dtype_error"]["max_abs"]
    assert np.max(np.abs(window - prepared.image)) <= tolerance

    torch_pred = _torch_labels(net, prepared, config.size_multiple())
    assert np.mean(torch_pred == pred) >= 0.9999
    assert _dice(pred, truth) == pytest.approx(_dice(torch_pred, truth), abs=1e-4)


def test_predict_undoes_reorientation(built, tmp_path):
    _, task, dataset, _, exported = built
    name = fold_names(read_metadata(dataset), 0)[1][0]
    source = nib.load(task / "imagesTr" / f"{name}.nii.gz")
    data = np.asarray(source.dataobj)
    # Flip x, then swap x and y; the affine keeps every voxel at the same world position.
    flipped = np.ascontiguousarray(data[::-1].transpose(1, 0, 2, 3))
    step = np.array([[0, -1, 0, data.shape[0] - 1], [1, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
    moved = tmp_path / "moved.nii.gz"
    nib.save(nib.Nifti1Image(flipped, source.affine @ step), moved)
    onnx_path = str(exported / "unet2d.onnx")
    for img, out in ((task / "imagesTr" / f"{name}.nii.gz", "a.nii.gz"), (moved, "b.nii.gz")):
        assert predict.main(["--onnx", onnx_path, "--image", str(img),
                             "--out", str(tmp_path / out)]) == 0
    a = np.asarray(nib.load(tmp_path / "a.nii.gz").dataobj)
    b = nib.load(tmp_path / "b.nii.gz")
    assert np.allclose(b.affine, source.affine @ step)
    assert np.array_equal(np.asarray(b.dataobj), a[::-1].transpose(1, 0, 2))
    assert a.any()


# ---------------------------------------------------------------------- parity bounds

def test_parity_bounds_accept_noise_and_refuse_real_differences():
    rng = np.random.default_rng(1)
    label = np.zeros((2, 16, 16), np.uint8)
    label[:, 4:10, 4:10] = 1
    group = convert.SliceGroup(case="c", slices=[0, 1], image=np.zeros((2, 4, 16, 16), np.float32),
                               label=label, shape=(16, 16))
    ref = rng.standard_normal((2, 4, 16, 16)).astype(np.float32) * 5
    convert.check_bounds(convert.compare([ref], [ref + 4e-4], [group], 4), "same")
    shifted = ref.copy()
    shifted[0, 0, 0, 0] += 0.01  # 1e-2 absolute, 2e-3 of the largest logit
    with pytest.raises(StepError, match=r"parity failed .*max \|logit diff\|"):
        convert.check_bounds(convert.compare([ref], [shifted], [group], 4), "shifted")
    flipped = ref.copy()
    flipped[0, :, 5, 5] = flipped[0, ::-1, 5, 5].copy()  # one pixel's argmax moves
    fig = convert.compare([ref], [flipped], [group], 4)
    assert fig["argmax_agreement"] < 1.0
    with pytest.raises(StepError, match="argmax agreement"):
        convert.check_bounds(fig, "flipped")


# ------------------------------------------------------------------ one-line errors

def _model_artifact(path: Path, payload) -> Path:
    with publish(path, "model", "test", {}) as out:
        if payload is None:
            (out / "metrics.json").write_text("{}\n")
        elif isinstance(payload, bytes):
            (out / "best.pt").write_bytes(payload)
        else:
            torch.save(payload, out / "best.pt")
    return path


def _broken(kind: str, ckpt: dict):
    if kind == "missing checkpoint":
        return None
    if kind == "corrupt checkpoint":
        return b"PK\x03\x04 this is not a torch checkpoint"
    if kind == "config mismatch":
        return {**ckpt, "model_config": {**ckpt["model_config"], "base_filters": 16}}
    if kind == "parity failure":  # a diverged run: NaN weights give NaN logits
        state = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
                 for k, v in ckpt["model_state"].items()}
        return {**ckpt, "model_state": state}
    raise AssertionError(kind)


_EXPECTED = {"missing checkpoint": "best.pt is missing",
             "corrupt checkpoint": "not a readable checkpoint",
             "config mismatch": "model_state does not match its model_config",
             "parity failure": "hold NaN/Inf values"}


def _assert_one_line_error(code: int, stderr: str, expected: str) -> None:
    assert code == 2, stderr[-2000:]
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and expected in lines[0], stderr[-2000:]
    assert "Traceback" not in stderr


# Through the CLI (a separate process) for one fault; in process for the rest, which go
# through the same run_main and save a torch import each.
@pytest.mark.parametrize("kind,cli", [
    ("corrupt checkpoint", True), ("parity failure", False),
    ("missing checkpoint", False), ("config mismatch", False)])
def test_convert_fails_with_one_line_and_publishes_nothing(built, network, tmp_path, capsys,
                                                           kind, cli):
    dataset = built[2]
    model = _model_artifact(tmp_path / "model", _broken(kind, network[2]))
    exported = tmp_path / "exported"
    argv = ["--model", str(model), "--dataset", str(dataset), "--exported", str(exported)]
    if cli:
        done = subprocess.run([sys.executable, "-m", "steps.convert", *argv], cwd=REPO,
                              capture_output=True, text=True, timeout=300)
        _assert_one_line_error(done.returncode, done.stderr, _EXPECTED[kind])
    else:
        code = run_main(convert.main, argv)
        _assert_one_line_error(code, capsys.readouterr().err, _EXPECTED[kind])
    assert not (exported / "MANIFEST.json").exists()
    assert not exported.exists() or not any(exported.iterdir())


def test_predict_refuses_wrong_channel_count(built, tmp_path):
    _, task, _, _, exported = built
    source = nib.load(next((task / "imagesTr").glob("*.nii.gz")))
    three = tmp_path / "three.nii.gz"
    nib.save(nib.Nifti1Image(np.asarray(source.dataobj)[..., :3], source.affine), three)
    out = tmp_path / "out.nii.gz"
    done = subprocess.run([sys.executable, "-m", "steps.convert", "predict", "--onnx",
                           str(exported / "unet2d.onnx"), "--image", str(three), "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    _assert_one_line_error(done.returncode, done.stderr, "has 3 channels, the model needs 4")
    assert not out.exists()


@pytest.mark.parametrize("clash", ["image", "onnx"])
def test_predict_never_writes_through_an_input_named_like_its_temporary_name(built, tmp_path,
                                                                             clash):
    """An input named like the old fixed temporary name (``<out>.part<suffix>``) is left
    byte-for-byte alone, and the prediction still lands at --out."""
    _, task, _, _, exported = built
    image = next((task / "imagesTr").glob("*.nii.gz"))
    onnx_path = exported / "unet2d.onnx"
    folder = tmp_path / "d"
    folder.mkdir()
    if clash == "image":
        out = folder / "x.nii.gz"
        kept = image = folder / "x.nii.gz.part.nii.gz"
        image.write_bytes(next((task / "imagesTr").glob("*.nii.gz")).read_bytes())
    else:
        out = folder / "y.nii"
        kept = onnx_path = folder / "y.nii.part.nii"
        onnx_path.write_bytes((exported / "unet2d.onnx").read_bytes())
    before = kept.read_bytes()
    code = run_main(predict.main, ["--onnx", str(onnx_path), "--image", str(image),
                                   "--out", str(out)])
    assert code == 0
    assert kept.read_bytes() == before
    assert nib.load(out).shape == nib.load(image).shape[:3]
    assert sorted(p.name for p in folder.iterdir()) == sorted([kept.name, out.name])


@pytest.mark.parametrize("fault", ["SIGTERM", "exception"])
def test_predict_stopped_while_saving_leaves_nothing(built, tmp_path, capsys, monkeypatch,
                                                     fault):
    """SIGTERM (run_main's Stopped) or an unexpected error while nibabel writes the label
    map: neither --out nor the temporary file beside it is left behind."""
    _, task, _, _, exported = built
    image = next((task / "imagesTr").glob("*.nii.gz"))
    real_save = nib.save

    def save_then_fail(img, filename, *args, **kwargs):
        real_save(img, filename, *args, **kwargs)      # a partly or fully written file
        assert Path(filename).is_file()
        if fault == "SIGTERM":
            signal.raise_signal(signal.SIGTERM)       # run_main's handler raises Stopped
        raise RuntimeError("disk went away")

    monkeypatch.setattr(nib, "save", save_then_fail)
    folder = tmp_path / "out"
    out = folder / "label.nii.gz"
    code = run_main(predict.main, ["--onnx", str(exported / "unet2d.onnx"), "--image",
                                   str(image), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == (128 + signal.SIGTERM if fault == "SIGTERM" else 1), err[-2000:]
    assert not out.exists()
    assert not folder.exists() or list(folder.iterdir()) == []


def test_bad_parameters_are_one_line_errors(built, tmp_path, capsys):
    _, _, dataset, model, _ = built
    for flag, value, message in (("--opset", "13", "must be >= 17"),
                                 ("--parity-slices", "8", "must be >= 32")):
        with pytest.raises(SystemExit) as info:
            convert.main(["--model", str(model), "--dataset", str(dataset),
                          "--exported", str(tmp_path / "x"), flag, value])
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.count("\n") == 1 and message in err
        assert err.startswith(f"error: python -m steps.convert: argument {flag}: ")
    assert not (tmp_path / "x").exists()
