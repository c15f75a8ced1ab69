"""Acceptance check of a training device, in about five minutes: run it first on a new node.

    python -m steps.device_check [--device auto] [--devices 8] [--json report.json]

On a Gaudi node (or inside the Gaudi image), a GPU, or a CPU, it trains the anchors'
network on synthetic 2D slices of one fixed shape, as ``steps.train`` does (the same device
selection, backend settings, compile-then-DDP order, autocast and train step), for every
mode the device has, each in a process of its own (an HPU: compile and lazy, since Habana's
bridge fixes its mode when it is imported; CUDA: eager, as ``steps.train`` runs, and
``torch.compile``; CPU: eager), on 1 device and, with ``--devices N``, on N under
``torch.distributed.run`` (hccl, nccl or gloo). Each row reports:

- img/s after the warm-up steps;
- graph compiles after the warm-up and at the end (Habana's ``graph_compilation`` metric on
  an HPU, ``torch._dynamo``'s graph count where torch.compile runs, none on a plain CPU);
- the mode in effect, as the bridge reports it;
- the largest relative difference of the first losses from the same steps in fp32 on the
  CPU (same initial weights, same batches).

It exits 1, after printing every row, on a recompile storm (any compile after the warm-up:
every step has the same shape), on a mode that is not the one asked for, or on losses
outside the parity bound (``--parity``: 0.1 under bf16/fp16 autocast, 1e-3 in fp32).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

from steps import limits, params
from steps.errors import OneLineArgumentParser, run_main

# torch, Habana's bridge and the training modules are imported inside the functions that
# run in a worker process: the bridge fixes its execution mode when it is imported, so the
# parent, which starts one worker per mode, must never import them.

MARK = "device_check_result="
PARITY_STEPS = 5
MODES = {"hpu": params.HPU_MODES[:2], "cuda": ("eager", "compile"), "cpu": ("eager",)}


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="python -m steps.device_check",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=params.DEVICE_KINDS)
    p.add_argument("--devices", type=int, default=1,
                   help="also run on this many devices of one node (default: 1 only)")
    p.add_argument("--precision", default="auto", choices=params.PRECISIONS)
    p.add_argument("--steps", type=int, default=20, help="training steps per run")
    p.add_argument("--warmup", type=int, default=3, help="steps before compiles must stop")
    p.add_argument("--batch", type=int, default=8, help="slices per step per device")
    p.add_argument("--size", type=int, default=192, help="slice height and width")
    p.add_argument("--filters", type=int, default=32, help="base filters (the anchors': 32)")
    p.add_argument("--levels", type=int, default=6, help="U-Net levels (the anchors': 6)")
    p.add_argument("--parity", type=float, default=None,
                   help="largest relative loss difference from fp32 CPU allowed")
    p.add_argument("--json", default=None, help="also write the report here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)   # one run: its mode
    return p


# ------------------------------------------------------------------------------ a run

def _batches(args: argparse.Namespace, info) -> list[tuple[Any, Any]]:
    """PARITY_STEPS batches, the same on every rank (so that N devices take exactly the
    single device's steps and every row compares with the one CPU reference), placed on the
    device once: the steps then cycle through them, and img/s is the device's own rate."""
    import torch
    from steps import devices
    gen = torch.Generator().manual_seed(1234)
    return [(devices.to_device(torch.randn(args.batch, 4, args.size, args.size, generator=gen),
                               info),
             torch.randint(0, 4, (args.batch, args.size, args.size), generator=gen)
             .to(info.device)) for _ in range(PARITY_STEPS)]


def compiles(info) -> int:
    """Graph compiles so far: Habana's metric on an HPU, torch._dynamo's elsewhere."""
    if info.kind == "hpu":
        from habana_frameworks.torch.hpu.metrics import metric_global
        return int(dict(metric_global("graph_compilation").stats()).get("TotalNumber", 0))
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def train_losses(args: argparse.Namespace, info, world: int) -> dict[str, Any]:
    """The steps of one run: first losses, compiles at the warm-up and at the end, img/s."""
    import torch
    from steps import devices
    from steps.losses import DeepSupervisionLoss
    from steps.model import ModelConfig, build_model
    from steps.train import forwards, train_step

    devices.configure_backends(info)
    torch.manual_seed(0)
    net = devices.prepare_model(build_model(ModelConfig(base_filters=args.filters,
                                                        levels=args.levels)), info)
    train_forward, _ = forwards(net, info, world, compile_cuda=args.worker == "compile")
    optimizer = devices.make_optimizer("adamw", net.parameters(), 1e-3, 0.0, info)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cuda", enabled=info.needs_grad_scaler())
    batches = _batches(args, info)
    losses, warm, start = [], 0, time.perf_counter()
    for step in range(args.steps):
        loss = train_step(train_forward, DeepSupervisionLoss(), optimizer, scheduler, scaler,
                          info, *batches[step % PARITY_STEPS])
        if step < PARITY_STEPS:
            losses.append(float(loss))
        if step + 1 == args.warmup:
            devices.synchronize(info)
            warm, start = compiles(info), time.perf_counter()
    devices.synchronize(info)
    timed = max(args.steps - args.warmup, 1)
    return {"losses": losses, "compiles_warmup": warm, "compiles_end": compiles(info),
            "img_per_s": timed * args.batch * world / (time.perf_counter() - start)}


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One run in this process (or this rank of a torch.distributed.run job)."""
    from steps import devices
    world = int(os.environ.get("WORLD_SIZE", 1))
    info = devices.select_device(args.device, args.precision, args.worker,
                                 int(os.environ.get("LOCAL_RANK", 0)))
    threads = limits.set_threads(limits.threads())    # this rank's share (spawn)
    if world > 1:
        devices.init_distributed(info)
    result = train_losses(args, info, world)
    lazy = devices.lazy_mode_in_effect() if info.kind == "hpu" else None
    result.update(kind=info.kind, precision=info.precision, devices=world, mode=args.worker,
                  threads=threads,
                  mode_in_effect=("lazy" if lazy else "compile") if lazy is not None else
                  "unknown" if info.kind == "hpu" else args.worker)
    if world > 1:
        import torch.distributed as dist
        dist.destroy_process_group()
    return result


# --------------------------------------------------------------------------- the check

def spawn(args: argparse.Namespace, mode: str, devices: int) -> dict[str, Any]:
    """A worker process (under torch.distributed.run for several devices); its result."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
             if k not in ("devices", "json", "worker", "parity") and v is not None]
    # The launcher's folder for the ranks' error files is removed with ``logs`` (left to
    # itself it keeps one in the temporary directory: steps.train.relaunch).
    with tempfile.TemporaryDirectory(prefix="unet-check-ranks-") as logs:
        runner = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={devices}", f"--log-dir={logs}", "-m",
                   "steps.device_check"] if devices > 1
                  else [sys.executable, "-m", "steps.device_check"])
        # Each rank an equal share of the CPUs this process has, as steps.train.relaunch.
        share = {"OMP_NUM_THREADS": str(max(1, limits.threads() // devices))}
        done = subprocess.run(runner + flags + ["--worker", mode], capture_output=True,
                              text=True, env={**os.environ, **share})
    for line in done.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"mode": mode, "devices": devices, "failed": f"exit {done.returncode}: {tail}"}


def verdict(row: dict[str, Any], reference: list[float], bound: float) -> list[str]:
    """What is wrong with a run (empty: nothing)."""
    if "failed" in row:
        return [row["failed"]]
    problems = []
    if row["compiles_end"] > row["compiles_warmup"]:
        problems.append(f"recompiled after the warm-up ({row['compiles_warmup']} → "
                        f"{row['compiles_end']} graphs, one shape throughout)")
    if row["kind"] == "hpu" and row["mode_in_effect"] != row["mode"]:
        problems.append(f"asked for {row['mode']} mode, the bridge runs {row['mode_in_effect']}")
    row["parity"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(row["losses"], reference))
    if row["parity"] > bound:
        problems.append(f"first losses differ from fp32 CPU by {row['parity']:.3g} "
                        f"(bound {bound:g})")
    return problems


def check(args: argparse.Namespace) -> int:
    from steps import devices
    kind = devices.resolve_kind(args.device)
    modes = MODES[kind]
    # The reference only gives the first losses: it runs just those steps.
    cpu = argparse.Namespace(**{**vars(args), "device": "cpu", "precision": "fp32",
                                "steps": min(args.steps, PARITY_STEPS), "warmup": 1})
    reference = spawn(cpu, "eager", 1)
    if "failed" in reference:
        print(f"error: device_check: the fp32 CPU reference run failed: {reference['failed']}",
              file=sys.stderr)
        return 1
    rows, failed = [], False
    for mode in modes:
        for n in sorted({1, args.devices}):
            row = spawn(args, mode, n)
            exact = row.get("precision", "fp32") == "fp32"
            row["problems"] = verdict(row, reference["losses"],
                                      args.parity if args.parity is not None
                                      else (1e-3 if exact else 0.1))
            failed |= bool(row["problems"])
            rows.append(row)
            print(_line(row), flush=True)
    report = {"device": kind, "reference": reference, "runs": rows, "ok": not failed}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    print(f"device_check: {'ok' if not failed else 'FAILED'} ({kind})")
    return 1 if failed else 0


def _line(row: dict[str, Any]) -> str:
    if "failed" in row:
        return f"{row['mode']:8} x{row['devices']}  failed: {row['failed']}"
    return (f"{row['mode']:8} x{row['devices']}  {row['kind']} {row['precision']:5} "
            f"{row['img_per_s']:9.1f} img/s  compiles {row['compiles_warmup']}→"
            f"{row['compiles_end']}  mode in effect {row['mode_in_effect']:8} "
            f"loss parity {row.get('parity', float('nan')):.3g}  "
            + ("ok" if not row["problems"] else "; ".join(row["problems"])))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker is None:
        return check(args)
    result = worker(args)
    if int(os.environ.get("RANK", 0)) == 0:
        print(MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
