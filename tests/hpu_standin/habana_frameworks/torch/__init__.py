"""STAND-IN: importing it fixes the mode from PT_HPU_LAZY_MODE (as the bridge does; lazy
unless set to 0), records it, and registers an hpu_backend that records every compile with
its input shapes and whether they were dynamic."""
import os

import torch
from torch._dynamo import register_backend

from habana_frameworks import record

LAZY = os.environ.get("PT_HPU_LAZY_MODE", "1") != "0"
record("import", lazy_mode=os.environ.get("PT_HPU_LAZY_MODE"), lazy=LAZY)


@register_backend(name="hpu_backend")
def _hpu_backend(graph_module, example_inputs):
    shapes = [list(map(str, x.shape)) for x in example_inputs if isinstance(x, torch.Tensor)]
    dynamic = any(not isinstance(d, int) for x in example_inputs
                  if isinstance(x, torch.Tensor) for d in x.shape) or \
        any(isinstance(x, torch.SymInt) for x in example_inputs)
    record("hpu_backend_compile", nodes=len(graph_module.graph.nodes), shapes=shapes,
           dynamic=dynamic)
    return graph_module.forward
