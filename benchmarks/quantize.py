"""10. INT8 on CPU: the quantize step's model against the FP32 ONNX model in onnxruntime,
img/s at batch 1 and 16, rounds alternated; OpenVINO (FP32 held to f32, its default precision,
and NNCF INT8) where installed, each row naming the precision the runtime really computes in.

The network is the anchors' (32 filters, 6 levels) at the patch size, calibrated by
``steps.quantize`` on real slices of a synthetic dataset made by the real steps. Its
weights are untrained: speed does not depend on them, and the Dice gate is the step's
own, measured on a trained model by the tests and by ``run --local``. The CPU's int8
instructions (AVX-512 VNNI, AVX-VNNI, AMX) are recorded with the figures.
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import Row, Settings, in_child, throughput, step_dataset
from steps import convert, params, predict, quantize
from steps.dataset import open_cases, read_metadata
from steps.model import ModelConfig, build_model

ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "amx_bf16")


def cpu_isa() -> dict[str, bool]:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    return {flag: flag in flags for flag in ISA_FLAGS}


def _openvino(fp32: Path, calibration, keep: list[str]) -> tuple[dict, str]:
    """OpenVINO's models: the FP32 model held to f32, the same at the CPU plugin's default
    precision (bf16 where the CPU has AMX or AVX-512 BF16: its "FP32" is not FP32 there) and
    the quantize step's NNCF INT8 IR; and why they are left out ({} with the reason: no
    openvino, or its CPU plugin cannot compile them on this instruction set, e.g. under
    ONEDNN_MAX_CPU_ISA=AVX2)."""
    made = quantize.openvino_ir(fp32, fp32.with_name("int8-openvino.xml"), calibration, keep)
    if made is None:
        return {}, "openvino and nncf are not installed"
    if made[0] is None:
        return {}, made[1]
    import openvino as ov
    model = ov.convert_model(str(fp32))
    try:
        compiled = {"openvino_fp32": ov.Core().compile_model(
                        model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}),
                    "openvino_default": ov.Core().compile_model(model, "CPU")}
    except RuntimeError as exc:
        return {}, f"OpenVINO's CPU plugin cannot compile the FP32 model here ({exc!s:.160})"
    if precision_used("openvino_default", compiled["openvino_default"]) == "f32":
        del compiled["openvino_default"]          # the same model as openvino_fp32 here
    return {**compiled, "openvino_int8": made[0]}, ""


def precision_used(name: str, runner) -> str:
    """The precision a runtime really computes in: OpenVINO's compiled model says it
    (INFERENCE_PRECISION_HINT as resolved for this CPU); onnxruntime's CPU provider computes
    the FP32 model in f32 and the QDQ model's convolutions in int8."""
    if name.startswith("openvino"):
        return runner.get_property("INFERENCE_PRECISION_HINT").get_type_name()  # "f32", "bf16"
    return {"fp32": "f32", "int8": "int8 (QDQ; first and last convolutions f32)"}[name]


def measure(workdir: str, dataset: str, patch, batches, repeats: int, rounds: int,
            filters: int, levels: int) -> dict:

    torch.manual_seed(0)
    config = ModelConfig(base_filters=filters, levels=levels)
    net = build_model(config, deep_supervision=False).eval()
    fp32, int8 = Path(workdir) / "fp32.onnx", Path(workdir) / "int8.onnx"
    program, example = convert.export_program(net, config.in_channels, config.size_multiple())
    convert.write_onnx(program, example, fp32, 17, {"benchmark": "true"})
    meta = read_metadata(dataset)
    cases = open_cases(dataset, meta, [c["name"] for c in meta["cases"]])
    calibration = quantize.calibration_set(cases, 32, 0, tuple(patch))
    start = time.perf_counter()
    spec = params.by_name(params.QUANTIZE)     # the step's defaults
    kept = quantize.quantize(fp32, int8, calibration, spec["calibration_method"].default,
                             spec["float_layers"].default)
    quantize_s = time.perf_counter() - start
    sessions = {"fp32": predict.open_session(fp32), "int8": predict.open_session(int8)}
    runners = {name: (lambda s: lambda x: s.run(None, {predict.INPUT_NAME: x}))(s)
               for name, s in sessions.items()}
    openvino, left_out = _openvino(fp32, calibration, kept)
    runners.update({name: (lambda c: lambda x: c(x))(compiled)
                    for name, compiled in openvino.items()})
    used = {**{name: precision_used(name, None) for name in sessions},
            **{name: precision_used(name, compiled) for name, compiled in openvino.items()}}
    out = {"quantize_s": quantize_s, "runtimes": sorted(runners), "rates": {},
           "precision_used": used, "openvino_left_out": left_out}
    for batch in batches:
        x = np.random.default_rng(0).standard_normal(
            (batch, config.in_channels, *patch)).astype(np.float32)
        rates = {name: [] for name in runners}
        for round_ in range(rounds):
            order = list(runners) if round_ % 2 == 0 else list(reversed(runners))
            for name in order:
                rates[name].append(throughput(runners[name], x, repeats))
        out["rates"][str(batch)] = {name: statistics.median(r) for name, r in rates.items()}
        out["rates"][f"{batch}_rounds"] = rates
    return out


def run(settings: Settings) -> dict:
    patch = "x".join(map(str, settings.patch))
    dataset = step_dataset(settings.workdir / "quantize", "synthetic://?cases=3&shape="
                           + "x".join(map(str, settings.shape[:2])) + "x24&seed=3", patch)
    batches = (1, settings.batch)
    result, rss = in_child(measure, str(settings.workdir), str(dataset), settings.patch, batches,
                           settings.onnx_runs, 2 if settings.smoke else 4,
                           settings.base_filters, settings.levels,
                           threads=len(os.sched_getaffinity(0)))
    rows = []
    for batch in batches:
        rates = result["rates"][str(batch)]
        rows.append(Row("quantize", f"img/s, batch {batch}, INT8 onnxruntime", "img/s",
                        rates["int8"], rates["fp32"], "FP32 onnxruntime",
                        ">= 2" if batch == settings.batch else ""))
        used = result["precision_used"]
        for name, label in (("openvino_fp32", "OpenVINO FP32"),
                            ("openvino_default", "OpenVINO at its default precision"),
                            ("openvino_int8", "OpenVINO NNCF INT8")):
            if name in rates:
                rows.append(Row("quantize", f"img/s, batch {batch}, {label} (computes in "
                                f"{used[name]})", "img/s", rates[name], rates["fp32"],
                                "FP32 onnxruntime"))
    return {"rows": rows, "details": {**result, "isa": cpu_isa(), "patch": list(settings.patch),
                                      "peak_rss_bytes": rss}}
