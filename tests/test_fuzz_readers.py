"""Fuzz harnesses for the readers of metadata and archives (issue 24, classes 3 and 5).

Each property starts from a valid document, breaks it the way a careless or hostile writer
would (a subtree replaced by any JSON value, a key dropped, a tensor resized, bytes that are
not UTF-8 or not JSON, a tar metadata block of any size) and runs the real reader under
:func:`steps.errors.run_main`, as the step's command line would. The reader must succeed, or
exit 2 with exactly one ``error:`` line; a traceback (exit 1) is a failure. Examples are
derandomized and bounded (``max_examples``), so CI sees the same inputs in bounded time.
"""
from __future__ import annotations

import copy
import io
import json
import os
import shutil
import tarfile
import tracemalloc
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from steps import (convert, dataset, download, evaluate, handoff, metrics, predict,
                   preprocess, schemas, synthetic, train)
from steps.artifacts import write_manifest
from steps.checkpoints import CheckpointStore
from steps.errors import run_main
from steps.model import ModelConfig, build_model
from train_data import make_dataset

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:libcst.*")
SETTINGS = dict(max_examples=40, deadline=None, derandomize=True, database=None,
                print_blob=False, suppress_health_check=[
                    HealthCheck.too_slow, HealthCheck.data_too_large,
                    HealthCheck.function_scoped_fixture])
CONFIG = ModelConfig(in_channels=4, out_channels=4, base_filters=2, levels=4)

scalars = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                           max_leaves=12)


def paths(node, prefix=()):
    """Every (path) to a node of a JSON-like document, the root included."""
    yield prefix
    if isinstance(node, dict):
        for key, child in node.items():
            yield from paths(child, prefix + (key,))
    elif isinstance(node, list):
        for index, child in enumerate(node):
            yield from paths(child, prefix + (index,))


@st.composite
def broken(draw, document, values=json_values):
    """``document`` with one node replaced by ``values`` or removed; or the whole thing
    replaced by bytes that are not JSON."""
    how = draw(st.sampled_from(["replace", "replace", "drop", "bytes", "deep"]))
    if how == "bytes":
        return draw(st.binary(max_size=64) | st.sampled_from([b"\xff\xfe{}", b"{\"a\": NaN}"]))
    if how == "deep":
        depth = draw(st.integers(30, 5000))
        return ("[" * depth + "]" * depth).encode()
    doc = copy.deepcopy(document)
    path = draw(st.sampled_from(list(paths(doc))))
    if not path:
        return json.dumps(draw(values)).encode()
    parent = doc
    for part in path[:-1]:
        parent = parent[part]
    if how == "drop" and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(values)
    return json.dumps(doc).encode()


def ends_cleanly(capsys, read) -> None:
    """``read()`` under run_main: exit 0, or exit 2 with one error line; never a traceback."""
    def main(_argv) -> int:
        read()
        return 0

    status = run_main(main)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    assert status in (0, 2), err[-3000:]
    if status == 2:
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and len(err.strip().splitlines()) == 1, err[-3000:]


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    return synthetic.write_msd_task(tmp_path_factory.mktemp("fuzz-task"), cases=2,
                                    shape=(24, 24, 12), seed=1, test_cases=1)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("fuzz-data"), cases=3, shape="24x24x12",
                        seed=2, patch="24x24")


# ----------------------------------------------------------------------------- JSON files
@settings(**SETTINGS)
@given(doc=st.data())
def test_manifest_reader(tmp_path, capsys, doc):
    root = tmp_path / "artifact"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    (root / "a.txt").write_text("x")
    write_manifest(root, "thing", "test", {})
    good = json.loads((root / "MANIFEST.json").read_text())
    (root / "MANIFEST.json").write_bytes(doc.draw(broken(good)))
    ends_cleanly(capsys, lambda: handoff.main(["verify", "--artifact", "thing", str(root)]))


@settings(**SETTINGS)
@given(doc=st.data())
def test_msd_dataset_json_readers(task, tmp_path, capsys, doc):
    copy_ = tmp_path / "task"
    shutil.rmtree(copy_, ignore_errors=True)
    shutil.copytree(task, copy_)
    good = json.loads((task / "dataset.json").read_text())
    (copy_ / "dataset.json").write_bytes(doc.draw(broken(good)))
    ends_cleanly(capsys, lambda: download.validate_task(copy_))
    ends_cleanly(capsys, lambda: preprocess.read_task(copy_))


@settings(**SETTINGS)
@given(doc=st.data())
def test_dataset_metadata_reader(data_dir, capsys, doc):
    good = json.loads((data_dir / "dataset.json").read_text())
    raw = doc.draw(broken(good))

    def read():
        meta = schemas.parse_json(raw, "dataset.json")
        dataset.check_metadata(meta, "dataset.json")
        names = dataset.fold_names(meta, 0)
        dataset.open_cases(data_dir, meta, names[0] + names[1])

    ends_cleanly(capsys, read)


def _npy_header(shape: str, descr: str) -> bytes:
    """A version 1.0 .npy header, as numpy writes one, stating any ``shape`` text."""
    text = f"{{'descr': {descr}, 'fortran_order': False, 'shape': {shape}, }}"
    text += " " * (-(len(text) + 11) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode("latin1")


@pytest.mark.parametrize("shape, descr", [
    ("(4, -2, 24, 24)", "'<f2'"), ("(4, 12, -24, -24)", "'<f2'"), ("(4, 12, 24.5, 24)", "'<f2'"),
    ("(4, 12, 'x', 24)", "'<f2'"), ("(4, 12, 24, 2**62)", "'<f2'"), ("(4, 12, 24, 24)", "'<V0'"),
    ("(4, 12, 24, 24)", "'O'"), ("((4,), 12)", "'<f2'"), ("()", "'<f2'")])
def test_a_case_array_with_a_hostile_header_is_one_line(data_dir, tmp_path, capsys, shape, descr):
    """A case's .npy header stating a negative dimension was exit 1 ('memory mapped length
    must be positive', an OverflowError); each of these is one line naming the case."""
    copy_ = tmp_path / "dataset"
    shutil.copytree(data_dir, copy_)
    meta = json.loads((copy_ / "dataset.json").read_text())
    victim = copy_ / meta["cases"][0]["image"]
    victim.write_bytes(_npy_header(shape, descr) + b"\0" * 4096)

    def main(_argv) -> int:
        dataset.open_cases(copy_, meta)
        return 0

    status = run_main(main)
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err, err[-3000:]
    assert len(err.strip().splitlines()) == 1 and meta["cases"][0]["name"] in err, err


def _good_evaluation() -> dict:
    """An evaluation that reads and pools: what the fuzzing breaks."""
    labels = {"edema": 0.5, "non-enhancing": 1.0, "enhancing": 0.25}
    regions = {"WT": 0.5, "TC": 1.0, "ET": 0.25}
    figures = {"dice": {**regions, **labels}, "hd95": {r: 2.0 for r in regions}, "empty": ["TC"],
               "largest_component": {v: labels for v in metrics.VARIANTS}}
    return {"format_version": 1, "fold": 2, "trained_on_by": 0,
            "cases": {"BRATS_001": figures, "BRATS_002": figures},
            "mean": {"dice": {**regions, **labels}, "hd95": {r: 2.0 for r in regions}},
            "mean_nnunet": {"dice": {**regions, **labels, "TC": None},
                            "hd95": {r: 2.0 for r in regions}}}


def test_the_fuzzed_evaluation_pools_unbroken(tmp_path):
    (tmp_path / evaluate.RESULT_FILE).write_text(json.dumps(_good_evaluation()))
    write_manifest(tmp_path, "evaluation", "evaluate", {})
    assert evaluate.pooled([evaluate.read_result(tmp_path)])["folds"] == [2]


@settings(**SETTINGS)
@given(doc=st.data())
def test_evaluation_reader_and_pool(tmp_path, capsys, doc):
    good = _good_evaluation()
    (tmp_path / evaluate.RESULT_FILE).write_bytes(doc.draw(broken(good)))
    write_manifest(tmp_path, "evaluation", "evaluate", {})
    ends_cleanly(capsys, lambda: evaluate.pooled([evaluate.read_result(tmp_path)]))


@settings(**SETTINGS)
@given(doc=st.data())
def test_model_card_reader(tmp_path, capsys, doc):
    good = {"format_version": 1, "size_multiple": 8,
            "training": {"config": {"fold": 0, "seed": 1}, "metrics": {}}}
    (tmp_path / predict.CARD_FILE).write_bytes(doc.draw(broken(good)))
    ends_cleanly(capsys, lambda: predict.read_card(tmp_path))


class _Session:
    """What read_contract asks of an onnxruntime session."""

    def __init__(self, props: dict[str, str]):
        self.props = props

    def get_modelmeta(self):
        return SimpleNamespace(custom_metadata_map=self.props)

    def get_inputs(self):
        return [SimpleNamespace(name="image", shape=["N", 4, "H", "W"], type="tensor(float)")]

    def get_outputs(self):
        return [SimpleNamespace(name="logits", shape=["N", 4, "H", "W"], type="tensor(float)")]


@settings(**SETTINGS)
@given(doc=st.data())
def test_onnx_contract_reader(capsys, doc):
    contract = {"channels": ["FLAIR", "T1w", "t1gd", "T2w"], "mode": "default",
                "size_multiple": 8, "normalisation": {"method": "zscore"}}
    props = convert.onnx_metadata(contract, dict(synthetic.LABELS))
    key = doc.draw(st.sampled_from(["preprocessing", "labels"]))
    props[key] = doc.draw(broken(json.loads(props[key]))).decode("utf-8", "replace")
    ends_cleanly(capsys, lambda: predict.read_contract(_Session(props), "m.onnx"))


# ---------------------------------------------------------------------------- checkpoints
tensors = st.builds(lambda shape: torch.zeros(shape),
                    st.lists(st.integers(0, 3), min_size=0, max_size=3))
checkpoint_values = json_values | tensors | st.dictionaries(st.text(max_size=6), tensors,
                                                            max_size=2)


@st.composite
def broken_checkpoint(draw, good: dict):
    """``good`` with one field (or one field of its model_config) replaced or dropped, or
    one weight resized."""
    ckpt = dict(good, model_state=dict(good["model_state"]),
                model_config=dict(good["model_config"]))
    how = draw(st.sampled_from(["field", "config", "drop", "tensor"]))
    if how == "field":
        ckpt[draw(st.sampled_from(sorted(ckpt)))] = draw(checkpoint_values)
    elif how == "config":
        ckpt["model_config"][draw(st.sampled_from(sorted(ckpt["model_config"])))] = \
            draw(scalars | st.integers(-5, 5000))
    elif how == "drop":
        del ckpt[draw(st.sampled_from(sorted(ckpt)))]
    else:
        name = draw(st.sampled_from(sorted(ckpt["model_state"])))
        ckpt["model_state"][name] = draw(tensors)
    return ckpt


@pytest.fixture(scope="module")
def model_checkpoint() -> dict:
    return {"model_state": build_model(CONFIG).state_dict(), "model_config": CONFIG.to_dict(),
            "train_config": {"fold": 0}, "format_version": 1,
            "channels": list(synthetic.MODALITIES.values()), "labels": dict(synthetic.LABELS),
            "patch_size": [24, 24]}


@settings(**SETTINGS)
@given(doc=st.data())
def test_model_checkpoint_loader(model_checkpoint, tmp_path, capsys, doc):
    model = tmp_path / "model"
    shutil.rmtree(model, ignore_errors=True)
    model.mkdir()
    if doc.draw(st.booleans()):
        torch.save(doc.draw(broken_checkpoint(model_checkpoint)), model / "best.pt")
    else:     # not a checkpoint at all
        (model / "best.pt").write_bytes(doc.draw(st.binary(max_size=64)))
    write_manifest(model, "model", "train", {})

    def read():
        ckpt = convert.load_checkpoint(model)
        convert.inference_network(ckpt, model / "best.pt")

    ends_cleanly(capsys, read)


@settings(**SETTINGS)
@given(doc=st.data())
def test_resume_checkpoint_loader(data_dir, model_checkpoint, tmp_path, capsys, doc):
    args = train.build_parser().parse_args(
        ["--dataset", str(data_dir), "--model", str(tmp_path / "m"), "--device", "cpu",
         "--base-filters", "2", "--levels", "4"])
    progress = train.Progress().to_dict()
    good = {"model_config": CONFIG.to_dict(), "model_state": model_checkpoint["model_state"],
            "optimizer_state": {"state": {}, "param_groups": []}, "scheduler_state": {},
            "scaler_state": {}, "progress": progress,
            "rng": {"torch": torch.get_rng_state(), "python": [1, 2], "python_version": 3,
                    "python_gauss": None, "numpy": ["MT19937", [1], 0, 0, 0.0]},
            "best_file": None, "train_config": {"fold": 0}, "format_version": 1}
    store = tmp_path / "store"
    shutil.rmtree(store, ignore_errors=True)
    CheckpointStore(str(store)).save(doc.draw(broken_checkpoint(good)), 1)

    def read():
        state = CheckpointStore(str(store)).load_latest()
        train.check_resumable(state, CONFIG, args, str(store))

    ends_cleanly(capsys, read)


# -------------------------------------------------------------------------------- archives
metadata_blocks = st.sampled_from([tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME,
                                   tarfile.GNUTYPE_LONGLINK, tarfile.SOLARIS_XHDTYPE])


@st.composite
def tar_with_metadata(draw) -> bytes:
    """A small valid tar whose members carry random PAX records, preceded or followed by a
    raw metadata block declaring a few bytes, 3 MiB (less than its body: read whole) or
    8 GiB, with a body of up to 4 MiB."""
    stream = io.BytesIO()
    tar = tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT)
    for index in range(draw(st.integers(1, 3))):
        info = tarfile.TarInfo(f"Task01_BrainTumour/f{index}.txt")
        body = b"x" * draw(st.integers(0, 600))
        info.size = len(body)
        info.pax_headers = draw(st.dictionaries(
            st.sampled_from(["comment", "path", "mtime", "size", "uname", "x.y"]),
            st.text(max_size=30), max_size=2))
        tar.addfile(info, io.BytesIO(body))
    members = stream.getvalue()          # before close() writes the end-of-archive blocks
    tar.close()
    block = tarfile.TarInfo("././@LongLink")
    block.type = draw(metadata_blocks)
    block.size = draw(st.integers(0, 1 << 12) | st.sampled_from([3 << 20, 1 << 33]))
    header = block.tobuf(format=tarfile.GNU_FORMAT)
    body = draw(st.binary(max_size=1024)) + bytes(draw(st.sampled_from([0, 700, 4 << 20])))
    padded = header + body + bytes(-len(body) % 512)
    ordered = [padded, members] if draw(st.booleans()) else [members, padded]
    return b"".join(ordered) + bytes(1024)


@settings(**SETTINGS)
@given(doc=st.data())
def test_tar_reader(tmp_path, capsys, doc):
    """Also bounded in memory: with a 64 KiB header limit, no example (bodies up to 4 MiB
    behind headers that declare up to 8 GiB) costs the reader 2 MiB (1 MiB of it is the
    copy buffer of one member)."""
    archive = tmp_path / "x.tar"
    archive.write_bytes(doc.draw(tar_with_metadata()))
    out = tmp_path / "out"
    shutil.rmtree(out, ignore_errors=True)
    with mock.patch.dict(os.environ, {"UNET_MAX_TAR_HEADER_BYTES": str(64 << 10)}):
        tracemalloc.start()
        try:
            ends_cleanly(capsys, lambda: download.extract_tar(archive, out, progress=False))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 2 << 20, f"the reader took {peak >> 10} KiB"
    assert sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) < 1 << 20
