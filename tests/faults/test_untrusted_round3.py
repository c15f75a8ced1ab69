"""Trust no input, round 3 (issue 37), the classes done so far: 4 no secret in any error line,
8 error lines are lines, 9 the cases left from the earlier sets. Each refusal is exit 2 with
exactly one ``error:`` line at the start of a line, no traceback, no secret."""
from __future__ import annotations

import io
import json
import sys

import botocore.exceptions as bexc
import numpy as np
import pytest
from tqdm import tqdm

from conftest import assert_one_error_line
from steps import checkpoints, convert, storage
from steps.artifacts import MANIFEST, write_manifest
from steps.errors import StepError, one_line, run_main
from test_untrusted_inputs import call, nifti_file, onnx_model, refused

pytestmark = pytest.mark.faults

TOKEN = "FQoGZXIvYXdzEJr//////////wEaDLmVsbn0KsDnqHvH5SKoAd" + "x" * 40


# ========================================= 4: no secret in any error line, whatever the library
def test_credentials_with_control_characters_are_refused_unprinted(monkeypatch, tmp_path,
                                                                   capsys, s3):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_key)
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN[:30] + "\r\n" + TOKEN[30:])
    from steps import handoff
    status, err = call(handoff.main, ["fetch", "--artifact", "model", "s3://bucket/job/",
                                      tmp_path / "out"], capsys)
    line = assert_one_error_line(err, "AWS_SESSION_TOKEN holds whitespace or control")
    assert status == 2 and TOKEN[:30] not in err and TOKEN[30:] not in err, line


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


@pytest.mark.parametrize("name", ["label", "label.txt", "label.nii.gz.tmp", "label.gz"])
def test_predict_out_that_is_not_nifti_is_refused(name, tmp_path, capsys):
    model = onnx_model(tmp_path / "m.onnx", 4, 2)
    image = nifti_file(tmp_path / "case.nii.gz", np.zeros((8, 8, 4, 4), np.float32))
    refused(convert.main, ["predict", "--onnx", model, "--image", image, "--out",
                           tmp_path / name], capsys, "--out", "must end with .nii.gz or .nii")
    assert not (tmp_path / name).exists()
