"""The machine a benchmark ran on: CPU, cores, threads, library versions, load average, and the
source tree's commit."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict:
    import transformers

    info = {
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_model(),
        "load_average_start": load_average(),
        "exactspec_git": _git_state(),
    }
    return info


def _git_state() -> str | None:
    """The source tree's commit (with "+dirty" for uncommitted changes in the package), when it
    is a git checkout: a benchmark is only comparable with runs of the same engine."""
    import subprocess

    package = Path(__file__).resolve().parents[1]  # src/exactspec
    try:
        commit = subprocess.run(["git", "-C", str(package), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=5)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(package), "status", "--porcelain", "--", "."],
                               capture_output=True, text=True, timeout=5)
        return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None
