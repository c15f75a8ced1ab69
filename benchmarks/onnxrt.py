"""5. ONNX on CPU: onnxruntime (steps.predict's session) vs torch eager, img/s at batch 16;
export time of steps.convert's export path (torch.export, then the dynamo ONNX exporter)."""
from __future__ import annotations

import os
import time

import torch

from benchmarks.common import Row, Settings, in_child, throughput
from steps import convert, predict
from steps.model import ModelConfig, build_model

OPSET = 17


def measure(path: str, patch, batch: int, runs: int, filters: int, levels: int) -> dict:

    torch.manual_seed(0)
    config = ModelConfig(base_filters=filters, levels=levels)
    net = build_model(config, deep_supervision=False).eval()
    start = time.perf_counter()
    program, example = convert.export_program(net, config.in_channels, config.size_multiple())
    opset = convert.write_onnx(program, example, path, OPSET, {"benchmark": "true"})
    export_s = time.perf_counter() - start
    x = torch.randn(batch, config.in_channels, *patch)
    session = predict.open_session(path)
    name = session.get_inputs()[0].name

    def eager(t):
        with torch.inference_mode():
            return net(t)

    ort_rate = throughput(lambda a: session.run(None, {name: a}), x.numpy(), runs)
    torch_rate = throughput(eager, x, runs)
    with torch.inference_mode():
        diff = float(abs(session.run(None, {name: x.numpy()})[0] - net(x).numpy()).max())
    return {"onnxruntime": ort_rate, "torch_eager": torch_rate, "export_s": export_s,
            "opset": opset, "max_abs_diff_logits": diff, "threads": torch.get_num_threads()}


def run(settings: Settings) -> dict:
    path = settings.workdir / "bench.onnx"
    result, rss = in_child(measure, str(path), settings.patch, settings.batch, settings.onnx_runs,
                           settings.base_filters, settings.levels,
                           threads=len(os.sched_getaffinity(0)))
    path.unlink(missing_ok=True)
    rows = [Row("onnx", f"img/s inference, batch {settings.batch}", "img/s",
                result["onnxruntime"], result["torch_eager"], "torch eager (inference_mode)",
                ">= 1")]
    return {"rows": rows, "details": {**result, "batch": settings.batch, "runs": settings.onnx_runs,
                                      "patch": list(settings.patch), "peak_rss_bytes": rss}}
