"""Clocks for latency profiling, and the description of the machine measured on.

On CUDA every clock reading first synchronizes the device, so a reading is taken after the work
queued before it has finished; a whole request is additionally timed with CUDA events recorded on
the current stream. On CPU both are `time.perf_counter`.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable

import torch


def make_clock(device: torch.device | str) -> Callable[[], float]:
    """A seconds clock that waits for queued GPU work first when `device` is CUDA.

    Args:
        device: where the models run.

    Returns:
        A zero-argument function returning seconds (`time.perf_counter` scale).
    """
    if torch.device(device).type != "cuda":
        return time.perf_counter

    def synchronized_clock() -> float:
        torch.cuda.synchronize()
        return time.perf_counter()

    return synchronized_clock


class RequestTimer:
    """Times one request: `with timer: ...`, then `timer.start_s` (clock reading at entry) and
    `timer.elapsed_s` (CUDA-event time on CUDA, else the clock's difference).

    Args:
        clock: the profiling clock (`make_clock`).
        device: where the models run.
    """

    def __init__(self, clock: Callable[[], float], device: torch.device | str):
        self.clock = clock
        self.cuda = torch.device(device).type == "cuda"
        self.start_s = 0.0
        self.elapsed_s = 0.0
        self._events = None

    def __enter__(self) -> "RequestTimer":
        self.start_s = self.clock()
        if self.cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self._events[1].record()
            self._events[1].synchronize()
            self.elapsed_s = self._events[0].elapsed_time(self._events[1]) / 1000.0
        else:
            self.elapsed_s = self.clock() - self.start_s


def timing_method(device: torch.device | str) -> str:
    """How `RequestTimer` and `make_clock` measure on `device`, for the report."""
    if torch.device(device).type == "cuda":
        return "CUDA events per request; torch.cuda.synchronize() + perf_counter at step boundaries"
    return "time.perf_counter (CPU)"


def machine_description(device: torch.device | str) -> dict:
    """CPU model, core count, torch threads, OS, and the GPU name when `device` is CUDA."""
    description = {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "device": str(device),
        "gpu": None,
    }
    if torch.device(device).type == "cuda":
        index = torch.device(device).index or 0
        description["gpu"] = torch.cuda.get_device_name(index)
        description["gpu_memory_gib"] = round(torch.cuda.get_device_properties(index).total_memory / 2**30, 1)
    return description


def software_versions() -> dict:
    """Versions of Python, torch, transformers and blockpilot (CUDA too when torch has it)."""
    import transformers

    import blockpilot

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "blockpilot": blockpilot.__version__,
    }


def _cpu_model() -> str:
    """`model name` from /proc/cpuinfo, else `platform.processor()`."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as lines:
            for line in lines:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
