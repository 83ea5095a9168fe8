"""The C++ CPU backend: attention that walks the block table in place (paged_attention.cpp).

The other two CPU backends gather every request's pages into a copy before attention; this one reads K/V
from the pool where the block table says they are, as FlashInfer does on a GPU, from the same CSR tables.
It is compiled on first use by torch.utils.cpp_extension (needs a C++ compiler and ninja; about a minute)
into the course's cache folder, and loaded from there afterwards in well under a second. One process builds
at a time, under a lock the OS drops when its holder dies: a build killed half-way never blocks the next.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import IO

import torch

from lessons.l3_block_tensor.batch_meta import BatchMeta
from shared.errors import CourseError
from shared.tiny_qwen3 import cache_root

try:
    import fcntl
except ImportError:  # Windows: no flock; the build there takes cpp_extension's lock alone
    fcntl = None

SOURCE = Path(__file__).with_name("paged_attention.cpp")
MODULE = "paged_attention_cpu"  # module_name(SOURCE); L14 builds a second source the same way
# Tuned for the CPU it is built on; a compiler that does not know -march=native gets the portable build.
FLAGS = (["-O3", "-fopenmp", "-march=native"], ["-O3", "-fopenmp"])
BUILD_WAIT_S = 900  # another process's build takes about a minute; one that holds the lock this long is stuck

_loaded: ModuleType | None = None
_failure: str | None = None


class KernelUnavailable(CourseError):
    """The kernel cannot be built or loaded here; the message says why in one line."""


def cpu_features() -> str:
    """The instruction sets this CPU reports: /proc/cpuinfo's flags (x86) or Features (ARM) on Linux; elsewhere
    the processor's name, the best cheap stand-in."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return " ".join(sorted(value.split()))
    except OSError:
        pass
    return platform.processor()


def module_name(source: Path) -> str:
    return f"{source.stem}_cpu"


def _kernel_key(source: Path = SOURCE) -> str:
    """Machine kind, Python, torch (a module built against one torch does not load in another) and source text:
    an edited kernel builds into a folder of its own, and undoing the edit finds the old build."""
    py = f"{sys.version_info.major}{sys.version_info.minor}"
    text = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    return f"{module_name(source)}-{platform.machine()}-py{py}-torch{torch.__version__}-{text}"


def build_dir(flags: Sequence[str], source: Path = SOURCE) -> Path:
    """The kernel's key plus the build's: its flags and, for a build tuned to this CPU (-march=native), the CPU's
    instruction sets. A cache shared by two CPUs (a network home, a CI cache) then never hands AVX-512 code to
    a CPU without it, which would die on an illegal instruction; a portable build is shared."""
    tuned_for = cpu_features() if "-march=native" in flags else ""
    build = hashlib.sha256(repr((list(flags), tuned_for)).encode()).hexdigest()[:8]
    return cache_root() / "kernels" / f"{_kernel_key(source)}-{build}"


def lock_path(source: Path = SOURCE) -> Path:
    return cache_root() / "kernels" / f"{_kernel_key(source)}.lock"


def load_kernel() -> ModuleType:
    """The compiled module (built the first time, in this process or an earlier one). Raises KernelUnavailable."""
    global _loaded, _failure
    if _loaded is None and _failure is None:
        try:
            _loaded = _build_and_load()
        except KernelUnavailable as e:
            _failure = str(e)
    if _loaded is None:
        raise KernelUnavailable(_failure)
    return _loaded


def _build_and_load(source: Path = SOURCE) -> ModuleType:
    """Builds `source` (once per cache; its text, the CPU and the flags key the folder) and loads it."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"no C++ compiler ({compiler}) on PATH")
    if shutil.which("ninja") is None:  # the ninja package's binary, when its venv's bin/ is not on PATH
        try:
            import ninja
        except ImportError:
            raise KernelUnavailable("ninja is not installed (pip install ninja)") from None
        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ['PATH']}"
    from torch.utils import cpp_extension

    module = module_name(source)
    lock_path(source).parent.mkdir(parents=True, exist_ok=True)
    built = bool([so for flags in FLAGS for so in build_dir(flags, source).glob(f"{module}*.so")])
    with _one_builder(lock_path(source), announce=not built) as locked:
        if not built:
            print(f"building the C++ kernel {source.name} into {build_dir(FLAGS[0], source)} (once; about a minute)",
                  file=sys.stderr, flush=True)
        error = ""
        for flags in FLAGS:
            folder = build_dir(flags, source)
            folder.mkdir(exist_ok=True)
            if locked:  # nobody else is building: a `lock` here was left by a build that was killed, and
                (folder / "lock").unlink(missing_ok=True)  # cpp_extension would wait on it forever
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # compiler-version chatter; a real failure raises below
                    return cpp_extension.load(module, [str(staged_source(folder, source))], extra_cflags=list(flags),
                                              extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)
            except Exception as e:  # a compiler failing its version check, a compile error, a module that won't load
                error = _first_error(str(e))
    raise KernelUnavailable(f"the C++ kernel did not build ({error})")


def staged_source(folder: Path, source: Path = SOURCE) -> Path:
    """The kernel's source, copied into its build folder (the folder's name holds the source's hash). ninja keys a
    build by its command line, which names the source file: built from SOURCE itself, the same kernel in two trees
    (a fresh clone, a test's scratch copy) would rebuild each time the other had built it."""
    staged = folder / source.name
    text = source.read_bytes()
    if not staged.is_file() or staged.read_bytes() != text:
        partial = folder / f".{source.name}.{os.getpid()}"
        partial.write_bytes(text)
        partial.replace(staged)  # atomic: a reader sees the old file or the whole new one
    return staged


@contextmanager
def _one_builder(path: Path, announce: bool = True) -> Iterator[bool]:
    """Holds an exclusive flock on `path` (True), waiting up to BUILD_WAIT_S for another process's build. The OS
    drops a flock when its holder dies, however it dies: a killed build leaves nothing to wait on. Where there
    is no flock (Windows, a file system without locks) it holds nothing (False)."""
    if fcntl is None:
        yield False
        return
    with open(path, "a") as lock:  # closing it, on the way out, releases the lock
        yield _flock(lock, path, announce)


def _flock(lock: IO[str], path: Path, announce: bool = True) -> bool:
    """Takes the lock, polling until BUILD_WAIT_S has passed; False where the file system has no locks."""
    deadline, said = time.monotonic() + BUILD_WAIT_S, False
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # polled, not blocking: nothing waits forever
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise KernelUnavailable(f"another process has been building the C++ kernel for {BUILD_WAIT_S:g} s "
                                        f"(lock: {path})") from None
            if announce and not said:  # a first build: a minute's wait deserves a line (a load takes a moment)
                print("waiting for another process that is building the C++ kernel", file=sys.stderr, flush=True)
                said = True
            time.sleep(0.1)
        except OSError:  # a file system without locks
            return False


def _first_error(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    return next((line for line in lines if "error" in line.lower() and "Error building" not in line), lines[0] if lines
                else "no output")[:200]


class CppBackend:
    """plan() once per step cuts the step into the kernel's work items (and checks its tables); run() once per
    layer attends with them, as FlashInfer's wrappers split the work."""

    name = "cpp"

    def __init__(self) -> None:
        self.kernel = load_kernel()
        self._planned: BatchMeta | None = None
        self._work: torch.Tensor | None = None  # int64 [items, fields]: request, rows, positions, KV heads

    def plan(self, meta: BatchMeta) -> None:
        # Sized for the thread count of this step: with fewer row tiles than threads, items split KV heads.
        self._work = self.kernel.plan(meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
                                      meta.block_size, torch.get_num_threads())
        self._planned = meta

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        if meta is not self._planned:  # a stale plan would silently attend over last step's pages
            raise RuntimeError("run() called with metadata that was not planned: call plan(meta) first")
        return self.kernel.run_planned(q, k_cache, v_cache, meta.kv_indptr, meta.kv_indices, self._work)
