"""Trust no input, round 2 (issue 24): one test group per class of the issue.

1 outputs never overlap inputs, 2 no secret echoed, 3 bad input is exit 2 with one line,
4 nothing poisoned published, 5 bounded tar headers, 6 bounded HTTP retries, 7 short error
lines, 8 one-modality images end to end, 9 clean stop on SIGTERM/SIGINT, 10 messages that say
what is wrong, 11 dependencies pinned for CI (the gzip decoders, zlib and isal, are both run by
the ``gzip_backend`` fixture of tests/conftest.py). Refusals that come before any work run in this process (``run_main`` around a
step's ``main``); what needs a real process (signals, training) runs the step's command line.
Every refusal must be exit 2 with exactly one ``error:`` line and no traceback.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import REPO, assert_one_error_line
from steps import convert, download, handoff, preprocess, quantize, synthetic, train, uris
from steps.artifacts import MANIFEST, require, write_manifest
from steps.checkpoints import CheckpointStore
from steps.errors import StepError, run_main
from steps.model import ModelConfig, build_model
from test_preprocess import make_raw, small_cases
from train_data import make_dataset, run_step, step_env
from workflows import cli

pytestmark = pytest.mark.faults
SHAPE = (32, 32, 16)
TINY_TRAIN = ["--device", "cpu", "--base-filters", "4", "--levels", "4", "--num-workers", "0",
              "--batch-size", "2", "--val-batch-size", "16", "--steps-per-epoch", "1",
              "--max-epochs", "1", "--patience", "0", "--checkpoint-minutes", "0"]
TINY_CONFIG = ModelConfig(in_channels=4, out_channels=4, base_filters=2, levels=4)


# ---- helpers ---------------------------------------------------------------------------------
def call(main, argv, capsys) -> tuple[int, str]:
    """(exit status, stderr) of a step's ``main`` under ``run_main``, as its command line."""
    try:
        status = run_main(main, [str(a) for a in argv])
    except SystemExit as exc:          # argparse's one-line usage error
        status = exc.code
    return status, capsys.readouterr().err


def refused(main, argv, capsys, *needles: str) -> str:
    status, err = call(main, argv, capsys)
    assert status == 2, err[-3000:]
    return assert_one_error_line(err, *needles)


def nifti_file(path: Path, data: np.ndarray, affine=None) -> Path:
    nib.save(nib.Nifti1Image(data, np.eye(4) if affine is None else affine), str(path))
    return path


def onnx_model(path: Path, channels: int, classes: int, **metadata: str) -> Path:
    """A 1x1-convolution ONNX model with steps.convert's metadata; ``metadata`` overrides."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(0).standard_normal((classes, channels, 1, 1))
    graph = helper.make_graph(
        [helper.make_node("Conv", ["image", "W"], ["logits"])], "foreign",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", channels, "H", "W"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes, "H", "W"])],
        [numpy_helper.from_array(weight.astype(np.float32), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    names = ["FLAIR", "T1w", "t1gd", "T2w"][:channels]
    contract = {"channels": names, "mode": "default", "size_multiple": 8,
                "normalisation": {"method": "zscore"}}
    props = convert.onnx_metadata(contract, {str(i): f"c{i}" for i in range(classes)})
    props.update(metadata)
    for key, value in sorted(props.items()):
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(path))
    return path


def fake_model(directory: Path, config: ModelConfig = TINY_CONFIG, state=None,
               **fields) -> Path:
    """A ``model`` artifact holding ``best.pt`` of ``config`` with ``fields`` replaced."""
    directory.mkdir(parents=True)
    ckpt = {"model_state": build_model(config).state_dict() if state is None else state,
            "model_config": config.to_dict(), "train_config": {"fold": 0},
            "format_version": 1, **fields}
    torch.save(ckpt, directory / "best.pt")
    write_manifest(directory, "model", "train", {})
    return directory


def deep_json(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("round2-data"), cases=5, shape="32x32x16",
                        seed=3, patch="32x32")


def dataset_copy(dataset: Path, home: Path, **changes) -> Path:
    """A copy of ``dataset`` with top-level dataset.json keys replaced, manifest rewritten."""
    copy = home / "dataset"
    shutil.copytree(dataset, copy)
    meta = json.loads((copy / "dataset.json").read_text())
    meta.update(changes)
    (copy / "dataset.json").write_text(json.dumps(meta))
    (copy / MANIFEST).unlink()
    write_manifest(copy, "dataset", "preprocess", {})
    return copy


def source_task(root: Path) -> Path:
    return synthetic.write_msd_task(root, cases=2, shape=SHAPE, seed=1, test_cases=0)


# ================================================== 1: an output never overlaps an input
def test_predict_out_equal_to_image_is_refused(tmp_path, capsys):
    model = onnx_model(tmp_path / "m.onnx", 4, 4)
    case = synthetic.generate_case(SHAPE, seed=1, index=1)
    image = nifti_file(tmp_path / "case.nii.gz", case.image, case.affine)
    before = image.read_bytes()
    link = tmp_path / "link.nii.gz"
    link.symlink_to(image)
    for out in (image, link, tmp_path / "sub" / ".." / "case.nii.gz"):
        refused(convert.main, ["predict", "--onnx", model, "--image", image, "--out", out],
                capsys, "--out", "--image")
    refused(convert.main, ["predict", "--onnx", model, "--image", image, "--out", model],
            capsys, "--out", "--onnx")
    assert image.read_bytes() == before


def test_output_inside_its_input_artifact_is_refused(dataset, tmp_path, capsys):
    """Each step's output equal to, inside or around one of its inputs, before any work;
    the input artifact still passes its own manifest afterwards."""
    raw = tmp_path / "raw"
    make_raw(raw, small_cases(2, SHAPE))
    model, exported = tmp_path / "model", tmp_path / "exported"
    table = [
        (preprocess.main, ["--raw", raw, "--dataset", raw / "ds"], "--dataset", "--raw"),
        (preprocess.main, ["--raw", raw, "--dataset", raw], "--dataset", "--raw"),
        (train.main, ["--dataset", dataset, "--model", dataset / "m", *TINY_TRAIN],
         "--model", "--dataset"),
        (train.main, ["--dataset", dataset, "--model", model, "--checkpoint-uri",
                      dataset / "ck", *TINY_TRAIN], "--checkpoint-uri", "--dataset"),
        (train.main, ["--dataset", dataset, "--model", model, "--checkpoint-uri",
                      f"file://{model}/ck", *TINY_TRAIN], "--checkpoint-uri", "--model"),
        (convert.main, ["--model", model, "--dataset", dataset, "--exported", model / "x"],
         "--exported", "--model"),
        (convert.main, ["--model", tmp_path, "--dataset", dataset, "--exported", exported],
         "--exported", "--model"),
        (quantize.main, ["--exported", exported, "--dataset", dataset, "--quantized",
                         dataset], "--quantized", "--dataset"),
    ]
    for main, argv, *needles in table:
        refused(main, argv, capsys, *needles, "overlap")
    require(raw, "raw")
    require(dataset, "dataset")
    assert not model.exists()


def test_download_into_its_file_source_is_refused(tmp_path, capsys):
    task = source_task(tmp_path / "src")
    linked = tmp_path / "linked"
    linked.symlink_to(task)
    for raw in (task / "raw", linked / "raw", task.parent):
        refused(download.main, ["--source", f"file://{task}", "--raw", raw, "--no-progress"],
                capsys, "--raw", "--source", "overlap")
    assert not (task / "raw").exists()


# ======================================================================= 2: no secret echoed
SECRET = "hunter2-secret"


def test_credentials_in_a_source_url_are_refused_and_never_echoed(tmp_path, capsys):
    for uri in (f"http://user:{SECRET}@127.0.0.1:9/Task01_BrainTumour.tar",
                f"https://{SECRET}@example.invalid/x.tar",
                f"http://user:{SECRET}@[::1/x.tar"):
        line = refused(download.main, ["--source", uri, "--raw", tmp_path / "raw",
                                       "--no-progress"], capsys, "--source", "credentials")
        assert SECRET not in line
    assert not (tmp_path / "raw").exists()


@pytest.mark.parametrize("mark", ["/", "#", "?"])
def test_a_password_with_an_unescaped_delimiter_is_refused_and_never_echoed(mark, tmp_path,
                                                                          capsys):
    """``/``, ``#`` or ``?`` in a password ends the authority for urlsplit before its '@', so
    the URL read as host 'user', port '<first part>': the whole of it was echoed."""
    cut = len(SECRET) // 2
    uri = f"https://user:{SECRET[:cut]}{mark}{SECRET[cut:]}@127.0.0.1:9/Task01_BrainTumour.tar"
    line = refused(download.main, ["--source", uri, "--raw", tmp_path / "raw", "--no-progress"],
                   capsys, "--source", "credentials")
    assert SECRET[:cut] not in line and SECRET[cut:] not in line
    assert uris.redact(f"see {uri} ") == "see https://***@127.0.0.1:9/Task01_BrainTumour.tar "


@pytest.mark.parametrize("url", ["https://host:8080/a@b.tar", "http://127.0.0.1:9/x@y/z.tar",
                                 "s3://bucket/user@example.org/x.tar", "https://h/a:b@c"])
def test_an_at_sign_in_a_path_is_not_taken_for_credentials(url):
    assert not uris.has_credentials(url) and uris.redact(url) == url


@pytest.mark.parametrize("key", ["pass", "passwd", "pwd", "password", "token", "X-Amz-Signature"])
def test_a_secret_looking_query_value_is_redacted(key):
    assert uris.redact(f"https://h/x.tar?{key}={SECRET}&a=1") == f"https://h/x.tar?{key}=***&a=1"


@pytest.mark.parametrize("text", [("https://a:" + "b" * 50) * 20_000,
                                  ("https://a:" + "b" * 50) * 20_000 + "@",
                                  "https://x" * 150_000 + ":"])
def test_redaction_takes_linear_time_on_a_megabyte_line(text):
    """A backtracking rule took minutes on the first of these (quadratic in the run)."""
    started = time.monotonic()
    uris.redact(text), uris.has_credentials(text)
    assert time.monotonic() - started < 5


def test_a_local_runs_s3_endpoint_with_credentials_is_refused_without_echo(monkeypatch,
                                                                          tmp_path, capsys):
    """The local runner printed it, recorded it in result.json and handed it to every step."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://key:{SECRET}@127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-key")
    status, err = call(cli.main, ["run", "--local", "--run-dir", tmp_path / "run",
                                  "--output-dir", tmp_path / "out"], capsys)
    assert status == 2 and SECRET not in err
    assert_one_error_line(err, "AWS_ENDPOINT_URL", "credentials in a URL are not accepted")
    for path in tmp_path.rglob("*"):
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path


def test_render_refuses_a_source_with_credentials(tmp_path, capsys):
    out = tmp_path / "wf.yaml"
    status, err = call(cli.main, ["render", "-o", out, "-p",
                                  f"download.source=https://u:{SECRET}@h.example/x.tar"], capsys)
    assert status == 2 and SECRET not in err
    assert_one_error_line(err, "download.source")
    assert not out.exists()


def test_argo_server_with_a_password_is_refused_without_echo(monkeypatch, capsys):
    monkeypatch.setenv("ARGO_SERVER", f"https://admin:{SECRET}@127.0.0.1:9")
    status, err = call(cli.main, ["submit"], capsys)
    assert status == 2 and SECRET not in err
    assert_one_error_line(err, "ARGO_SERVER")


def test_s3_endpoint_with_credentials_is_refused_without_echo(monkeypatch, tmp_path, capsys):
    from steps import storage

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://key:{SECRET}@127.0.0.1:9")
    with pytest.raises(StepError) as info:
        storage.client_for("s3://bucket/key")
    assert SECRET not in str(info.value) and "AWS_ENDPOINT_URL" in str(info.value)


# =================================================== 3: bad input is exit 2, one line
def test_deeply_nested_json_is_refused_in_every_reader(dataset, tmp_path, capsys):
    deep = deep_json(100_000)
    task = source_task(tmp_path / "src")
    (task / "dataset.json").write_text(deep)
    refused(download.main, ["--source", f"file://{task}", "--raw", tmp_path / "raw",
                            "--no-progress"], capsys, "dataset.json", "nest")
    copy = tmp_path / "copy"
    shutil.copytree(dataset, copy)
    (copy / MANIFEST).write_text(deep)
    refused(handoff.main, ["verify", "--artifact", "dataset", copy], capsys, MANIFEST, "nest")
    model = onnx_model(tmp_path / "m.onnx", 4, 4, preprocessing=deep)
    image = nifti_file(tmp_path / "c.nii.gz", np.ones((8, 8, 8, 4), np.float32))
    refused(convert.main, ["predict", "--onnx", model, "--image", image, "--out",
                           tmp_path / "o.nii.gz"], capsys, "--onnx", "nest")


def test_dataset_metadata_of_the_wrong_type_is_refused(dataset, tmp_path, capsys):
    for i, change in enumerate([{"image_dtype": "bogus"}, {"image_dtype": ["float16"]},
                                {"mode": 7}, {"channels": [1, 2, 3, 4]},
                                {"patch_size": [32, "32"]}, {"normalisation": "zscore"},
                                {"folds": [{"train": "abc", "val": []}]}]):
        copy = dataset_copy(dataset, tmp_path / str(i), **change)
        refused(train.main, ["--dataset", copy, "--model", tmp_path / str(i) / "m",
                             *TINY_TRAIN], capsys, "dataset.json", next(iter(change)))


@pytest.mark.parametrize("field, value", [
    ("model_config", {**TINY_CONFIG.to_dict(), "norm": "bogus"}),
    ("model_config", {**TINY_CONFIG.to_dict(), "deep_supervision_heads": -1}),
    ("model_config", {**TINY_CONFIG.to_dict(), "levels": "4"}),
    ("model_config", {**TINY_CONFIG.to_dict(), "base_filters": 1_000_000}),
    ("model_config", [1, 2]),
    ("train_config", {"fold": "one"}),
    ("train_config", {"fold": 9}),
    ("channels", "FLAIR"),
    ("format_version", "1"),
])
def test_checkpoint_fields_of_the_wrong_type_are_refused(field, value, dataset, tmp_path,
                                                         capsys):
    model = fake_model(tmp_path / "model", **{field: value})
    start = time.monotonic()
    refused(convert.main, ["--model", model, "--dataset", dataset, "--exported",
                           tmp_path / "exported"], capsys, "best.pt", field)
    assert time.monotonic() - start < 30


def test_checkpoint_with_missing_keys_or_wrong_shapes_is_refused_on_resume(dataset, tmp_path,
                                                                           capsys):
    config = ModelConfig(in_channels=4, out_channels=4, base_filters=4, levels=4)
    good = {"model_config": config.to_dict(), "model_state": build_model(config).state_dict(),
            "train_config": {"fold": 0}, "format_version": 1}
    wrong = dict(good, model_state={k: torch.zeros(1) for k in good["model_state"]})
    for i, state in enumerate([good, wrong]):
        store = tmp_path / f"store{i}"
        CheckpointStore(str(store)).save(state, 1)
        refused(train.main, ["--dataset", dataset, "--model", tmp_path / f"m{i}",
                             "--resume-from", store, *TINY_TRAIN], capsys, "checkpoint")


def test_model_card_of_the_wrong_type_is_refused(dataset, tmp_path, capsys):
    for i, card in enumerate([{"size_multiple": 0}, {"size_multiple": "8"}, [8],
                              {"size_multiple": 8, "training": {"config": {"fold": "x"}}}]):
        exported = tmp_path / f"e{i}"
        exported.mkdir()
        (exported / quantize.CARD_FILE).write_text(json.dumps(card))
        onnx_model(exported / quantize.FP32_FILE, 4, 4)
        write_manifest(exported, "exported", "convert", {})
        refused(quantize.main, ["--exported", exported, "--dataset", dataset, "--quantized",
                                tmp_path / f"q{i}"], capsys, quantize.CARD_FILE)


@pytest.mark.parametrize("flag, value", [
    ("--learning-rate", "nan"), ("--weight-decay", "inf"), ("--checkpoint-minutes", "nan"),
    ("--seed", str(2 ** 80)), ("--base-filters", "1000000"),
])
def test_train_flags_out_of_range_are_refused(flag, value, dataset, tmp_path, capsys):
    refused(train.main, ["--dataset", dataset, "--model", tmp_path / "m", *TINY_TRAIN,
                         flag, value], capsys, flag)


def test_patch_that_degenerates_the_network_is_refused(dataset, tmp_path, capsys):
    """32x32 patches with 6 levels leave 1x1 at the bottom: instance norm cannot train."""
    argv = ["--dataset", dataset, "--model", tmp_path / "m", *TINY_TRAIN]
    refused(train.main, argv + ["--levels", "6"], capsys, "--levels", "patch")
    refused(train.main, argv + ["--norm", "group"], capsys, "--norm")


def test_huge_patch_size_is_refused_before_allocating(tmp_path, capsys):
    raw = tmp_path / "raw"
    make_raw(raw, small_cases(2, SHAPE))
    refused(preprocess.main, ["--raw", raw, "--dataset", tmp_path / "ds", "--patch-size",
                              "100000x100000"], capsys, "--patch-size")


@pytest.mark.parametrize("override", ["train.seed=1208925819614629174706176",
                                      "train.weight_decay=inf", "train.learning_rate=nan",
                                      "quantize.calibration_seed=99999999999999999999"])
def test_render_refuses_values_that_would_crash_the_pod(override, tmp_path, capsys):
    status, err = call(cli.main, ["render", "-o", tmp_path / "x.yaml", "-p", override], capsys)
    assert status == 2, err
    assert_one_error_line(err, override.split("=")[0])


@pytest.mark.parametrize("encoding", ["latin-1", "utf-16"])
def test_config_file_not_in_utf8_is_refused(encoding, tmp_path, capsys):
    text = (REPO / "config" / "pipeline.yaml").read_text() + "# Größe\n"
    config = tmp_path / "pipeline.yaml"
    config.write_bytes(text.encode(encoding))
    status, err = call(cli.main, ["render", "--config", config], capsys)
    assert status == 2
    assert_one_error_line(err, "pipeline.yaml", "UTF-8")


def test_render_into_a_missing_folder_is_refused(tmp_path, capsys):
    status, err = call(cli.main, ["render", "-o", tmp_path / "missing" / "wf.yaml"], capsys)
    assert status == 2
    assert_one_error_line(err, "missing")


def test_cache_dir_that_cannot_be_created_is_refused(tmp_path, capsys):
    refused(download.main, ["--source", "http://127.0.0.1:9/Task01_BrainTumour.tar",
                            "--raw", tmp_path / "raw", "--cache-dir", "/proc/unet-cache",
                            "--no-progress"], capsys, "--cache-dir")


class _Http(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, handler):
        super().__init__(("127.0.0.1", 0), handler)
        self.requests = 0
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/Task01_BrainTumour.tar"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


def _handler(respond):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args):
            pass

        def do_GET(self):
            self.server.requests += 1
            try:
                respond(self)
            except (BrokenPipeError, ConnectionResetError):
                pass
    return Handler


def _declares(length: str, body: bytes):
    """A responder that sends ``body`` under the header ``Content-Length: length``."""
    def respond(h):
        h.send_response(200)
        h.send_header("Content-Length", length)
        h.end_headers()
        h.wfile.write(body)
    return respond


def test_content_length_that_is_not_a_number_is_refused(tmp_path, capsys):
    server = _Http(_handler(_declares("twelve", b"x" * 12)))
    try:
        refused(download.main, ["--source", server.url, "--raw", tmp_path / "raw", "--md5", "",
                                "--no-progress"], capsys, "Content-Length")
    finally:
        server.close()


# ============================================== 4: nothing poisoned is published
def _raw_with_image(home: Path, image: np.ndarray) -> Path:
    raw = home / "raw"
    cases = small_cases(2, SHAPE)
    name = sorted(cases)[0]
    _, label, affine, slope = cases[name]
    cases[name] = (image, label, affine, slope)
    make_raw(raw, cases)
    return raw


def test_voxels_beyond_float32_are_not_published(tmp_path, capsys):
    """float64 voxels of 1e39 become Inf in float32; 1e200 overflowed the statistics and was
    refused as '0 NaN/Inf voxels' (class 10)."""
    base, _, _, _ = small_cases(2, SHAPE)["BRATS_001"]
    for value in (1e39, 1e200):
        image = base.astype(np.float64)
        image[10, 10, 5, 0] = value
        home = tmp_path / f"v{value:g}"
        raw = _raw_with_image(home, image)
        line = refused(preprocess.main, ["--raw", raw, "--dataset", home / "ds",
                                         "--patch-size", "32x32"], capsys, "BRATS_001",
                       "float32")
        assert "0 NaN/Inf" not in line and f"{value:g}" in line
        assert not (home / "ds").exists() or not any((home / "ds").iterdir())


def test_label_set_that_train_refuses_is_not_published(tmp_path, capsys):
    """labels {0, 2}: train needs '0'..'N-1'; preprocess (and download) refuse it first."""
    raw = tmp_path / "raw"
    cases = {n: (image, np.where(label > 0, 2, 0).astype(np.uint8), affine, slope)
             for n, (image, label, affine, slope) in small_cases(2, SHAPE).items()}
    task = make_raw(raw, cases)
    spec = json.loads((task / "dataset.json").read_text())
    spec["labels"] = {"0": "background", "2": "tumour"}
    (task / "dataset.json").write_text(json.dumps(spec))
    (raw / MANIFEST).unlink()
    write_manifest(raw, "raw", "download", {})
    refused(preprocess.main, ["--raw", raw, "--dataset", tmp_path / "ds", "--patch-size",
                              "32x32"], capsys, "labels")
    refused(download.main, ["--source", f"file://{task}", "--raw", tmp_path / "raw2",
                            "--no-progress"], capsys, "labels")


def test_opset_the_exporter_cannot_honour_is_refused(dataset, tmp_path, capsys):
    model = fake_model(tmp_path / "model")
    refused(convert.main, ["--model", model, "--dataset", dataset, "--exported",
                           tmp_path / "x", "--opset", "9999"], capsys, "--opset", "9999")


@pytest.mark.slow
def test_diverged_weights_and_other_folds_are_not_published(dataset, tmp_path):
    """A run whose weights overflow publishes nothing; a checkpoint of fold 0 does not
    resume under fold 1 (its validation would run on training cases)."""
    diverge = ["--learning-rate", "1", "--weight-decay", "1e30", "--steps-per-epoch", "3"]
    done = run_step("train", "--dataset", str(dataset), "--model", str(tmp_path / "m1"),
                    *TINY_TRAIN, *diverge)
    assert done.returncode == 2, done.stderr[-2000:]
    assert_one_error_line(done.stderr, "NaN/Inf")
    assert not (tmp_path / "m1").exists() or not any((tmp_path / "m1").iterdir())
    store = tmp_path / "ck"
    done = run_step("train", "--dataset", str(dataset), "--model", str(tmp_path / "m2"),
                    "--checkpoint-uri", str(store), *TINY_TRAIN)
    assert done.returncode == 0, done.stderr[-2000:]
    done = run_step("train", "--dataset", str(dataset), "--model", str(tmp_path / "m3"),
                    "--resume-from", str(store), "--fold", "1", *TINY_TRAIN)
    assert done.returncode == 2, done.stderr[-2000:]
    assert_one_error_line(done.stderr, "fold")


# ===================================================== 5: bounded archive headers
def _header_bomb(kind: bytes, declared: int, present: int) -> bytes:
    """A .tar.gz whose first header is a ``kind`` metadata block (PAX 'x', global PAX 'g',
    GNU long name 'L') declaring ``declared`` bytes, followed by ``present`` zero bytes."""
    info = tarfile.TarInfo("././@PaxHeader")
    info.type, info.size = kind, declared
    block = info.tobuf(format=tarfile.USTAR_FORMAT if declared < 8 ** 11 else tarfile.GNU_FORMAT)
    stream = io.BytesIO()
    with gzip.GzipFile(fileobj=stream, mode="wb", compresslevel=1) as gz:
        gz.write(block)
        zeros = bytes(1 << 20)
        for _ in range(present >> 20):
            gz.write(zeros)
    return stream.getvalue()


@pytest.mark.parametrize("kind", [tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME])
def test_tar_metadata_headers_are_bounded(kind, tmp_path):
    archive = tmp_path / "bomb.tar.gz"
    archive.write_bytes(_header_bomb(kind, 2 << 30, 64 << 20))
    assert archive.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(StepError, match="header") as info:
            download.extract_tar(archive, tmp_path / "out", progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"reading the header took {peak >> 20} MiB"
    assert "max_tar_header_bytes" in str(info.value)


# =============================================================== 6: bounded HTTP retries
def test_http_retries_are_bounded_with_backoff(tmp_path):
    """A server that always closes halfway (and ignores Range) is given up on after a bounded
    number of requests, with backoff between them."""
    def respond(h):
        if h.server.requests > 60:          # stops the old unbounded loop
            h.send_error(404)
            return
        h.send_response(200)
        h.send_header("Content-Length", "200000")
        h.end_headers()
        h.wfile.write(b"x" * 100000)

    server = _Http(_handler(respond))
    dest = tmp_path / "x.tar"
    try:
        start = time.monotonic()
        with pytest.raises(StepError, match="attempts") as info:
            download.http_download(server.url, dest, retries=4, backoff_s=0.05, progress=False)
        seconds = time.monotonic() - start
    finally:
        server.close()
    assert server.requests == 5, server.requests
    assert seconds >= 0.05 * (1 + 2 + 4 + 8) * 0.9, seconds
    assert "without progress" in str(info.value)


def test_http_download_has_a_total_time_budget(tmp_path):
    server = _Http(_handler(_declares("100", b"x" * 10)))
    try:
        start = time.monotonic()
        with pytest.raises(StepError, match="budget"):
            download.http_download(server.url, tmp_path / "x", retries=100, backoff_s=0.2,
                                   budget_s=1.0, progress=False)
        assert time.monotonic() - start < 5
    finally:
        server.close()


# ================================================================== 7: short error lines
def test_error_lines_quote_a_bounded_amount(tmp_path, capsys):
    task = source_task(tmp_path / "src")
    spec = json.loads((task / "dataset.json").read_text())
    spec["training"][0]["image"] = "../" + "x" * (5 << 20)
    (task / "dataset.json").write_text(json.dumps(spec))
    line = refused(download.main, ["--source", f"file://{task}", "--raw", tmp_path / "raw",
                                   "--no-progress"], capsys, "dataset.json")
    assert len(line) < 1000, len(line)
    status, err = call(download.main, ["--source", "synthetic://?" + "a" * (1 << 20),
                                       "--raw", tmp_path / "raw"], capsys)
    assert status == 2 and len(err) < 1000


# ======================================================= 8: one-modality (3-D) images
def test_one_modality_image_runs_through_predict(tmp_path, capsys):
    model = onnx_model(tmp_path / "m.onnx", 1, 2)
    case = synthetic.generate_case(SHAPE, seed=1, index=1)
    image = nifti_file(tmp_path / "t2.nii.gz", case.image[..., 0], case.affine)
    out = tmp_path / "label.nii.gz"
    status, err = call(convert.main, ["predict", "--onnx", model, "--image", image, "--out",
                                      out], capsys)
    assert status == 0, err[-3000:]
    assert nib.load(str(out)).shape == SHAPE


# ====================================================================== 9: clean stop
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopped_download_leaves_nothing_in_its_output(sig, tmp_path):
    started = threading.Event()

    member = tarfile.TarInfo("Task01_BrainTumour/imagesTr/a.nii.gz")
    member.size = 100 << 20

    def respond(h):                   # a tar whose first member is still arriving
        h.send_response(200)
        h.send_header("Content-Length", str(101 << 20))
        h.end_headers()
        h.wfile.write(member.tobuf() + b"x" * 65536)
        started.set()
        time.sleep(30)

    server = _Http(_handler(respond))
    raw = tmp_path / "raw"
    try:
        proc = subprocess.Popen([sys.executable, "-m", "steps.download", "--source",
                                 server.url, "--raw", str(raw), "--md5", "", "--no-progress"],
                                cwd=REPO, env=step_env(), stderr=subprocess.PIPE, text=True)
        assert started.wait(60), "the download never started"
        deadline = time.monotonic() + 30
        while not [p for p in raw.rglob("*") if p.is_file()] and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        server.close()
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err
    assert_one_error_line(err, signal.Signals(sig).name)
    assert not raw.exists(), sorted(raw.rglob("*"))   # the folder the step made is gone


@pytest.mark.slow
def test_stopped_ddp_train_stops_every_rank_and_publishes_nothing(tmp_path):
    """SIGTERM to the step (what Argo's deadline or stop sends to the container's process)
    while its relaunched ranks train: the ranks get it too and unwind, none outlives the step,
    no traceback (torchrun's own included), no model, the last checkpoint intact."""
    dataset = make_dataset(tmp_path, cases=5, shape="32x32x12", seed=1, patch="32x32")
    model, ck = tmp_path / "model", tmp_path / "ck"
    proc = subprocess.Popen(
        [sys.executable, "-m", "steps.train", "--dataset", str(dataset), "--model", str(model),
         "--device", "cpu", "--devices", "2", "--batch-size", "4", "--base-filters", "4",
         "--levels", "4", "--steps-per-epoch", "50", "--max-epochs", "100", "--patience", "0",
         "--num-workers", "0", "--checkpoint-uri", str(ck)],
        cwd=REPO, env=step_env(), stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while not (ck / "latest").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, "train ended before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert lines and all("stopped by SIGTERM" in line for line in lines), lines
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)            # no rank, no launcher left in the step's group
    assert not model.exists() or not list(model.iterdir()), sorted(model.rglob("*"))
    assert CheckpointStore(str(ck)).load_latest()["progress"]["step"] > 0


# ============================================== 11: dependencies that move under us
def test_ci_constraints_pin_every_declared_dependency():
    """.ci/run installs from .ci/constraints.txt: a dependency added to pyproject.toml without
    a refresh (.ci/refresh-constraints) would be resolved unpinned in CI."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        declared += extra
    names = {canonicalize_name(Requirement(r).name) for r in declared} - {"unet-argo"}
    pinned = {canonicalize_name(line.split("==")[0])
              for line in (REPO / ".ci" / "constraints.txt").read_text().splitlines()
              if line and not line.startswith("#")}
    assert names and not names - pinned, sorted(names - pinned)
