"""Everything device-specific for training: the one place that knows about HPU, CUDA and CPU.

- Device choice: ``hpu`` when ``habana_frameworks.torch`` imports and reports HPUs, else
  ``cuda``, else ``cpu``; ``--device`` overrides, and a requested kind that is absent is a
  StepError.
- Distributed backend: hccl (HPU), nccl (CUDA), gloo (CPU).
- Precision: bf16 autocast on HPU; bf16 (fp16 with a GradScaler where bf16 is unsupported) on
  CUDA; fp32 on CPU.
- Optimizers: AdamW, SGD and Habana's FusedAdamW.
- HPU execution mode: ``compile`` (``PT_HPU_LAZY_MODE=0`` and
  ``torch.compile(backend="hpu_backend")``, Habana's current recommendation), ``lazy``
  (``PT_HPU_LAZY_MODE=1`` and ``mark_step()`` after backward and after ``optimizer.step``) or
  ``eager``.
- CPU allocator: :func:`jemalloc_env` preloads Debian's libjemalloc2 when it exists.

Habana modules are imported only on the HPU path, so this module runs on stock PyTorch.
"""
from __future__ import annotations

import contextlib
import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from steps import limits
from steps.errors import StepError
from steps.params import (CUDA_COMPILE_MODES, DEVICE_KINDS, HPU_MODES, OPTIMIZERS,
                          PRECISIONS)

BACKENDS = {"hpu": "hccl", "cuda": "nccl", "cpu": "gloo"}
JEMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
                  "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


@dataclass(frozen=True)
class DeviceInfo:
    """The chosen device. ``dtype`` is the autocast dtype (None: plain fp32)."""
    kind: str                 # "hpu" | "cuda" | "cpu"
    device: torch.device
    dtype: torch.dtype | None
    hpu_mode: str = "eager"   # only meaningful for kind == "hpu"
    channels_last: bool = False   # 4D images and the model in channels_last (CUDA only)

    @property
    def backend(self) -> str:
        return BACKENDS[self.kind]

    @property
    def precision(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}[self.dtype]

    @property
    def lazy(self) -> bool:
        return self.kind == "hpu" and self.hpu_mode == "lazy"

    def autocast(self):
        """Autocast context for forward passes; a no-op for fp32."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def needs_grad_scaler(self) -> bool:
        return self.kind == "cuda" and self.dtype == torch.float16


def set_hpu_mode_env(hpu_mode: str) -> None:
    """``PT_HPU_LAZY_MODE`` must be set before habana_frameworks is first imported: the
    bridge fixes the mode then. Importing ``steps`` switches torch's backend autoload off
    (steps/__init__.py), so that import happens here, in :func:`_habana`, after this."""
    if hpu_mode not in HPU_MODES:
        raise StepError(f"--hpu-mode must be one of {', '.join(HPU_MODES)}, got '{hpu_mode}'")
    os.environ["PT_HPU_LAZY_MODE"] = "1" if hpu_mode == "lazy" else "0"


def _habana():
    """Import ``habana_frameworks.torch`` (registers the hpu device); None if absent."""
    try:
        return importlib.import_module("habana_frameworks.torch")
    except ImportError:
        return None


def lazy_mode_in_effect() -> bool | None:
    """Whether the imported bridge runs lazy mode (``utils.internal.is_lazy``); None when
    it cannot say."""
    try:
        return bool(importlib.import_module("habana_frameworks.torch.utils.internal").is_lazy())
    except (ImportError, AttributeError):
        return None


def check_hpu_mode(hpu_mode: str) -> None:
    """The mode the bridge runs must be the one asked for: a bridge imported before the
    mode was set (torch's autoload, or code that imported it early) keeps its own."""
    lazy = lazy_mode_in_effect()
    if lazy is not None and lazy != (hpu_mode == "lazy"):
        raise StepError(f"--hpu-mode {hpu_mode}: the Habana bridge runs "
                        f"{'lazy' if lazy else 'eager/compile'} mode, fixed when it was "
                        "imported before the step set PT_HPU_LAZY_MODE (import steps before "
                        "torch, or set TORCH_DEVICE_BACKEND_AUTOLOAD=0 and PT_HPU_AUTOLOAD=0)")


def hpu_count() -> int:
    if _habana() is None:
        return 0
    hpu = importlib.import_module("habana_frameworks.torch.hpu")
    return int(hpu.device_count()) if hpu.is_available() else 0


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def available_count(kind: str) -> int:
    """Devices of ``kind`` this process can use; for the CPU, the CPUs its cgroup quota,
    affinity mask or ``UNET_CPUS`` gives it (not the node's cores)."""
    if kind == "hpu":
        return hpu_count()
    if kind == "cuda":
        return cuda_count()
    return limits.cpu_count()


def resolve_kind(requested: str, hpu_mode: str = "compile") -> str:
    """``auto`` → hpu, cuda or cpu, the first present; a named kind must be present."""
    if requested not in DEVICE_KINDS:
        raise StepError(f"--device must be one of {', '.join(DEVICE_KINDS)}, got '{requested}'")
    if requested in ("auto", "hpu"):
        set_hpu_mode_env(hpu_mode)
        if hpu_count() > 0:
            check_hpu_mode(hpu_mode)
            return "hpu"
        if requested == "hpu":
            raise StepError("--device hpu: no Gaudi HPU found (habana_frameworks.torch is "
                            "not installed or reports no devices)")
    if requested in ("auto", "cuda"):
        if cuda_count() > 0:
            return "cuda"
        if requested == "cuda":
            raise StepError("--device cuda: no CUDA GPU found (torch.cuda.is_available() is "
                            "False)")
    return "cpu"


def autocast_dtype(kind: str, precision: str) -> torch.dtype | None:
    """``auto`` gives bf16 on HPU, bf16/fp16 on CUDA (by support), fp32 on CPU."""
    if precision not in PRECISIONS:
        raise StepError(f"--precision must be one of {', '.join(PRECISIONS)}, "
                        f"got '{precision}'")
    if precision == "auto":
        if kind == "hpu":
            return torch.bfloat16
        if kind == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return None
    if precision == "fp16" and kind != "cuda":
        raise StepError(f"--precision fp16 is supported on cuda only, not on {kind}")
    return _DTYPES[precision]


def select_device(requested: str = "auto", precision: str = "auto",
                  hpu_mode: str = "compile", local_rank: int = 0,
                  channels_last: bool = False) -> DeviceInfo:
    """Choose the device for this process (``local_rank`` picks the GPU under DDP);
    ``channels_last`` applies on CUDA only."""
    kind = resolve_kind(requested, hpu_mode)
    if kind == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device(kind)
    return DeviceInfo(kind=kind, device=device, dtype=autocast_dtype(kind, precision),
                      hpu_mode=hpu_mode if kind == "hpu" else "eager",
                      channels_last=channels_last and kind == "cuda")


def load_backend(info: DeviceInfo) -> str:
    """Make the process-group backend available (hccl needs Habana's module); return it."""
    if info.kind == "hpu":
        importlib.import_module("habana_frameworks.torch.distributed.hccl")
    return info.backend


def init_distributed(info: DeviceInfo) -> None:
    """Join the process group started by ``torch.distributed.run`` (env:// rendezvous)."""

    load_backend(info)
    kwargs: dict[str, Any] = {}
    if info.kind == "cuda":
        kwargs["device_id"] = info.device
    dist.init_process_group(backend=info.backend, **kwargs)


def wrap_ddp(model: torch.nn.Module, info: DeviceInfo) -> torch.nn.Module:
    """DDP with the anchors' HPU settings (bucket 125 MB, grads as bucket views, static graph)."""

    if info.kind == "hpu":
        return DDP(model, bucket_cap_mb=125, gradient_as_bucket_view=True, static_graph=True)
    if info.kind == "cuda":
        return DDP(model, device_ids=[info.device.index], gradient_as_bucket_view=True)
    return DDP(model)


def configure_backends(info: DeviceInfo) -> None:
    """Process-wide kernel choices of a training run: deterministic kernels on the CPU (the
    result does not depend on the thread count), cuDNN's autotuner on CUDA (one shape
    throughout, so it tunes once)."""
    if info.kind == "cpu":
        torch.use_deterministic_algorithms(True)
    elif info.kind == "cuda":
        torch.backends.cudnn.benchmark = True


def host_to_device(tensor: torch.Tensor, device: torch.device,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor on the device without stalling the host: on CUDA a copy from pageable
    memory (or a blocking one) waits for every kernel queued before it, so the tensor goes
    through pinned memory and the copy stays in the stream's order. On CUDA the bytes travel
    in their own dtype and are converted on the device (ATen's copy would convert on the
    host first: uint8 labels would cross the bus as int64, 8x the bytes)."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device, dtype)
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True).to(dtype or tensor.dtype)


def prepare_model(model: torch.nn.Module, info: DeviceInfo) -> torch.nn.Module:
    """Move ``model`` to the device (channels_last where ``info`` says so)."""
    model = model.to(info.device)
    if info.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def compile_for_device(module: torch.nn.Module, info: DeviceInfo,
                       compile_cuda: bool = False, cuda_mode: str = "default",
                       layout_opt: bool = False) -> torch.nn.Module:
    """What the loop calls: ``torch.compile(backend="hpu_backend", dynamic=False)`` in HPU
    compile mode (static shapes, as Habana's reference: the loop feeds one training shape
    and one validation shape), Inductor with ``cuda_mode``'s options on CUDA when
    ``compile_cuda`` (the training batch has one shape), else ``module``.

    ``layout_opt`` forces Inductor's layout optimization: the compiled graph keeps the
    tensors around every convolution channels_last. Its own heuristic
    (``GraphLowering.decide_layout_opt`` in torch/_inductor/graph.py) turns it off for any
    graph with a convolution whose input has twice its output's channels, which every
    decoder block of a U-Net has; cuDNN's bf16 kernels on Hopper are NHWC, so the
    contiguous graph pays a transpose before and after each convolution."""
    if info.kind == "hpu" and info.hpu_mode == "compile":
        return torch.compile(module, backend="hpu_backend", dynamic=False)
    if info.kind == "cuda" and compile_cuda:
        if cuda_mode not in CUDA_COMPILE_MODES:
            raise StepError(f"--cuda-compile-mode must be one of "
                            f"{', '.join(CUDA_COMPILE_MODES)}, got '{cuda_mode}'")
        return torch.compile(module, dynamic=False, options=inductor_options(cuda_mode,
                                                                              layout_opt))
    return module


def inductor_options(cuda_mode: str, layout_opt: bool) -> dict[str, bool]:
    """``torch.compile``'s options for ``cuda_mode`` (what ``mode=`` would set: torch takes
    one of the two) and the forced layout optimization."""
    from torch._inductor import list_mode_options  # 0.9 s to import: only when compiling

    return {**list_mode_options(cuda_mode, False), "force_layout_optimization": layout_opt}


def to_device(tensor: torch.Tensor, info: DeviceInfo) -> torch.Tensor:
    """Host batch → device (4D images in channels_last where ``info`` says so)."""
    tensor = host_to_device(tensor, info.device)
    if info.channels_last and tensor.dim() == 4:
        tensor = tensor.contiguous(memory_format=torch.channels_last)
    return tensor


def make_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float,
                   weight_decay: float, info: DeviceInfo) -> torch.optim.Optimizer:
    """AdamW / SGD (momentum 0.99, Nesterov, as nnU-Net) / a fused AdamW (eps 1e-8):
    Habana's FusedAdamW on an HPU, torch's single-kernel ``AdamW(fused=True)`` on CUDA."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, eps=1e-8)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, momentum=0.99,
                               nesterov=True)
    if name == "fusedadamw":
        check_fused_optimizer(info.kind)
        if info.kind == "cuda":
            return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, eps=1e-8,
                                     fused=True)
        optimizers = importlib.import_module("habana_frameworks.torch.hpex.optimizers")
        return optimizers.FusedAdamW(params, lr=lr, weight_decay=weight_decay, eps=1e-8)
    raise StepError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got '{name}'")


def check_fused_optimizer(kind: str) -> None:
    """``--optimizer fusedadamw`` exists on an HPU (Habana's) and on CUDA (torch's)."""
    if kind not in ("hpu", "cuda"):
        raise StepError(f"--optimizer fusedadamw needs --device hpu or cuda (a fused AdamW "
                        f"kernel), this run is on {kind}")


def mark_step(info: DeviceInfo) -> None:
    """Flush the lazy-mode graph on HPU; nothing elsewhere."""
    if info.lazy:
        importlib.import_module("habana_frameworks.torch.core").mark_step()


def synchronize(info: DeviceInfo) -> None:
    """Wait for queued device work (for honest img/s timings)."""
    if info.kind == "cuda":
        torch.cuda.synchronize(info.device)
    elif info.kind == "hpu":
        importlib.import_module("habana_frameworks.torch.hpu").synchronize()


def device_generator(info: DeviceInfo, seed: int) -> torch.Generator | None:
    """A generator that lives on the device (noise drawn there); None where unsupported."""
    if info.kind == "cpu":
        return torch.Generator().manual_seed(seed)
    try:
        return torch.Generator(device=info.device).manual_seed(seed)
    except (RuntimeError, TypeError):
        return None


def jemalloc_path() -> str | None:
    """Debian's libjemalloc2 if installed (``apt-get install libjemalloc2``)."""
    for path in JEMALLOC_PATHS:
        if Path(path).is_file():
            return path
    return None


def jemalloc_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default os.environ) with jemalloc added to LD_PRELOAD when present.

    The idea: glibc's malloc may return DynUNet's large activation buffers to the OS after
    every step and fault them back in on the next; jemalloc keeps them. Measured on the 2-core
    development machine (shared, noisy) it did NOT win: 0.6-0.7x glibc's img/s at 64x64,
    0.9x at 192x160 batch 16. So nothing preloads it by default; this helper is for
    measuring it on the target CPU nodes.
    """
    env = dict(os.environ if env is None else env)
    path = jemalloc_path()
    if path is None:
        return env
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if path not in preload:
        env["LD_PRELOAD"] = ":".join([path] + preload)
    return env
