"""Convert, quantize and evaluate read the ``dataset`` artifact by key (``--dataset
s3://BUCKET/PREFIX``, ``steps.dataset.read_dataset``), as the workflow runs them.

Each step's result is the one it gives from the artifact's directory; it fetches only the
cases it uses (its summary line counts exactly their bytes), leaves no scratch folder beside
its output, and refuses an object that is not what the manifest says without publishing.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from steps import bykey, storage
from steps.artifacts import MANIFEST
from steps.dataset import fold_names, read_metadata
from tests.train_data import assert_ok, exported_model, run_step, step_env

pytestmark = pytest.mark.slow      # trains and converts a small model first

SOURCE = "synthetic://?cases=6&shape=48x48x16&seed=2"
TRAIN = ("--device", "cpu", "--base-filters", "8", "--levels", "4", "--batch-size", "8",
         "--max-epochs", "1", "--steps-per-epoch", "2", "--patience", "0",
         "--val-batch-size", "16", "--num-workers", "0")
QUANTIZE = ("--calibration-slices", "8", "--gate-cases", "1", "--max-dice-drop", "100",
            "--max-class-dice-drop", "100", "--min-agreement", "0")


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """download → preprocess → train → convert, from the dataset's directory."""
    return exported_model(tmp_path_factory.mktemp("by-key"), SOURCE, "32x32", *TRAIN)


@pytest.fixture
def dataset_uri(made, s3_env, tmp_path) -> str:
    """The dataset as Argo's executor saves it, at a prefix of this test's own."""
    uri = f"s3://{s3_env.bucket}/{tmp_path.name}/preprocess-pod/dataset"
    storage.upload_dir(made / "dataset", uri, progress=False)
    return uri


def fetched(stderr: str) -> int:
    """The bytes the step's summary says it fetched by key."""
    return bykey.fetched_bytes(stderr)["dataset"]


def case_bytes(dataset: Path, names) -> int:
    """What fetching ``names``' image and label (and the manifest and dataset.json) reads."""
    meta = read_metadata(dataset)
    files = [c[part] for c in meta["cases"] if c["name"] in set(names)
             for part in ("image", "label")] + ["dataset.json", MANIFEST]
    return sum((dataset / rel).stat().st_size for rel in files)


def no_scratch(parent: Path) -> None:
    assert not [p.name for p in parent.iterdir() if p.name.startswith(".dataset-by-key")]


def test_convert_by_key_gives_the_same_parity_from_the_validation_cases(made, dataset_uri,
                                                                        tmp_path):
    done = run_step("convert", "--model", str(made / "model"), "--dataset", dataset_uri,
                    "--exported", str(tmp_path / "exported"), env=step_env())
    assert_ok(done)
    local = json.loads((made / "exported" / "parity.json").read_text())
    by_key = json.loads((tmp_path / "exported" / "parity.json").read_text())
    assert by_key == local
    card = json.loads((tmp_path / "exported" / "model-card.json").read_text())
    assert card["provenance"]["parity_dataset_manifest_sha256"] == \
        card["provenance"]["dataset_manifest_sha256"]
    _, val = fold_names(read_metadata(made / "dataset"), 0)
    used = set(val) | set(local["source"]["training_cases"])
    assert fetched(done.stderr) == case_bytes(made / "dataset", used)
    waited = re.search(r"fetched by key in (\d+\.\d\d) s$", done.stderr.strip())
    assert waited and float(waited.group(1)) == bykey.fetch_seconds(done.stderr) < 60
    no_scratch(tmp_path)


def test_quantize_by_key_fetches_only_its_calibration_and_gate_cases(made, dataset_uri,
                                                                     tmp_path):
    runs = {}
    for name, dataset in (("local", str(made / "dataset")), ("by-key", dataset_uri)):
        out = tmp_path / name / "quantized"
        runs[name] = run_step("quantize", "--exported", str(made / "exported"), "--dataset",
                              dataset, "--quantized", str(out), *QUANTIZE, env=step_env())
        assert_ok(runs[name])
    reports = {name: json.loads((tmp_path / name / "quantized" / "quantization.json")
                                .read_text()) for name in runs}
    assert reports["by-key"]["calibration"] == reports["local"]["calibration"]
    figures = {name: r["figures"] for name, r in reports.items()}
    assert figures["by-key"]["fp32"]["dice"] == figures["local"]["fp32"]["dice"]
    assert figures["by-key"]["validation_cases"] == figures["local"]["validation_cases"]
    used = set(reports["local"]["calibration"]["training_cases"]) | set(
        figures["local"]["validation_cases"])
    meta = read_metadata(made / "dataset")
    assert len(used) < len(meta["cases"])         # the test means something: cases left out
    assert fetched(runs["by-key"].stderr) == case_bytes(made / "dataset", used)
    assert "fetched by key" not in runs["local"].stderr
    no_scratch(tmp_path / "by-key")


def test_evaluate_by_key_scores_the_held_out_cases_as_from_the_directory(made, dataset_uri,
                                                                          tmp_path):
    runs = {}
    for name, dataset in (("local", str(made / "dataset")), ("by-key", dataset_uri)):
        runs[name] = run_step("evaluate", "--exported", str(made / "exported"), "--dataset",
                              dataset, "--evaluation", str(tmp_path / name / "evaluation"),
                              env=step_env())
        assert_ok(runs[name])
    results = {name: json.loads((tmp_path / name / "evaluation" / "evaluation.json")
                                .read_text()) for name in runs}
    assert results["by-key"] == results["local"]
    _, val = fold_names(read_metadata(made / "dataset"), 0)
    assert sorted(results["local"]["cases"]) == sorted(val)
    assert fetched(runs["by-key"].stderr) == case_bytes(made / "dataset", val)
    no_scratch(tmp_path / "by-key")


def test_an_object_unlike_its_manifest_is_refused_and_nothing_is_left(made, dataset_uri,
                                                                      s3_env, tmp_path):
    """A validation case's image replaced in S3 after the manifest was written: convert
    stops with one line naming it, publishes nothing and removes what it fetched."""
    meta = read_metadata(made / "dataset")
    _, val = fold_names(meta, 0)
    image = next(c["image"] for c in meta["cases"] if c["name"] == val[0])
    tampered = tmp_path / "tampered.npy"
    tampered.write_bytes(b"\0" * (made / "dataset" / image).stat().st_size)
    storage.upload_file(tampered, f"{dataset_uri}/{image}")
    out = tmp_path / "out"
    done = run_step("convert", "--model", str(made / "model"), "--dataset", dataset_uri,
                    "--exported", str(out / "exported"), env=step_env())
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert re.fullmatch(rf"error: artifact 'dataset' at s3://\S+: {image} does not match its "
                        rf"sha256 in {MANIFEST}", lines[-1]), lines[-1]
    assert "Traceback" not in done.stderr
    assert not (out / "exported").exists()
    no_scratch(out)
