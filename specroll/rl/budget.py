"""A run's budget on this machine: its bounds and its memory estimate, before any load.

Every setting that sizes memory is bounded by what the policy's context window allows
(`rl.limits`, from its config.json or GGUF metadata, no weights loaded), and the run's
estimated peak memory (`rl.memory_estimate`) is checked against what the devices it will
use have, so a run that cannot fit stops at once with one line naming the settings, the
values and the limits. The command line checks it before loading the policy
(`check_run`); a `Trainer` built from Python with its policy at hand, when it is built
(`check_loaded`).
"""

from __future__ import annotations

import os

from specroll.model.config import ModelConfig
from specroll.rl.config import TrainConfig
from specroll.rl.limits import check_bounds, prompt_tokens, read_model_config
from specroll.rl.memory_estimate import Part, check_memory, estimate, memory_shortfall


def check_budget(
    cfg: TrainConfig, model: ModelConfig, available: int | dict[str, int], prompt: int
) -> None:
    """Every bound of a run (`check_bounds`, then the memory estimate against `available`
    bytes): pure, so tests give it any model and any amount of memory."""
    check_bounds(cfg, model, prompt)
    check_memory(estimate(cfg, model, prompt), available)


# ---------------------------------------------------------------------- this machine


def available_memory(device, installed: bool = False) -> int:
    """Bytes free for a new run on `device` (a torch.device), or all it has (`installed`):
    the GPU's, or the host's MemAvailable / MemTotal (/proc/meminfo; else psutil, else
    the page counts)."""
    if device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return int(total if installed else free)
    key = "MemTotal:" if installed else "MemAvailable:"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total if installed else vm.available)
    except ImportError:
        pages = "SC_PHYS_PAGES" if installed else "SC_AVPHYS_PAGES"
        return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")


def _devices(cfg: TrainConfig) -> tuple[str, str]:
    """The devices of the local sides (rollout, learner; a side that runs elsewhere counts
    as the CPU)."""
    import torch

    from specroll.device import resolve_device

    cpu = torch.device("cpu")
    local = cfg.rollout.backend == "local"
    rollout = resolve_device(cfg.rollout.device, "rollout.device") if local else cpu
    local = cfg.learner_placement() == "local"
    learner = resolve_device(cfg.learner.device, "learner.device") if local else cpu
    return str(rollout), str(learner)


def _memory(devices: tuple[str, str], installed: bool) -> dict[str, int]:
    import torch

    return {d: available_memory(torch.device(d), installed) for d in {"cpu", *devices}}


def check_run(cfg: TrainConfig, items: list | None = None) -> str | None:
    """`check_bounds` and the memory estimate for this machine: the policy's config read
    from disk (no weights), the memory of the devices the run will use. A run that
    cannot fit in what the devices have is refused; one that exceeds what is free now
    (other processes may end, the estimate is generous) gets the returned warning.
    items: a file task's problems."""
    parts = check_loaded(cfg, read_model_config(cfg.policy.model), items)
    short = memory_shortfall(parts, _memory(_devices(cfg), installed=False), "free now")
    return f"{short}: it may not fit" if short else None


def check_loaded(cfg: TrainConfig, model: ModelConfig, items: list | None = None) -> list[Part]:
    """The refusals of `check_run` for a policy whose config is at hand (a `Trainer`
    built from Python, where the command line's check did not run): the bounds, and the
    estimate against the memory the devices have. Returns the estimate's parts."""
    prompt = prompt_tokens(cfg, items)
    check_bounds(cfg, model, prompt)
    devices = _devices(cfg)
    parts = estimate(cfg, model, prompt, devices)
    check_memory(parts, _memory(devices, installed=True), "this machine has")
    return parts
