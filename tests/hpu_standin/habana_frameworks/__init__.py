"""STAND-IN for Habana's package, for tests only (see tests/hpu_standin/README.md)."""
import json
import os

STANDIN = True


def record(event: str, **fields) -> None:
    with open(os.environ["HPU_STANDIN_LOG"], "a") as handle:
        handle.write(json.dumps({"event": event, **fields}) + "\n")
