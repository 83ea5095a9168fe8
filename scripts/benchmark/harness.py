"""The one harness every benchmark shares: the conditions a run measured under (printed as one line that docs
quote and tests/test_doc_measured.py checks), rounds taken in alternating order, percentiles, a rich table,
the JSON report and a PNG. A benchmark script is then its workload and the systems it compares.

On a shared CPU the ratios move with what else runs: with more runnable threads than cores, every system gets
slices of the cores, and a multi-threaded matmul waits for its slowest thread. One torch thread on an
otherwise idle machine gives the most repeatable numbers; the warning says when a run was not that.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence, TypeVar

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
SEP = " · "
# The vector and matrix extensions the kernels and torch's matmuls use; the rest of /proc/cpuinfo's flags
# do not move these numbers.
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
T = TypeVar("T")


def cpu_name() -> str:
    """The CPU's model name (lscpu's "Model name") and its widest x86 vector extension."""
    model, flags = _cpuinfo()
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    return " ".join(x for x in (model, vector) if x)


def _cpuinfo() -> tuple[str, list[str]]:
    """Model name and the FLAGS present, from /proc/cpuinfo on Linux; elsewhere what `platform` knows."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), []
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in info.splitlines() if ":" in line)}
    present = set(fields.get("flags", "").split())
    return fields.get("model name", platform.machine()), [f for f in FLAGS if f in present]


def commit(code: Sequence[str] = ()) -> str:
    """The code the numbers belong to: HEAD's short hash, '+dirty' when the code measured differs from it (a
    table measured on uncommitted code names no code anyone can check out). The code measured: lessons/,
    shared/, this harness, the running script, and the other files a benchmark names in `code`."""
    import sys

    paths = ["lessons", "shared", str(Path(__file__).resolve()), str(Path(sys.argv[0]).resolve()), *code]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *paths], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def load1() -> float:
    return os.getloadavg()[0]


def contended(threads: int, cores: int, load: float) -> bool:
    """Other work competes for the cores: more than half of them busy under a multi-threaded run, or not
    enough idle cores left for our threads. The load average counts our own threads only after a while,
    so the reading before the run is the honest reading of everyone else."""
    return (threads > 1 and load > 0.5 * cores) or load > cores - threads


@dataclass
class Conditions:
    """What a run measured under. `backend` is the attention backend the engines really used (read back from
    them, not the option asked for); `threads` torch's intra-op threads in the processes that did the work."""
    commit: str
    cpu: str
    flags: str
    cores: int
    threads: int
    device: str
    dtype: str
    backend: str
    load_before: float
    load_after: float | None = None
    extra: dict[str, str] = field(default_factory=dict)  # what else a benchmark's numbers depend on

    def line(self) -> str:
        after = "?" if self.load_after is None else f"{self.load_after:.2f}"
        parts = [f"commit {self.commit}", f"cpu {self.cpu} ({self.flags or 'no avx2'})", f"cores {self.cores}",
                 f"threads {self.threads}", f"device {self.device}", f"dtype {self.dtype}",
                 f"backend {self.backend}", f"load {self.load_before:.2f} -> {after}"]
        parts += [f"{k} {v}" for k, v in self.extra.items()]
        return "conditions" + SEP + SEP.join(parts)


def start(device: str | torch.device = "cpu", dtype: str | torch.dtype = torch.float32, backend: str = "unknown",
          threads: int | None = None, code: Sequence[str] = ()) -> Conditions:
    """Read the machine and the load before a run. Fill in `backend` from the engine once it exists; `code`
    names the files besides lessons/, shared/ and the running script whose edits the numbers depend on."""
    model, flags = _cpuinfo()
    device = torch.device(device) if isinstance(device, str) else device
    name = model + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")
    return Conditions(commit=commit(code), cpu=name, flags=" ".join(flags), cores=os.cpu_count() or 1,
                      threads=torch.get_num_threads() if threads is None else threads, device=device.type,
                      dtype=str(dtype).removeprefix("torch."), backend=backend, load_before=load1())


def finish(conditions: Conditions, console: Console) -> Conditions:
    """Read the load after the run, print the conditions line, and warn when other work shared the CPU."""
    conditions.load_after = load1()
    console.print(conditions.line(), markup=False, highlight=False, soft_wrap=True)
    if contended(conditions.threads, conditions.cores, conditions.load_before):
        console.print(f"[yellow]warning: load {conditions.load_before:.2f} on {conditions.cores} cores with "
                      f"{conditions.threads} torch thread(s): other work shared the CPU and ratios may move "
                      "between runs. For stable numbers run with one thread on an idle machine.[/]")
    return conditions


def parse_line(line: str) -> dict[str, str]:
    """The fields of a printed conditions line, by name (what the doc test reads back)."""
    head, *parts = line.strip().strip("`").split(SEP)
    if head != "conditions":
        raise ValueError(f"not a conditions line: {line!r}")
    return {key: value for key, _, value in (p.partition(" ") for p in parts)}


def backend_name(engine_or_runner) -> str:
    """The attention backend an engine (or its runner) really uses: `auto` resolved, fallbacks included."""
    runner = getattr(engine_or_runner, "runner", engine_or_runner)
    backend = getattr(runner, "backend", None)
    return getattr(backend, "name", type(backend).__name__ if backend is not None else "none")


def resolve_backend(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> str:
    """What `--backend name` picks on this machine today, without building an engine's model."""
    from lessons.l3_block_tensor.backends import make_backend
    from shared.config import Qwen3Config
    from shared.tiny_qwen3 import default_model_dir

    return make_backend(name, Qwen3Config.from_dir(default_model_dir()), dtype, torch.device(device)).name


def alternate(systems: Sequence[T], rounds: int) -> Iterator[tuple[int, T]]:
    """(round, system) in the order to run them: even rounds in the given order, odd rounds reversed, so no
    system always runs first (warm caches) or last (a machine that has grown busier)."""
    for r in range(rounds):
        for system in (systems if r % 2 == 0 else list(reversed(systems))):
            yield r, system


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 90, 99)) -> dict[str, float | None]:
    """{'p50': ..., ...}; None for every q when there are no values (a system that produced none)."""
    if len(values) == 0:
        return {f"p{q:g}": None for q in qs}
    return {f"p{q:g}": float(v) for q, v in zip(qs, np.percentile(np.asarray(values, dtype=float), qs))}


def fmt(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}{unit}"


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> Table:
    """A rich table; the first column left-aligned (names), the rest right-aligned (numbers)."""
    out = Table(title=title, title_justify="left")
    for i, name in enumerate(columns):
        out.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        out.add_row(*row)
    return out


def write_json(path: str | Path, report: dict, conditions: Conditions, console: Console | None = None) -> Path:
    """The report with its conditions and the command that made it, so a saved run explains itself."""
    import sys

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "conditions": asdict(conditions),
            "conditions_line": conditions.line(), **report}
    path.write_text(json.dumps(body, indent=1))
    if console is not None:
        console.print(f"results written to {path}")
    return path


def figure(*args, **kwargs):
    """A matplotlib figure drawn without a display (CI, ssh sessions); matplotlib is imported only here."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save_png(fig, path: str | Path, conditions: Conditions, console: Console | None = None) -> Path:
    """Save with the conditions line under the plot: a picture cut out of its report still names its run."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.text(0.01, 0.005, conditions.line().replace(SEP, "  "), fontsize=5.5, color="0.4", va="bottom")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    if console is not None:
        console.print(f"plot written to {path}")
    return path



def planned(args, env: dict[str, str], measured_device: str) -> dict[str, str]:
    """The conditions fields a command fixes before it runs, from its parsed options and the environment its
    command line sets (`OMP_NUM_THREADS=1 python ...`): device, dtype, backend (`auto` resolved on this
    machine today) and threads. tests/test_doc_measured.py compares them with the conditions line a doc
    quotes. `--device auto` means the device the run measured on; a backend is resolved only for the CPU
    (CUDA's needs the GPU). A benchmark whose options say these differently defines its own `planned`."""
    from shared.cli import resolve_dtype

    asked = getattr(args, "device", None)
    device = measured_device if asked in (None, "auto") else asked
    dtype = resolve_dtype(getattr(args, "dtype", None), torch.device(device))
    out = {"device": device, "dtype": str(dtype).removeprefix("torch.")}
    if getattr(args, "backend", None) is not None and device == "cpu":
        out["backend"] = resolve_backend(args.backend, device, dtype)
    threads = getattr(args, "threads", None) or env.get("OMP_NUM_THREADS")
    if threads is not None:
        out["threads"] = str(threads)
    return out


def chat_checkpoint(model: str | None):
    """(checkpoint directory, its HF tokenizer with the chat template) for a benchmark whose requests are chats;
    CourseError when the model is unknown or has no template (the caller reports it in one line)."""
    from transformers import AutoTokenizer

    from shared.cli import resolve_model_dir
    from shared.errors import CourseError
    from shared.tiny_qwen3 import default_model_dir

    model_dir = resolve_model_dir(model, default_model_dir)
    template = AutoTokenizer.from_pretrained(str(model_dir))
    if not template.chat_template:
        raise CourseError(f"{model_dir} has no chat template: the requests are chats")
    return model_dir, template
