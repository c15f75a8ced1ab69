"""STAND-IN: importing it records PT_HPU_LAZY_MODE and registers a recording hpu_backend."""
import os

import torch
from torch._dynamo import register_backend

from habana_frameworks import record

record("import", lazy_mode=os.environ.get("PT_HPU_LAZY_MODE"))


@register_backend(name="hpu_backend")
def _hpu_backend(graph_module, example_inputs):
    record("hpu_backend_compile", nodes=len(graph_module.graph.nodes))
    return graph_module.forward
