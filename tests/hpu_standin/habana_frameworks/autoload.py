"""STAND-IN of the bridge's torch autoload hook (bridge 1.18/1.19 ``autoload/__init__.py``):
`import torch` imports the bridge, and so fixes its mode, when PT_HPU_AUTOLOAD=1, or when it
is unset and PT_HPU_LAZY_MODE is 0; PT_HPU_AUTOLOAD=0 (or torch's own
TORCH_DEVICE_BACKEND_AUTOLOAD=0) turns it off."""
import importlib
import os


def load() -> None:
    forced = os.environ.get("PT_HPU_AUTOLOAD")
    if forced == "0":
        return
    if forced is None and os.environ.get("PT_HPU_LAZY_MODE", "1") == "1":
        return
    importlib.import_module("habana_frameworks.torch")
