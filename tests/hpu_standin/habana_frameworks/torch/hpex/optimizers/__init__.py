"""STAND-IN: FusedAdamW with the bridge's defaults (eps 1e-6 and weight decay 0, not torch
AdamW's 1e-8 and 1e-2), recording its construction and steps; in lazy mode its step ends
with mark_step, as the bridge's does."""
import torch

import habana_frameworks.torch as bridge
from habana_frameworks import record


class FusedAdamW(torch.optim.AdamW):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
                 bias_correction=True):
        record("FusedAdamW", lr=lr, betas=list(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def step(self, closure=None):
        record("FusedAdamW.step")
        loss = super().step(closure)
        if bridge.LAZY:
            record("mark_step", by="FusedAdamW")
        return loss
