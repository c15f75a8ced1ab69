"""STAND-IN: FusedAdamW is torch's AdamW that records its construction and steps."""
import torch

from habana_frameworks import record


class FusedAdamW(torch.optim.AdamW):
    def __init__(self, params, **kwargs):
        record("FusedAdamW", **{k: v for k, v in kwargs.items()})
        super().__init__(params, **kwargs)

    def step(self, closure=None):
        record("FusedAdamW.step")
        return super().step(closure)
