"""STAND-IN: reports $HPU_STANDIN_DEVICES devices (default 8)."""
import os

from habana_frameworks import record


def is_available() -> bool:
    return True


def device_count() -> int:
    return int(os.environ.get("HPU_STANDIN_DEVICES", "8"))


def synchronize() -> None:
    record("synchronize")
