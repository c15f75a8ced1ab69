"""Trust no input, round 3 (issue 37), each class: 1 a model is untrusted at run time, 2 a
planted cache folder, 3 a step deletes only what it made, 4 no secret in any error line, 5 a
slow server, 6 redirects stay on the schemes we speak, 7 the config means what it says, 8 error
lines are lines, 9 the cases left from the earlier sets. Each refusal is exit 2 with exactly
one ``error:`` line at the start of a line, no traceback, no secret."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import botocore.exceptions as bexc
import numpy as np
import pytest
import torch
from tqdm import tqdm

from conftest import REPO, assert_one_error_line, error_lines
from steps import (checkpoints, convert, download, handoff, limits, nifti, predict, quantize,
                   schemas, storage, train)
from steps.artifacts import write_manifest
from steps.errors import StepError, one_line, run_main
from test_untrusted_inputs import _handler, _Http, call, fake_model, nifti_file, onnx_model
from train_data import make_dataset
from workflows import cli

CONFIG = (REPO / "config" / "pipeline.yaml").read_text()

pytestmark = pytest.mark.faults

TOKEN = "FQoGZXIvYXdzEJr//////////wEaDLmVsbn0KsDnqHvH5SKoAd" + "x" * 40


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _refused_leaving(root: Path, main, argv, capsys, *needles: str) -> str:
    """``refused``, and the step made, removed or renamed nothing under ``root`` (its output,
    a staging folder, a cache or temporary file beside it): its stderr."""
    before = _tree(root)
    status, err = call(main, argv, capsys)
    assert status == 2, err[-3000:]
    assert_one_error_line(err, *needles)
    assert _tree(root) == before, "the refused step left files behind"
    return err


# ================================================= 2: a cache or work folder can be planted
def _source_server(body: bytes, etag: str = '"v1"'):
    """A server of ``body`` that honours Range; it records every request's If-Range."""
    def respond(h):
        h.server.if_range.append(h.headers.get("If-Range"))
        start = int(h.headers["Range"][6:-1]) if h.headers.get("Range") else 0
        h.send_response(206 if start else 200)
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        h.send_header("Content-Length", str(len(body) - start))
        h.send_header("ETag", etag)
        h.end_headers()
        h.wfile.write(body[start:])
    server = _Http(_handler(respond))
    server.if_range = []
    return server


def _cached_download(tmp_path: Path, capsys, body: bytes, plant,
                     *needles: str) -> tuple[str, object]:
    """Run the download of ``body`` from a fresh server with ``plant(name_in_cache)`` called
    first on its cache folder; it is refused with ``needles`` and leaves no output:
    (stderr, the server)."""
    server = _source_server(body)
    cache = tmp_path / "cache"
    cache.mkdir()
    name = download.cache_name(download.parse_source(server.url))
    try:
        plant(lambda suffix: cache / (name + suffix))
        status, err = call(download.main, ["--source", server.url, "--raw", tmp_path / "raw",
                                           "--md5", "", "--cache-dir", cache, "--no-progress"],
                           capsys)
    finally:
        server.close()
    assert status == 2, err[-3000:]
    assert_one_error_line(err, *needles)
    assert not (tmp_path / "raw").exists()
    return err, server


def test_a_partial_download_planted_as_a_link_is_refused_and_its_target_untouched(tmp_path,
                                                                                  capsys):
    host_file = tmp_path / "host-file"
    host_file.write_text("precious")
    _, server = _cached_download(tmp_path, capsys, b"x" * 1000,
                                 lambda at: at(".part").symlink_to(host_file),
                                 "not a regular file")
    assert host_file.read_text() == "precious" and server.requests == 0


@pytest.mark.parametrize("planted", ["link", "garbage"])
def test_a_planted_validator_is_never_sent(planted, tmp_path, capsys):
    host_file = tmp_path / "host-secret"
    host_file.write_text('"host-secret-content"')

    def plant(at):
        at(".part").write_bytes(b"not a tar" * 10)
        if planted == "link":
            at(".part.validator").symlink_to(host_file)
        else:
            at(".part.validator").write_text('"v1"\r\nX-Injected: yes')

    err, server = _cached_download(tmp_path, capsys, b"not a tar" * 100, plant,
                                   "is not a readable tar archive")
    assert server.if_range == [None], server.if_range      # started over, nothing sent
    assert host_file.read_text() == '"host-secret-content"'
    assert "host-secret" not in err


# ================================================= 6: redirects stay on the schemes we speak
def _redirect_to(target):
    def respond(h):
        h.send_response(302)
        h.send_header("Location", target(h))
        h.send_header("Content-Length", "0")
        h.end_headers()
    return respond


@pytest.mark.parametrize("target, needle", [
    (lambda h: "ftp://127.0.0.1/Task01_BrainTumour.tar", "to the scheme 'ftp'"),
    (lambda h: "file:///etc/passwd", "Redirection to url 'file:///etc/passwd' is not allowed"),
    (lambda h: f"http://127.0.0.1:{h.server.server_address[1]}/again{h.server.requests}",
     "more than 5 times"),
])
def test_redirects_leave_only_for_http_and_https_and_say_why(target, needle, tmp_path, capsys):
    server = _Http(_handler(_redirect_to(target)))
    try:
        err = _refused_leaving(tmp_path, download.main, ["--source", server.url, "--raw",
                                                         tmp_path / "raw", "--md5", "",
                                                         "--no-progress"], capsys, needle, "302")
    finally:
        server.close()
    assert server.requests <= 6 and not error_lines(err)[0].endswith(": ")


def test_a_redirect_to_a_url_with_credentials_is_refused_without_echoing_them(tmp_path, capsys):
    """http.client took the password for a port and put it in its error line (``nonnumeric
    port: 'S3cretPassw0rd@127.0.0.1'``), which no URL redaction can find."""
    server = _Http(_handler(_redirect_to(lambda h: "http://alice:S3cretPassw0rd@127.0.0.1/x.tar")))
    try:
        err = _refused_leaving(tmp_path, download.main, ["--source", server.url, "--raw",
                                                         tmp_path / "raw", "--md5", "",
                                                         "--no-progress"], capsys,
                               "302 redirects to a URL with credentials in it")
    finally:
        server.close()
    assert "S3cretPassw0rd" not in err and "alice" not in err
    assert server.requests == 1


def test_a_redirect_from_https_down_to_http_is_refused():
    from urllib.request import Request
    handler = download._Redirects()
    with pytest.raises(StepError, match="from https down to http"):
        handler.redirect_request(Request("https://example.org/a.tar"), None, 302, "Found", {},
                                 "http://example.org/a.tar")
    assert handler.redirect_request(Request("http://example.org/a.tar"), None, 302, "Found",
                                    {}, "https://example.org/a.tar") is not None


# ======================================== 5: a slow server cannot hold a step for ever
def _trickle(h):
    """A 1 MB body announced whole, sent a byte every 50 ms."""
    h.send_response(200)
    h.send_header("Content-Length", str(1 << 20))
    h.end_headers()
    for _ in range(1 << 20):
        h.wfile.write(b"x")
        h.wfile.flush()
        time.sleep(0.05)


def test_a_trickling_body_is_a_stall_and_the_download_has_a_total_budget(tmp_path, capsys,
                                                                       monkeypatch):
    monkeypatch.setenv("UNET_HTTP_STALL_SECONDS", "1")
    monkeypatch.setenv("UNET_HTTP_WINDOW_BYTES", "1000")
    monkeypatch.setenv("UNET_HTTP_BUDGET_SECONDS", "4")
    server = _Http(_handler(_trickle))
    started = time.monotonic()
    try:
        err = _refused_leaving(tmp_path, download.main, ["--source", server.url, "--raw",
                                                         tmp_path / "raw", "--md5", "",
                                                         "--no-progress"], capsys, "time budget")
    finally:
        server.close()
    assert time.monotonic() - started < 15
    assert server.requests >= 2, "a stalled attempt is retried"
    line = error_lines(err)[0]
    assert "stalled" in line or "ran past" in line


# ============================================== 3: a step deletes only what it made
def test_checkpoint_pruning_leaves_a_users_files_alone(tmp_path):
    folder = tmp_path / "ck"
    folder.mkdir()
    theirs = ["best-epoch-notes.txt", "best-epoch0001.pt.bak", ".my-editor.tmp",
              ".ckpt-0000000001.pt.tmp", "ckpt-notes.pt", "README", "latest.txt"]
    for name in theirs:
        (folder / name).write_text("the user's")
    store = checkpoints.CheckpointStore(str(folder))
    ours_killed = folder / ".ckpt-0000000003.pt.abcd1234.tmp"     # a write killed mid-way
    ours_killed.write_bytes(b"partial")
    for step in (1, 2, 3, 4):
        store.write_bytes(checkpoints.best_name(step), b"best")
        store.save({"best_file": checkpoints.best_name(step)}, step)
    left = sorted(p.name for p in folder.iterdir())
    assert left == sorted(theirs + ["ckpt-0000000003.pt", "ckpt-0000000004.pt",
                                    "best-epoch0004.pt", "latest"])
    assert all((folder / name).read_text() == "the user's" for name in theirs)


# ========================================= 4: no secret in any error line, whatever the library
@pytest.mark.parametrize("action", ["fetch", "push"])
def test_credentials_with_control_characters_are_refused_unprinted(action, monkeypatch,
                                                                   tmp_path, capsys, s3_env):
    prefix, artifact = f"round3-{action}/", tmp_path / "artifact"
    uri = f"s3://{s3_env.bucket}/{prefix}"
    if action == "push":
        artifact.mkdir()
        (artifact / "a.bin").write_bytes(b"x" * 10)
        write_manifest(artifact, "model", "train", {})
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN[:30] + "\r\n" + TOKEN[30:])
    places = [uri, artifact] if action == "fetch" else [artifact, uri]
    err = _refused_leaving(tmp_path, handoff.main, [action, "--artifact", "model", *places],
                           capsys, "AWS_SESSION_TOKEN holds whitespace or control")
    assert TOKEN[:30] not in err and TOKEN[30:] not in err, err
    listed = s3_env.client().list_objects_v2(Bucket=s3_env.bucket, Prefix=prefix)
    assert listed["KeyCount"] == 0, "nothing is uploaded"


@pytest.mark.parametrize("quoted", [
    lambda t: f"Invalid header value b'{t[:30]}\\r\\n{t[30:]}'",     # escaped, split at CRLF
    lambda t: f"header: {t[:30]}\r\n{t[30:]}",                        # raw, split at CRLF
    lambda t: f"token {t!r}",
])
def test_every_form_of_a_secret_is_redacted_from_library_errors(quoted, monkeypatch):
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN[:30] + "\r\n" + TOKEN[30:])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-" + "k" * 33)
    text = storage._scrub(quoted(TOKEN) + " and s3cr3t-" + "k" * 33)
    assert TOKEN[:30] not in text and TOKEN[30:] not in text and "s3cr3t-" not in text, text
    assert "***" in text and "\n" not in text


def test_a_botocore_error_quoting_the_token_comes_out_redacted(monkeypatch):
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    exc = bexc.ClientError({"Error": {"Code": "InvalidRequest",
                                      "Message": f"The provided token {TOKEN} is malformed"}},
                           "GetObject")
    s3 = storage.client(anonymous=True, endpoint_url="http://127.0.0.1:9")
    with pytest.raises(StepError) as caught, storage._errors(s3, "s3://bucket/key", "reading"):
        raise exc
    assert TOKEN not in str(caught.value) and "***" in str(caught.value)


# ============================================================ 7: the config means what it says
def _render_refused(tmp_path: Path, capsys, text: str, *needles: str, overrides=()) -> None:
    """``render -o`` of the config ``text`` is refused with ``needles`` and writes nothing."""
    config = tmp_path / "pipeline.yaml"
    config.write_text(text)
    _refused_leaving(tmp_path, cli.main, ["render", "--config", config, "-o",
                                          tmp_path / "wf.yaml",
                                          *[a for o in overrides for a in ("-p", o)]],
                     capsys, *needles)


def test_a_key_given_twice_is_an_error(tmp_path, capsys):
    assert "\ntrain:\n  devices: 8 " in CONFIG
    text = CONFIG.replace("\ntrain:\n", "\ntrain:\n  devices: 2\n", 1)
    _render_refused(tmp_path, capsys, text, "'devices' is given twice")


@pytest.mark.parametrize("word", ["yes", "no", "on", "off"])
def test_yaml_1_1_booleans_are_not_numbers(word, tmp_path, capsys):
    text = CONFIG.replace("\ntrain:\n  devices: 8 ", f"\ntrain:\n  devices: {word} ", 1)
    _render_refused(tmp_path, capsys, text, "train.devices")


def test_a_number_given_as_a_boolean_is_refused(tmp_path, capsys):
    _render_refused(tmp_path, capsys, CONFIG.replace(
        "\ntrain:\n", "\ntrain:\n  max_epochs: true\n", 1),
        "train.max_epochs", "not the boolean true")


@pytest.mark.parametrize("override, needle", [
    ("download.source=synthetic://?cases=2&color=red", "unknown parameter 'color'"),
    ("download.source=synthetic://?cases=2&cases=3", "'cases' is given twice"),
    ("download.source=synthetic://?shape=8x8x8", "smaller than the minimum"),
    ("resources.extra_env.NOTE=a\u202eb", "format characters"),
    ("storage.models_prefix=" + "m/" * 300 + "x", "storage.models_prefix"),
    ("train.resume_from=s3://bucket/" + "k" * 1100, "more than the 1024 S3 allows"),
])
def test_render_refuses_what_the_step_would(override, needle, tmp_path, capsys):
    _render_refused(tmp_path, capsys, CONFIG, needle, overrides=[override])


# ============================================================ 8: error lines are lines
def test_format_characters_are_escaped_in_error_lines():
    line = one_line("case\u202egz.iin\u2066 \u200bname\ufeff \u00ad é 日本")
    for char in "\u202e\u2066\u200b\ufeff\u00ad":
        assert char not in line
    assert "\\u202e" in line and "\\u2066" in line and "é 日本" in line


def test_an_error_after_a_progress_bar_starts_its_own_line(capsys):
    def main(argv):
        bar = tqdm(total=10, file=sys.stderr, leave=False, mininterval=0)
        bar.update(3)
        bar.close()              # leave=False: the bar is cleared with carriage returns only
        raise StepError("the hand-off failed")

    assert run_main(main, []) == 2
    err = capsys.readouterr().err
    assert "\nerror: the hand-off failed\n" in err or err.startswith("error:"), repr(err)
    assert [line for line in err.split("\n") if "error:" in line] == \
        ["error: the hand-off failed"]


def test_a_manifest_over_the_json_limit_is_refused_before_it_is_read(monkeypatch, tmp_path,
                                                                    s3_env):
    s3 = s3_env
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    (artifact / "a.bin").write_bytes(b"x" * 10)
    write_manifest(artifact, "model", "train", {"pad": "y" * 5000})
    bucket = "round3"
    client = storage.client()
    client.create_bucket(Bucket=bucket)
    storage.upload_dir(artifact, f"s3://{bucket}/art/", client=client)
    monkeypatch.setenv("UNET_MAX_JSON_BYTES", "1000")
    reads = []
    original = storage._run_transfers
    monkeypatch.setattr(storage, "_run_transfers", lambda *a, **k: reads.append(a) or
                        original(*a, **k))
    with pytest.raises(StepError, match="MANIFEST.json.*UNET_MAX_JSON_BYTES"):
        storage.download_dir(f"s3://{bucket}/art/", tmp_path / "out", client=client)
    assert not reads and not (tmp_path / "out" / "a.bin").exists()


# ============================================================ 9: left from the earlier sets
def test_a_binary_latest_pointer_is_one_line(tmp_path, capsys):
    store = checkpoints.CheckpointStore(str(tmp_path / "ck"))
    store.write_bytes(checkpoints.LATEST, b"\xff\xfe\x00ckpt\x80")
    with pytest.raises(StepError, match="names .*not a checkpoint file") as caught:
        store.latest_name()
    assert "\x00" not in str(caught.value)
    store.write_bytes(checkpoints.LATEST, b"c" * 100)
    with pytest.raises(StepError, match="more than the 64 allowed"):
        store.latest_name()


@pytest.fixture(scope="module")
def small_case(tmp_path_factory) -> tuple[Path, str]:
    """A dataset whose fold-0 validation case is 8x8 in-plane (preprocess pads every case to
    the patch, 64x64): validation reached a 1x1 deepest level and torch's instance norm
    raised. (the dataset, that case's name)"""
    dataset = make_dataset(tmp_path_factory.mktemp("small-case"), 5, "48x48x24", 0, "64x64")
    meta = json.loads((dataset / "dataset.json").read_text())
    case = next(c for c in meta["cases"] if c["name"] == meta["folds"][0]["val"][0])
    image, label = np.load(dataset / case["image"]), np.load(dataset / case["label"])
    np.save(dataset / case["image"], np.ascontiguousarray(image[:, :, :8, :8]))
    np.save(dataset / case["label"], np.ascontiguousarray(label[:, :8, :8]))
    case["shape"] = [image.shape[0], image.shape[1], 8, 8]
    (dataset / "dataset.json").write_text(json.dumps(meta))
    write_manifest(dataset, "dataset", "preprocess", {})
    return dataset, case["name"]


def _train(dataset: Path, home: Path):
    return train.main, ["--dataset", dataset, "--model", home / "out", "--device", "cpu",
                        "--max-epochs", "1", "--steps-per-epoch", "1", "--fold", "0"]


def _convert(dataset: Path, home: Path):
    return convert.main, ["--model", fake_model(home / "model"), "--dataset", dataset,
                          "--exported", home / "out"]


def _quantize(dataset: Path, home: Path):
    """An ``exported`` artifact of fold 0 (the card's default): a 1x1 convolution."""
    exported = home / "exported"
    exported.mkdir()
    (exported / quantize.CARD_FILE).write_text(json.dumps({"size_multiple": 8}))
    onnx_model(exported / quantize.FP32_FILE, 4, 4)
    write_manifest(exported, "exported", "convert", {})
    return quantize.main, ["--exported", exported, "--dataset", dataset, "--quantized",
                           home / "out", "--calibration-slices", "16"]


@pytest.mark.parametrize("step", [_train, _convert, _quantize])
def test_a_case_smaller_than_the_patch_is_refused_by_every_reader(step, small_case, tmp_path,
                                                                  capsys):
    dataset, name = small_case
    main, argv = step(dataset, tmp_path)
    _refused_leaving(tmp_path, main, argv, capsys,
                     f"case '{name}': slices of 8x8 are smaller than patch_size 64x64")


@pytest.mark.parametrize("name", ["label", "label.txt", "label.nii.gz.tmp", "label.gz"])
def test_predict_out_that_is_not_nifti_is_refused(name, tmp_path, capsys):
    model = onnx_model(tmp_path / "m.onnx", 4, 2)
    image = nifti_file(tmp_path / "case.nii.gz", np.zeros((8, 8, 4, 4), np.float32))
    _refused_leaving(tmp_path, convert.main, ["predict", "--onnx", model, "--image", image,
                                              "--out", tmp_path / name],
                     capsys, "--out", "must end with .nii.gz or .nii")


# ============================================= 1: a model is untrusted input at run time too
def _model(path: Path, nodes, initializers=(), image_type=None, functions=()) -> Path:
    """A one-channel, two-class model with steps.convert's metadata: ``nodes`` map ``image``
    (N, 1, H, W) to ``logits`` (N, 2, H, W)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        nodes, "hostile",
        [helper.make_tensor_value_info("image", image_type or TensorProto.FLOAT,
                                       ["N", 1, "H", "W"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 2, "H", "W"])],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in initializers])
    opsets = [helper.make_opsetid("", 17)] + [helper.make_opsetid(d, 1) for d in functions]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    contract = {"channels": ["T2w"], "mode": "default", "size_multiple": 8,
                "normalisation": {"method": "zscore"}}
    for key, value in sorted(convert.onnx_metadata(contract, {"0": "bg", "1": "fg"}).items()):
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(path))
    return path


def _two_channels():
    from onnx import helper
    return [helper.make_node("Concat", ["image", "image"], ["both"], axis=1)]


def _case(tmp_path: Path) -> Path:
    return nifti_file(tmp_path / "case.nii.gz",
                      np.random.default_rng(0).random((16, 16, 8)).astype(np.float32) + 1)


def _predict_refused(model: Path, tmp_path: Path, capsys, *needles: str) -> str:
    """``python -m steps.convert predict`` with ``model`` is refused and writes nothing."""
    return _refused_leaving(tmp_path, convert.main, [
        "predict", "--onnx", model, "--image", _case(tmp_path), "--out",
        tmp_path / "label.nii.gz"], capsys, *needles)


def test_a_model_that_fails_while_running_is_one_line(tmp_path, capsys):
    from onnx import helper
    nodes = _two_channels() + [helper.make_node("Gather", ["both", "index"], ["logits"],
                                                axis=1)]
    model = _model(tmp_path / "m.onnx", nodes, [("index", np.array([0, 7], np.int64))])
    _predict_refused(model, tmp_path, capsys, "the model failed while running")


def test_a_model_whose_input_is_not_float_is_refused_before_it_runs(tmp_path, capsys):
    from onnx import TensorProto, helper
    nodes = [helper.make_node("Cast", ["image"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Concat", ["f", "f"], ["logits"], axis=1)]
    model = _model(tmp_path / "m.onnx", nodes, image_type=TensorProto.DOUBLE)
    _predict_refused(model, tmp_path, capsys, "tensor(double)", "one float input 'image'")


def test_a_custom_domain_operator_is_refused_before_anything_runs_it(tmp_path, capsys):
    from onnx import helper
    nodes = [helper.make_node("Concat", ["image", "image"], ["both"], axis=1),
             helper.make_node("Secret", ["both"], ["logits"], domain="com.example")]
    model = _model(tmp_path / "m.onnx", nodes, functions=["com.example"])
    _predict_refused(model, tmp_path, capsys, "domain 'com.example'")


def _endless_model(path: Path) -> Path:
    """A Loop with no end (trip count 2**62, condition always true) whose result feeds the
    logits, so onnxruntime cannot skip it."""
    from onnx import TensorProto, helper
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Add", ["v_in", "one"], ["v_out"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [])],
        [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    nodes = _two_channels() + [
        helper.make_node("Loop", ["trips", "yes", "zero"], ["v"], body=body),
        helper.make_node("Mul", ["v", "nothing"], ["v0"]),
        helper.make_node("Add", ["both", "v0"], ["logits"])]
    return _model(path, nodes, [("trips", np.array(2 ** 62, np.int64)),
                                ("yes", np.array(True)), ("zero", np.array(0.0, np.float32)),
                                ("nothing", np.array(0.0, np.float32))])


def test_an_endless_model_is_bounded_in_time(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("UNET_MAX_INFERENCE_SECONDS", "2")
    model = _endless_model(tmp_path / "m.onnx")
    started = time.monotonic()
    _predict_refused(model, tmp_path, capsys, "ran past 2 s", "UNET_MAX_INFERENCE_SECONDS")
    assert time.monotonic() - started < 60


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its SigCgt mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines()
                      if line.startswith("SigCgt:")), 16)
    return bool(caught >> (signum - 1) & 1)


@pytest.mark.slow
def test_sigterm_stops_an_endless_model(tmp_path):
    import signal
    import subprocess
    model = _endless_model(tmp_path / "m.onnx")
    proc = subprocess.Popen([sys.executable, "-m", "steps.convert", "predict", "--onnx", model,
                             "--image", _case(tmp_path), "--out", tmp_path / "label.nii.gz"],
                            cwd=REPO, stderr=subprocess.PIPE, text=True)
    # the step's handler installed (its imports took 8 s and more on a loaded 2-core
    # machine, where a fixed wait once signalled the interpreter before it), then inside
    # the endless inference
    end = time.monotonic() + 120
    while not _catches(proc.pid, signal.SIGTERM) and time.monotonic() < end:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    # the step named as docs/operations.md shows it, not as __main__ (python -m)
    assert "error: steps.convert: stopped by SIGTERM" in err and "Traceback" not in err
    assert not (tmp_path / "label.nii.gz").exists()


# ===================================== 10: a checkpoint is untrusted input (issue 37, round 4)
@pytest.fixture(scope="module")
def ckpt_dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("ckpt-data"), cases=5, shape="32x32x16",
                        seed=3, patch="32x32")


_TINY = ["--device", "cpu", "--base-filters", "4", "--levels", "4", "--num-workers", "0",
         "--max-epochs", "1", "--steps-per-epoch", "1"]


def _tensor():
    import torch
    return torch.tensor([1.0])


@pytest.mark.parametrize("fields, needles", [
    (lambda: {"metrics": {"best_mean_dice": float("nan")}},
     ("metrics", "best_mean_dice", "finite")),
    (lambda: {"metrics": {"epochs": [{"loss": float("inf")}]}}, ("metrics", "epochs.0.loss")),
    (lambda: {"metrics": {"best_mean_dice": _tensor()}}, ("metrics", "best_mean_dice", "Tensor")),
    (lambda: {"train_config": {"fold": 0, "lr": _tensor()}}, ("train_config", "lr", "Tensor")),
    (lambda: {"dataset_manifest_sha256": 7}, ("dataset_manifest_sha256",)),
])
def test_checkpoint_fields_the_model_card_copies_are_checked(fields, needles, ckpt_dataset,
                                                              tmp_path, capsys):
    """convert copies best.pt's metrics, train_config and dataset digest into model-card.json:
    a NaN there was published (and quantize then refused the card), a tensor was exit 1."""
    model = fake_model(tmp_path / "model", **fields())
    _refused_leaving(tmp_path, convert.main, ["--model", model, "--dataset", ckpt_dataset,
                                              "--exported", tmp_path / "exported"],
                     capsys, "best.pt", *needles)


def test_the_model_card_is_written_as_strict_json_or_not_at_all(tmp_path, monkeypatch):
    """schemas.write_json, which writes every JSON file a step publishes."""
    card = tmp_path / "model-card.json"
    with pytest.raises(StepError, match=r"model-card.json: training\.metrics\.best_mean_dice is "
                                        "not a finite number"):
        schemas.write_json(card, {"training": {"metrics": {"best_mean_dice": float("nan")}}})
    with pytest.raises(StepError, match="model-card.json: Object of type Tensor is not JSON"):
        schemas.write_json(card, {"training": {"metrics": {"best_mean_dice": torch.ones(1)}}})
    monkeypatch.setenv("UNET_MAX_JSON_BYTES", "64")
    with pytest.raises(StepError, match="model-card.json as written.*max_json_bytes"):
        schemas.write_json(card, {"training": "x" * 64})
    assert not card.exists()


def _sparse(path: Path, size: int = 1 << 40) -> Path:
    """``path`` as a file of ``size`` bytes that takes no disk (a hole)."""
    with open(path, "wb") as handle:
        handle.truncate(size)
    return path


def test_a_checkpoint_over_the_size_limit_is_refused_before_it_is_read(ckpt_dataset, tmp_path,
                                                                      capsys):
    """A 1 TiB ckpt-*.pt named by latest: read whole, it was MemoryError and a traceback."""
    store = tmp_path / "ck"
    store.mkdir()
    _sparse(store / checkpoints.checkpoint_name(1))
    (store / checkpoints.LATEST).write_text(checkpoints.checkpoint_name(1))
    _refused_leaving(tmp_path, train.main,
                     ["--dataset", ckpt_dataset, "--model", tmp_path / "out", *_TINY,
                      "--resume-from", store],
                     capsys, "ckpt-0000000001.pt", "max_checkpoint_bytes",
                     "UNET_MAX_CHECKPOINT_BYTES")


def test_convert_bounds_best_pt_before_hashing_or_loading_it(ckpt_dataset, tmp_path, capsys):
    model = fake_model(tmp_path / "model")
    _sparse(model / "best.pt")               # the manifest's hash would read 1 TiB first
    start = time.monotonic()
    _refused_leaving(tmp_path, convert.main, ["--model", model, "--dataset", ckpt_dataset,
                                              "--exported", tmp_path / "exported"],
                     capsys, "best.pt", "UNET_MAX_CHECKPOINT_BYTES")
    assert time.monotonic() - start < 30


def test_an_s3_checkpoint_is_bounded_by_its_content_length(s3_env, monkeypatch):
    s3 = s3_env
    store = checkpoints.CheckpointStore(f"s3://{s3.bucket}/round4/ck-{time.time_ns()}")
    store.write_bytes(checkpoints.checkpoint_name(1), b"x" * 5000)
    store.write_bytes(checkpoints.LATEST, checkpoints.checkpoint_name(1).encode())
    monkeypatch.setenv("UNET_MAX_CHECKPOINT_BYTES", "4096")
    fetched = []
    original = storage.get_bytes
    monkeypatch.setattr(storage, "get_bytes", lambda uri, *a, **k: fetched.append(uri) or
                        original(uri, *a, **k))
    with pytest.raises(StepError, match="5000 bytes .*UNET_MAX_CHECKPOINT_BYTES"):
        store.load_latest()
    assert not any(uri.endswith(".pt") for uri in fetched), fetched


@pytest.mark.parametrize("flag, inside", [("--model", "model"), ("--checkpoint-uri", ""),
                                          ("--checkpoint-uri", "sub")])
def test_an_output_in_the_resume_from_store_is_refused(flag, inside, ckpt_dataset, tmp_path,
                                                       capsys):
    """--resume-from is an input: the model was published inside it, and this run's
    checkpoints (pruned as they go) would replace the earlier run's."""
    resume = tmp_path / "ckC"
    resume.mkdir()
    output = resume / inside if inside else resume
    argv = ["--dataset", ckpt_dataset, *_TINY, "--resume-from", resume, flag, output]
    if flag != "--model":
        argv += ["--model", tmp_path / "out"]
    _refused_leaving(tmp_path, train.main, argv, capsys, flag, "--resume-from", "overlap")


def test_a_store_that_is_only_read_is_never_created(ckpt_dataset, tmp_path, capsys):
    """A mistyped --resume-from was refused but left its folders made; so was this run's
    --checkpoint-uri, though the run never wrote a checkpoint."""
    _refused_leaving(tmp_path, train.main,
                     ["--dataset", ckpt_dataset, "--model", tmp_path / "out", *_TINY,
                      "--checkpoint-uri", tmp_path / "ck-new",
                      "--resume-from", tmp_path / "typo" / "ckpts"],
                     capsys, "--resume-from", "no checkpoint found there")


def test_a_run_resumed_from_another_store_keeps_its_best_weights_in_its_own(ckpt_dataset,
                                                                           tmp_path, capsys):
    """B resumes from A's store into its own and does not beat A's best epoch: B's
    checkpoints name best-epoch0001.pt, which was only in A's store, so resuming B (its own
    store, as an Argo retry does) failed: 'best-epoch0001.pt is named by .../latest but
    missing'."""
    first, second = tmp_path / "ckA", tmp_path / "ckB"
    tiny = ["--dataset", ckpt_dataset, *_TINY, "--patience", "0", "--checkpoint-minutes", "0"]
    assert run_main(train.main, [str(a) for a in [*tiny, "--model", tmp_path / "mA",
                                                  "--checkpoint-uri", first]]) == 0
    # A learning rate of 1e-12 leaves the weights, and so the validation Dice, as they were.
    assert run_main(train.main, [str(a) for a in [
        *tiny, "--max-epochs", "2", "--learning-rate", "1e-12", "--model", tmp_path / "mB",
        "--checkpoint-uri", second, "--resume-from", first]]) == 0
    latest = checkpoints.CheckpointStore(str(second)).load_latest()
    assert latest["progress"]["epoch"] == 2 and latest["best_file"] == "best-epoch0001.pt"
    capsys.readouterr()
    status = run_main(train.main, [str(a) for a in [
        *tiny, "--max-epochs", "3", "--model", tmp_path / "mC", "--checkpoint-uri", second]])
    err = capsys.readouterr().err
    assert status == 0, err[-2000:]
    assert f"resumed from {second} at epoch 2" in err


def test_a_network_without_deep_supervision_converts_at_any_depth(ckpt_dataset, tmp_path):
    """train --levels 3 --deep-supervision false published a model (MONAI builds no heads
    without deep supervision) that convert and a resume refused: 'deep_supervision_heads 2
    needs more than 3 levels'."""
    common = ["--dataset", ckpt_dataset, *_TINY, "--levels", "3", "--deep-supervision",
              "false", "--checkpoint-minutes", "0"]
    assert run_main(train.main, [str(a) for a in [*common, "--model", tmp_path / "model",
                                                  "--checkpoint-uri", tmp_path / "ck"]]) == 0
    assert run_main(convert.main, [str(a) for a in [
        "--model", tmp_path / "model", "--dataset", ckpt_dataset,
        "--exported", tmp_path / "exported"]]) == 0
    assert run_main(train.main, [str(a) for a in [*common, "--max-epochs", "2", "--model",
                                                  tmp_path / "model2", "--checkpoint-uri",
                                                  tmp_path / "ck"]]) == 0


def test_a_model_too_large_for_the_memory_is_refused_before_it_is_read(tmp_path, capsys,
                                                                      monkeypatch):
    """onnx.load read any file whole (protobuf refuses only past 2 GiB): a model just under
    the pod's memory was OOM-killed, which Argo retries."""
    monkeypatch.setenv("UNET_MAX_MEMORY_FRACTION", "5")
    model = _sparse(tmp_path / "unet2d.onnx", limits.memory_bytes() // 50)
    status, err = call(predict.main, ["--onnx", model, "--image", tmp_path / "x.nii.gz",
                                      "--out", tmp_path / "out" / "x.nii.gz"], capsys)
    assert status == 2, err
    assert_one_error_line(err, f"--onnx {model}", "over the limit max_memory_fraction=5%")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unet2d.onnx"]


def test_a_scaled_volume_is_held_to_the_memory_before_it_is_scaled(tmp_path, capsys,
                                                                  monkeypatch):
    """A small .nii.gz of an int8 volume with scl_slope set: its scaled values took 12 bytes
    a voxel at once (a float64 copy, then float32), 12 GiB of a volume within the 1 GiB
    max_volume_bytes, which the pod's OOM kill ends and Argo retries."""
    import nibabel as nib
    path = tmp_path / "bomb.nii.gz"
    side = round((limits.memory_bytes() / 200) ** (1 / 3))    # float32 values: 2 % of memory
    image = nib.Nifti1Image(np.zeros((side, side, side), dtype=np.int8), np.eye(4))
    image.header.set_slope_inter(2.0, 0.0)
    nib.save(image, path)
    assert path.stat().st_size < side ** 3 // 100
    monkeypatch.setenv("UNET_MAX_MEMORY_FRACTION", "1")
    status, err = call(lambda _argv: nifti.load(path).values() is None, [], capsys)
    assert status == 2, err
    assert_one_error_line(err, f"{path}: its scaled values (float32)", "max_memory_fraction")


def test_a_local_store_is_made_by_its_first_write(tmp_path):
    store = checkpoints.CheckpointStore(str(tmp_path / "a" / "ck"))
    assert store.load_latest() is None and store.names() == []
    assert not (tmp_path / "a").exists()
    store.save({"step": 1}, 1)
    assert store.names() == [checkpoints.checkpoint_name(1), checkpoints.LATEST]
    (tmp_path / "file").write_text("x")
    with pytest.raises(StepError, match="cannot create .*Not a directory"):
        checkpoints.CheckpointStore(str(tmp_path / "file" / "ck"))
