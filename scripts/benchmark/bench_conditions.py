"""The conditions a benchmark ran under: torch's thread count and the machine's load, before and after.

On a shared CPU the ratios move with what else runs: with more runnable threads than cores, every system
gets slices of the cores, and a multi-threaded matmul waits for its slowest thread. `--threads 1` on an
otherwise idle machine gives the most repeatable numbers; the warning says when the run was not that.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

import torch
from rich.console import Console


def cpu_name() -> str:
    """The CPU's model name (lscpu's "Model name") and its widest x86 vector extension, from /proc/cpuinfo on
    Linux; elsewhere what `platform` knows."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields = {key.strip(): value.strip() for key, value in (line.split(":", 1) for line in info.splitlines()
                                                            if ":" in line)}
    flags = fields.get("flags", "").split()
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    return " ".join(x for x in (fields.get("model name", platform.machine()), vector) if x)


def snapshot() -> dict:
    load1, load5, load15 = os.getloadavg()
    return {"load1": load1, "load5": load5, "load15": load15}


def start() -> dict:
    return {"threads": torch.get_num_threads(), "cores": os.cpu_count() or 1, "load_before": snapshot()}


def contended(threads: int, cores: int, load1: float) -> bool:
    """Other work competes for the cores: more than half of them busy under a multi-threaded run, or not
    enough idle cores left for our threads. The load average counts our own threads only after a while,
    so `load_before` is the honest reading of everyone else."""
    return (threads > 1 and load1 > 0.5 * cores) or load1 > cores - threads


def finish(conditions: dict, console: Console) -> None:
    conditions["load_after"] = snapshot()
    threads, cores = conditions["threads"], conditions["cores"]
    before, after = conditions["load_before"]["load1"], conditions["load_after"]["load1"]
    console.print(f"torch threads {threads} of {cores} cores; load average (1 min) {before:.2f} before, "
                  f"{after:.2f} after")
    if contended(threads, cores, before):
        console.print(f"[yellow]warning: load {before:.2f} on {cores} cores with {threads} torch thread(s) means "
                      "other work shared the CPU; ratios may move between runs. For stable numbers run with "
                      "--threads 1 on an idle machine.[/]")
