"""steps.evaluate: whole-volume inference by sliding window and mirroring, the figures of the
held-out cases, and what it refuses; steps.ensemble: the folds' mean softmax as one graph.

The models here are ONNX graphs written by hand, so that the right answer is known without
training: an oracle that reads the label from the image (every figure perfect, whatever the
windows and the flips), and a 3x3 convolution with an asymmetric kernel, whose mirrored
prediction is the mean over the four mirrored kernels, computed here with numpy alone.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from steps import evaluate, metrics, predict, schemas
from steps.artifacts import publish, require
from steps.dataset import open_cases, read_metadata
from steps.errors import StepError
from train_data import make_dataset, run_step

N_CLASSES = 4
MULTIPLE = 16


def model_file(path, nodes, initializers, channels, labels, inputs=("image",)) -> None:
    """An exported-model-like ONNX file: input ``image`` (N, C, H, W), output ``logits``
    (N, 4, H, W), and convert's metadata contract."""
    graph = helper.make_graph(
        nodes, "hand-written",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", len(channels), "H", "W"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", N_CLASSES, "H", "W"])],
        [numpy_helper.from_array(np.asarray(v), name=k) for k, v in initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    contract = {"channels": channels, "size_multiple": MULTIPLE, "mode": "default"}
    helper.set_model_props(model, {"preprocessing": json.dumps(contract),
                                   "labels": json.dumps(labels)})
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def oracle(path, channels, labels) -> None:
    """logits_k = -(x_0 - k)^2: the argmax is the label written into channel 0."""
    model_file(path, [
        helper.make_node("Slice", ["image", "c0", "c1", "axis"], ["x0"]),
        helper.make_node("Sub", ["x0", "classes"], ["d"]),
        helper.make_node("Mul", ["d", "d"], ["d2"]),
        helper.make_node("Neg", ["d2"], ["logits"])],
        {"c0": np.array([0]), "c1": np.array([1]), "axis": np.array([1]),
         "classes": np.arange(N_CLASSES, dtype=np.float32).reshape(1, -1, 1, 1)},
        channels, labels)


def coarse(path, channels, labels) -> None:
    """The oracle seen through MULTIPLE x MULTIPLE blocks (average-pooled, then repeated):
    like the U-Net, its logits have the input's size only where each side is a multiple of
    MULTIPLE."""
    model_file(path, [
        helper.make_node("Slice", ["image", "c0", "c1", "axis"], ["x0"]),
        helper.make_node("AveragePool", ["x0"], ["pooled"], kernel_shape=[MULTIPLE, MULTIPLE],
                         strides=[MULTIPLE, MULTIPLE]),
        helper.make_node("Resize", ["pooled", "", "scales"], ["up"], mode="nearest"),
        helper.make_node("Sub", ["up", "classes"], ["d"]),
        helper.make_node("Mul", ["d", "d"], ["d2"]),
        helper.make_node("Neg", ["d2"], ["logits"])],
        {"c0": np.array([0]), "c1": np.array([1]), "axis": np.array([1]),
         "scales": np.array([1, 1, MULTIPLE, MULTIPLE], dtype=np.float32),
         "classes": np.arange(N_CLASSES, dtype=np.float32).reshape(1, -1, 1, 1)},
        channels, labels)


KERNEL = np.array([[0.0, 0.2, 1.0], [0.1, 0.5, 2.0], [0.0, 0.0, 0.3]], dtype=np.float32)


def asymmetric(path, channels, labels) -> None:
    """logits_k = k * conv3x3(x_0, KERNEL) (zero padding): not symmetric under any flip."""
    weight = (np.arange(N_CLASSES, dtype=np.float32).reshape(-1, 1, 1, 1)
              * KERNEL.reshape(1, 1, 3, 3))
    weight = np.concatenate([weight, np.zeros((N_CLASSES, len(channels) - 1, 3, 3),
                                              dtype=np.float32)], axis=1)
    model_file(path, [helper.make_node("Conv", ["image", "w"], ["logits"], pads=[1, 1, 1, 1])],
               {"w": weight}, channels, labels)


def exported(folder, write_model, meta, fold: int):
    """An ``exported`` artifact around a hand-written model, with a model card of ``fold``."""
    with publish(folder, "exported", "convert", {}) as out:
        write_model(out / predict.ONNX_FILE, meta["channels"], dict(meta["labels"]))
        card = {"format_version": 1, "size_multiple": MULTIPLE,
                "training": {"config": {"fold": fold}}}
        (out / predict.CARD_FILE).write_text(json.dumps(card))
    return folder


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    """A real dataset (synthetic source, preprocess) rewritten so that each image's channel 0
    is its label: the oracle then predicts every voxel right."""
    root = tmp_path_factory.mktemp("evaluate")
    source = make_dataset(root / "made", cases=6, shape="40x36x12", seed=3, patch="32x32")
    meta = read_metadata(source)
    with publish(root / "dataset", "dataset", "preprocess", {}) as out:
        shutil.copytree(source / "cases", out / "cases")
        (out / "dataset.json").write_text(json.dumps(meta))
        for case in meta["cases"]:
            image = np.load(out / case["image"])
            image[0] = np.load(out / case["label"])
            np.save(out / case["image"], image)
    return root / "dataset", meta


def test_an_oracle_scores_perfectly_through_windows_and_mirrors(labelled, tmp_path):
    dataset, meta = labelled
    model = exported(tmp_path / "exported", oracle, meta, fold=1)
    done = run_step("evaluate", "--exported", str(model), "--dataset", str(dataset),
                    "--evaluation", str(tmp_path / "evaluation"))
    assert done.returncode == 0, done.stderr[-2000:]
    require(tmp_path / "evaluation", "evaluation")
    result = json.loads((tmp_path / "evaluation" / evaluate.RESULT_FILE).read_text())
    assert result["fold"] == 1
    assert sorted(result["cases"]) == sorted(meta["folds"][1]["val"])
    assert result["inference"] == {"window": [32, 32], "overlap": 0.5,
                                   "blend": "gaussian, sigma 1/8", "mirroring": True}
    outputs = tmp_path / "evaluation" / "argo-outputs"
    assert {f.name: f.read_text() for f in outputs.iterdir()} == \
        {"dice_wt": "1.0000\n", "dice_tc": "1.0000\n", "dice_et": "1.0000\n"}
    for figures in result["cases"].values():
        assert set(figures["dice"].values()) == {1.0}
        assert set(figures["hd95"].values()) == {0.0}
    page = (tmp_path / "evaluation" / evaluate.PAGE_FILE).read_text()
    assert page.index("<table>") < page.index("<h2>")          # the table first
    assert "<th>mean</th>" + "<td>1.0000</td>" * 6 + "<td>0.0000</td>" * 3 in page
    assert (tmp_path / "evaluation" / evaluate.OVERLAYS_FILE).stat().st_size > 1000


def test_the_window_slides_over_slices_larger_than_it(labelled, tmp_path):
    """Windows of 16 over slices of 32 or more (several a slice, Gaussian-blended) give the
    truth's labels; so does one window larger than the slice (padded with the background)."""
    dataset, meta = labelled
    session = predict.open_session(exported(tmp_path / "e", oracle, meta, 0)
                                   / predict.ONNX_FILE)
    case = open_cases(dataset, meta, [meta["cases"][0]["name"]])[0]
    truth = np.asarray(case.label)
    assert min(truth.shape[1:]) >= 32 and truth.any()
    for size in ((16, 16), (48, 48)):
        labels = evaluate.segment([session], case.image, size, N_CLASSES)
        assert np.array_equal(labels, truth), size


def reference_mirrored(x: np.ndarray) -> np.ndarray:
    """The mean softmax over the four mirrorings of the asymmetric model, by numpy: a model
    run on a flipped input and flipped back is the convolution with the flipped kernel."""
    x0 = np.pad(x[:, 0], ((0, 0), (1, 1), (1, 1)))
    total = 0
    for kernel in (KERNEL, KERNEL[:, ::-1], KERNEL[::-1, :], KERNEL[::-1, ::-1]):
        conv = sum(kernel[i, j] * x0[:, i:i + x.shape[2], j:j + x.shape[3]]
                   for i in range(3) for j in range(3))
        logits = np.arange(N_CLASSES).reshape(1, -1, 1, 1) * conv[:, None]
        total = total + evaluate.softmax(logits)
    return total / 4


def test_mirroring_averages_each_flips_softmax_flipped_back(labelled, tmp_path):
    dataset, meta = labelled
    session = predict.open_session(exported(tmp_path / "e", asymmetric, meta, 0)
                                   / predict.ONNX_FILE)
    x = np.random.default_rng(0).normal(size=(3, len(meta["channels"]), 16, 32)) \
        .astype(np.float32)
    mirrored = evaluate.window_softmax([session], x, N_CLASSES, mirroring=True)
    np.testing.assert_allclose(mirrored, reference_mirrored(x), atol=1e-5)
    once = evaluate.window_softmax([session], x, N_CLASSES, mirroring=False)
    assert np.abs(once - mirrored).max() > 0.05        # the flips do change this model's answer
    both = evaluate.window_softmax([session, session], x, N_CLASSES, mirroring=False)
    np.testing.assert_allclose(both, once, atol=1e-6)  # an ensemble's mean of one model twice


def test_an_ensemble_is_evaluated_on_the_fold_given(labelled, tmp_path):
    dataset, meta = labelled
    models = [exported(tmp_path / f"fold{k}", oracle, meta, k) for k in (0, 1)]
    done = run_step("evaluate", "--exported", str(models[0]), "--with-exported", str(models[1]),
                    "--dataset", str(dataset), "--fold", "2", "--mirroring", "false",
                    "--evaluation", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "out" / evaluate.RESULT_FILE).read_text())
    assert [m["folds"] for m in result["models"]] == [[0], [1]]
    assert result["trained_on_by"] == 2 and result["fold"] == 2 and result["inference"]["mirroring"] is False
    assert result["mean"]["dice"] == {k: 1.0 for k in result["mean"]["dice"]}


@pytest.mark.parametrize("extra, says", [
    (("--fold", "0"), "--fold 0: the model in"),
    (("--overlap", "0.95"), "python -m steps.evaluate: argument --overlap: must be <= 0.9"),
])
def test_refusals_are_one_line_and_leave_nothing(labelled, tmp_path, extra, says):
    dataset, meta = labelled
    model = exported(tmp_path / "exported", oracle, meta, fold=1)
    out = tmp_path / "evaluation"
    done = run_step("evaluate", "--exported", str(model), "--dataset", str(dataset),
                    "--evaluation", str(out), *extra)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: {says}"), done.stderr
    assert "Traceback" not in done.stderr and not out.exists()


def test_the_mean_rows_are_ours_and_nnunets():
    """A case lacking enhancing tumour in truth and prediction: ours counts its Dice 1, nnU-Net's
    mean leaves it out."""
    truth = np.zeros((4, 8, 8), dtype=np.uint8)
    truth[1:3, 2:6, 2:6] = 1
    lacking = metrics.case_metrics(truth, truth)
    other = truth.copy()
    other[2, 3, 3] = 3
    having = metrics.case_metrics(np.where(other == 3, 1, other).astype(np.uint8), other)
    result = evaluate.summary({"a": lacking, "b": having}, 0, {}, [], "")
    assert result["mean"]["dice"]["ET"] == 0.5 and result["mean_nnunet"]["dice"]["ET"] == 0.0


def evaluated(tmp_path, dataset, meta, fold: int):
    """Fold ``fold``'s evaluation by the oracle of that fold, without mirroring."""
    model = exported(tmp_path / f"model{fold}", oracle, meta, fold)
    out = tmp_path / f"evaluation{fold}"
    done = run_step("evaluate", "--exported", str(model), "--dataset", str(dataset),
                    "--mirroring", "false", "--evaluation", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def pool_of_two(labelled, tmp_path_factory):
    """Folds 0 and 1 evaluated by their oracles, and the two pooled: (evaluations, pooled)."""
    dataset, meta = labelled
    tmp = tmp_path_factory.mktemp("pool")
    folds = [evaluated(tmp, dataset, meta, k) for k in (0, 1)]
    done = run_step("evaluate", "pool", "--evaluation", *map(str, folds),
                    "--pooled", str(tmp / "pooled"))
    assert done.returncode == 0, done.stderr[-2000:]
    return folds, tmp / "pooled"


def test_the_pool_joins_the_folds_held_out_cases(labelled, pool_of_two, tmp_path):
    """Two folds' evaluations pooled: every held-out case once, the means over all of them
    first on the page, each fold's below; a fold given twice or scored by models that trained
    on it is refused (one line, exit 2, nothing written)."""
    dataset, meta = labelled
    folds, pooled = pool_of_two
    require(pooled, "pooled-evaluation")
    result = json.loads((pooled / evaluate.POOLED_FILE).read_text())
    assert result["folds"] == [0, 1]
    assert sorted(result["cases"]) == sorted(meta["folds"][0]["val"] + meta["folds"][1]["val"])
    assert {k: v["cases"] for k, v in result["per_fold"].items()} == \
        {str(k): len(meta["folds"][k]["val"]) for k in (0, 1)}
    assert set(result["mean"]["dice"].values()) == {1.0}
    html = (pooled / evaluate.POOLED_PAGE).read_text()
    assert html.index("<th>mean</th>") < html.index("fold 0, ")

    again = run_step("evaluate", "pool", "--evaluation", str(folds[0]), str(folds[0]),
                     "--pooled", str(tmp_path / "twice"))
    assert again.returncode == 2 and "a fold is given twice" in again.stderr
    seen = json.loads((folds[1] / evaluate.RESULT_FILE).read_text())
    seen["trained_on_by"] = 1
    with publish(tmp_path / "seen", "evaluation", "evaluate", {}) as out:
        (out / evaluate.RESULT_FILE).write_text(json.dumps(seen))
    mixed = run_step("evaluate", "pool", "--evaluation", str(folds[0]), str(tmp_path / "seen"),
                     "--pooled", str(tmp_path / "mixed"))
    assert mixed.returncode == 2 and "fold 1 was scored by models that trained on its cases" \
        in mixed.stderr, mixed.stderr
    assert not (tmp_path / "twice").exists() and not (tmp_path / "mixed").exists()


def rewritten(evaluation, folder, change):
    """``evaluation``'s ``evaluation.json`` after ``change(result)``, as an ``evaluation``
    artifact at ``folder``."""
    result = json.loads((evaluation / evaluate.RESULT_FILE).read_text())
    change(result)
    with publish(folder, "evaluation", "evaluate", {}) as out:
        (out / evaluate.RESULT_FILE).write_text(json.dumps(result))
    return folder


def test_a_label_no_held_out_case_has_pools_to_null_not_nan(pool_of_two, tmp_path):
    """Edema absent (truth and prediction) from every pooled case: nnU-Net's means of it,
    the postprocessing's included, have no case left; pooled.json says null (as mean_nnunet
    does), which the ensemble's reader takes, never NaN, and the decision leaves edema be."""
    def no_edema(result):
        for figures in result["cases"].values():
            figures["empty"] = sorted(set(figures["empty"]) | {"edema"})

    folds = [rewritten(f, tmp_path / f"e{k}", no_edema) for k, f in enumerate(pool_of_two[0])]
    out = tmp_path / "pooled"
    done = run_step("evaluate", "pool", "--evaluation", *map(str, folds), "--pooled", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    where = f"{out}/{evaluate.POOLED_FILE}"
    result = schemas.read_json(out / evaluate.POOLED_FILE, where)     # steps.ensemble's reader
    schemas.validate(schemas.Pooled, result, where)
    decision = result["postprocessing"]
    assert {v["edema"] for v in decision["mean_dice"].values()} == {None}
    assert decision["mean_dice"]["raw"]["enhancing"] == 1.0
    assert "edema" not in decision["largest_component_labels"]
    assert result["mean_nnunet"]["dice"]["edema"] is None
    assert "NaN" not in (out / evaluate.POOLED_PAGE).read_text()


def test_a_nan_figure_is_refused_not_written(tmp_path):
    """Every JSON evaluate writes is strict: a NaN is one StepError naming file and key."""
    path = tmp_path / evaluate.POOLED_FILE
    with pytest.raises(StepError, match=r"pooled\.json: postprocessing\.mean_dice\.raw\.edema"):
        schemas.write_json(path, {"postprocessing": {"mean_dice": {"raw": {
            "edema": float("nan"), "enhancing": 1.0}}}})
    assert not path.exists()


def test_the_pool_refuses_cases_without_the_regions_figures(pool_of_two, tmp_path):
    """Every case's Dice has the three labels but no WT/TC/ET (it was a KeyError, exit 1):
    the reader refuses the first such file (one line naming it, exit 2), before the pool
    indexes a region."""
    def labels_only(result):
        for figures in result["cases"].values():
            for region in metrics.REGIONS:
                del figures["dice"][region]

    bad = [rewritten(f, tmp_path / f"labels-only{k}", labels_only)
           for k, f in enumerate(pool_of_two[0])]
    out = tmp_path / "pooled"
    done = run_step("evaluate", "pool", "--evaluation", *map(str, bad), "--pooled", str(out))
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: artifact 'evaluation' at {bad[0]}: {evaluate.RESULT_FILE}: cases."), done.stderr
    assert ".dice: lacks ['WT', 'TC', 'ET']" in lines[0], lines[0]
    assert "Traceback" not in done.stderr and not out.exists()


# ------------------------------------------------------------------------- the ensemble

def run_ensemble(folds, dataset, out, *extra: str):
    """``steps.ensemble`` of the ``folds``' exported artifacts (the first as ``--exported``,
    the others as ``--with-exported``) into ``out``; ``extra`` flags before ``--ensemble``."""
    return run_step("ensemble", "--exported", str(folds[0]),
                    *[a for f in folds[1:] for a in ("--with-exported", str(f))],
                    "--dataset", str(dataset), *extra, "--ensemble", str(out))


def test_the_ensemble_is_one_graph_of_the_folds_mean_softmax(labelled, tmp_path):
    """steps.ensemble merges two different models (of folds 0 and 1): the softmax of its
    ``logits`` is the mean of theirs within 1e-4 (on slices it was not checked on), its card
    lists the folds, and evaluate takes it as an ``exported`` artifact, on a fold it names."""
    dataset, meta = labelled
    folds = [exported(tmp_path / "f0", oracle, meta, 0),
             exported(tmp_path / "f1", asymmetric, meta, 1)]
    out = tmp_path / "ensemble"
    done = run_ensemble(folds, dataset, out)
    assert done.returncode == 0, done.stderr[-2000:]
    require(out, "exported")
    card = predict.read_card(out)
    assert card["folds"] == [0, 1] and card["parity"]["passed"] is True
    assert card["parity"]["max_abs_softmax_diff"] <= 1e-4
    sessions = [predict.open_session(f / predict.ONNX_FILE) for f in (*folds, out)]
    x = np.random.default_rng(1).normal(size=(2, len(meta["channels"]), 32, 48)) \
        .astype(np.float32)
    mean = evaluate.window_softmax(sessions[:2], x, N_CLASSES, mirroring=False)
    got = evaluate.window_softmax(sessions[2:], x, N_CLASSES, mirroring=False)
    assert np.abs(got - mean).max() <= 1e-4
    assert np.abs(mean - evaluate.window_softmax(sessions[:1], x, N_CLASSES, False)).max() > 0.05
    refused = run_step("evaluate", "--exported", str(out), "--dataset", str(dataset),
                       "--evaluation", str(tmp_path / "no"))
    assert refused.returncode == 2 and "--fold is needed" in refused.stderr
    done = run_step("evaluate", "--exported", str(out), "--dataset", str(dataset), "--fold", "2",
                    "--evaluation", str(tmp_path / "scored"))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "scored" / evaluate.RESULT_FILE).read_text())
    assert result["models"][0]["folds"] == [0, 1] and result["trained_on_by"] == 2


def test_the_ensembles_parity_pads_slices_to_the_networks_multiple(tmp_path):
    """The stored slices are as wide as each case's brain, not multiples of the network's
    size multiple: the parity check pads them with the background, as evaluate and predict do
    (it fed them as they were, which a U-Net refuses, and so did the smoke of the footprint
    benchmark's ensemble, on cases 34 pixels high)."""
    dataset = make_dataset(tmp_path / "made", cases=3, shape="48x48x12", seed=3, patch="32x32")
    meta = read_metadata(dataset)
    assert any(side % MULTIPLE for case in meta["cases"] for side in case["shape"][2:])
    folds = [exported(tmp_path / "f0", coarse, meta, 0),
             exported(tmp_path / "f1", oracle, meta, 1)]
    out = tmp_path / "ensemble"
    done = run_ensemble(folds, dataset, out)
    assert done.returncode == 0, done.stderr[-2000:]
    card = predict.read_card(out)
    assert card["parity"]["passed"] is True and card["parity"]["max_abs_softmax_diff"] <= 1e-4


def test_quantize_keeps_each_members_end_convolutions_in_float(labelled, tmp_path):
    """--float-layers first-last in an ensemble: every member's first and last convolution,
    not the first member's first and the last member's last."""
    from steps import ensemble, quantize
    _, meta = labelled
    channels, labels = meta["channels"], dict(meta["labels"])
    hidden = np.zeros((2, len(channels), 3, 3), np.float32)
    out = np.zeros((N_CLASSES, 2, 1, 1), np.float32)
    for k in (0, 1):
        model_file(tmp_path / f"m{k}.onnx", [
            helper.make_node("Conv", ["image", "w1"], ["h"], pads=[1, 1, 1, 1], name="first"),
            helper.make_node("Conv", ["h", "w2"], ["h2"], name="middle"),
            helper.make_node("Conv", ["h2", "w3"], ["logits"], name="last")],
            {"w1": hidden, "w2": np.zeros((2, 2, 1, 1), np.float32), "w3": out},
            channels, labels)
    models = [onnx.load(str(tmp_path / f"m{k}.onnx")) for k in (0, 1)]
    assert quantize.end_convolutions(models[0]) == ["first", "last"]
    assert quantize.end_convolutions(ensemble.merged(models)) == [
        "member0.first", "member0.last", "member1.first", "member1.last"]


def test_the_ensemble_carries_the_pooled_figures_and_its_postprocessing(labelled, pool_of_two,
                                                                       tmp_path):
    """--pooled: the card holds the folds' cross-validation and the decision; a decision to
    keep components becomes the model's 'postprocessing' metadata, which predict reads; a
    pool of other folds is refused."""
    dataset, meta = labelled
    folds = [exported(tmp_path / f"f{k}", oracle, meta, k) for k in (0, 1)]
    pooled = pool_of_two[1]
    table = json.loads((pooled / evaluate.POOLED_FILE).read_text())
    assert table["postprocessing"]["largest_component_labels"] == []   # the oracle is exact
    decided = {**table, "postprocessing": {"foreground_largest_component": True,
                                           "largest_component_labels": ["enhancing"]}}
    with publish(tmp_path / "pageless", "pooled-evaluation", "evaluate", {}) as out:
        (out / evaluate.POOLED_FILE).write_text(json.dumps(decided))
    pageless = run_ensemble(folds, dataset, tmp_path / "nothing",
                            "--pooled", str(tmp_path / "pageless"))
    assert pageless.returncode == 2 and "pooled.html is missing" in pageless.stderr
    assert not (tmp_path / "nothing").exists()
    with publish(tmp_path / "decided", "pooled-evaluation", "evaluate", {}) as out:
        (out / evaluate.POOLED_FILE).write_text(json.dumps(decided))
        shutil.copyfile(pooled / evaluate.POOLED_PAGE, out / evaluate.POOLED_PAGE)
    for source, groups in ((pooled, []), (tmp_path / "decided", [[1, 2, 3], [3]])):
        out = tmp_path / f"ensemble-{source.name}"
        done = run_ensemble(folds, dataset, out, "--pooled", str(source))
        assert done.returncode == 0, done.stderr[-2000:]
        card = predict.read_card(out)
        assert card["cross_validation"]["folds"] == [0, 1]
        assert card["cross_validation"]["mean"] == table["mean"]
        assert card["cross_validation"]["postprocessing"]["keep_largest_component"] == groups
        assert (out / card["files"]["cross_validation"]).read_bytes() == \
            (source / evaluate.POOLED_FILE).read_bytes()
        path = out / predict.ONNX_FILE
        assert predict.read_contract(predict.open_session(path), path)["postprocessing"] == \
            groups
    other = run_ensemble([folds[0], exported(tmp_path / "f2", oracle, meta, 2)], dataset,
                         tmp_path / "other", "--pooled", str(pooled))
    assert other.returncode == 2 and "pools folds [0, 1], the ensemble's are [0, 2]" in \
        other.stderr, other.stderr
    assert not (tmp_path / "other").exists()


def test_an_ensemble_takes_one_model_per_fold(labelled, tmp_path):
    dataset, meta = labelled
    folds = [exported(tmp_path / f"f{k}", oracle, meta, 0) for k in (0, 1)]
    done = run_ensemble(folds, dataset, tmp_path / "out")
    assert done.returncode == 2 and "hold out folds [0, 0]" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
