"""The C++ CPU backend: attention that walks the block table in place (paged_attention.cpp).

The other two CPU backends gather every request's pages into a copy before attention; this one reads K/V
from the pool where the block table says they are, as FlashInfer does on a GPU, from the same CSR tables.
It is compiled on first use by torch.utils.cpp_extension (needs a C++ compiler and ninja; about a minute)
into the course's cache folder, and loaded from there afterwards in well under a second.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

from lessons.l3_block_tensor.batch_meta import BatchMeta
from shared.errors import CourseError
from shared.tiny_qwen3 import cache_root

SOURCE = Path(__file__).with_name("paged_attention.cpp")
MODULE = "paged_attention_cpu"
# Tuned for the CPU it is built on; a compiler that does not know -march=native gets the portable build.
FLAGS = (["-O3", "-fopenmp", "-march=native"], ["-O3", "-fopenmp"])
STALE_LOCK_S = 600  # a build takes about a minute; a lock this old was left by a build that was killed

_loaded: ModuleType | None = None
_failure: str | None = None


class KernelUnavailable(CourseError):
    """The kernel cannot be built or loaded here; the message says why in one line."""


def build_dir() -> Path:
    """One folder per machine kind, Python, torch (a module built against one torch does not load in another)
    and source text: an edited kernel builds into a folder of its own, and undoing the edit finds the old build."""
    py = f"{sys.version_info.major}{sys.version_info.minor}"
    source = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return cache_root() / "kernels" / f"{MODULE}-{platform.machine()}-py{py}-torch{torch.__version__}-{source}"


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


def _build_and_load() -> ModuleType:
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

    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"  # cpp_extension waits forever on a lock that a killed build left behind
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    if not any(folder.glob(f"{MODULE}*.so")):
        print(f"building the C++ paged-attention kernel into {folder} (once; about a minute)", file=sys.stderr,
              flush=True)
    error = ""
    for flags in FLAGS:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # compiler-version chatter; a real failure raises below
                return cpp_extension.load(MODULE, [str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                          build_directory=str(folder), verbose=False)
        except Exception as e:  # a compiler that fails its version check, a compile error, a module that won't load
            error = _first_error(str(e))
    raise KernelUnavailable(f"the C++ kernel did not build ({error})")


def _first_error(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    return next((line for line in lines if "error" in line.lower() and "Error building" not in line), lines[0] if lines
                else "no output")[:200]


class CppBackend:
    name = "cpp"

    def __init__(self) -> None:
        self.kernel = load_kernel()
        self._planned: BatchMeta | None = None

    def plan(self, meta: BatchMeta) -> None:
        # Nothing to prepare: the kernel reads the CSR tables as they are, as FlashInfer's plan() would.
        self._planned = meta

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        if meta is not self._planned:  # a stale plan would silently attend over last step's pages
            raise RuntimeError("run() called with metadata that was not planned: call plan(meta) first")
        return self.kernel.paged_attention(q, k_cache, v_cache, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                                           meta.kv_last_page_len)
