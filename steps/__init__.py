"""Containerised pipeline steps. Each step is run as ``python -m steps.<name>``.

Steps never import from ``workflows/``; the small shared modules they need live here:
``errors`` (one-line failures), ``artifacts`` (MANIFEST.json and atomic publishing) and
``storage`` (everything that touches S3).
"""

import os

__version__ = "0.1.0"

# No device backend is loaded by `import torch` in a step: Habana's bridge fixes its lazy or
# eager mode when it is imported, so steps.devices imports it itself, after setting
# PT_HPU_LAZY_MODE from --hpu-mode (torch >= 2.5's switch, and Habana's own).
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("PT_HPU_AUTOLOAD", "0")
