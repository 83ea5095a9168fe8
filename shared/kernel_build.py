"""Builds a C++ source of the course into a torch extension, once per cache folder, and loads it.

torch.utils.cpp_extension compiles it on first use (needs a C++ compiler and ninja; about a minute) into the
course's cache folder; later processes load the finished build in well under a second. One process builds at a
time, under a lock the OS drops when its holder dies: a build killed half-way never blocks the next. A build is
made in a folder of its own and renamed into place whole; a finished build is only ever imported, so no process
rewrites a kernel that another has loaded. It builds L3's paged attention (L12's int8 pages included) and the
decode step's CPU ops (shared/cpu_ops.cpp, L14's invariant matmul too).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import re
import shutil
import sys
import sysconfig
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import IO

import torch

from shared.errors import CourseError
from shared.tiny_qwen3 import cache_root

try:
    import fcntl
except ImportError:  # Windows: no flock; the build there takes cpp_extension's lock alone
    fcntl = None

MARCH_VAR = "PAGED_COURSE_MARCH"  # a CPU to build for instead of this one: haswell builds what an AVX2 laptop runs


def flag_sets(march: str = "") -> tuple[list[str], ...]:
    """The flag sets a build tries, in order. By default tuned for the CPU it is built on, then the portable build
    for a compiler that does not know -march=native. A named CPU is the only set: a build for the CPU asked for
    or none, never a portable one in its place that a test would then pass on."""
    if not march:
        return (["-O3", "-fopenmp", "-march=native"], ["-O3", "-fopenmp"])
    return (["-O3", "-fopenmp", f"-march={march}"],)


FLAGS = flag_sets(os.environ.get(MARCH_VAR, "").strip())
# cpu_features()' name for an instruction set, and torch.cpu.get_capabilities()' (which asks the CPU it runs on)
SAME_ISA = {"avx512f": "avx512_f", "avx2": "avx2", "fma": "fma3"}
BUILD_WAIT_S = 900  # another process's build takes about a minute; one that holds the lock this long is stuck

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


def torch_installation() -> str:
    """Where this process's torch and Python headers are: cpp_extension writes both into the compile command.
    Two environments with one torch version at two paths (two venvs, a workspace's own) differ here, and so
    build into two folders, never into one that each would keep rebuilding for its own paths."""
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))  # as cpp_extension sees it: not resolved
    python_include = sysconfig.get_path("include", scheme="nt" if os.name == "nt" else "posix_prefix")
    return repr((torch_dir, python_include, getattr(torch.version, "git_version", "")))


def _kernel_key(source: Path) -> str:
    """Machine kind, Python, torch (a module built against one torch does not load in another) and where it is
    installed, and source text: an edited kernel builds into a folder of its own, and undoing the edit finds
    the old build."""
    py = f"{sys.version_info.major}{sys.version_info.minor}"
    installed = hashlib.sha256(torch_installation().encode()).hexdigest()[:8]
    text = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    return f"{module_name(source)}-{platform.machine()}-py{py}-torch{torch.__version__}-{installed}-{text}"


def build_dir(flags: Sequence[str], source: Path) -> Path:
    """The kernel's key plus the build's: its flags and, for a build tuned to this CPU (-march=native), the CPU's
    instruction sets. A cache shared by two CPUs (a network home, a CI cache) then never hands AVX-512 code to
    a CPU without it, which would die on an illegal instruction; a portable build is shared, and so is one for a
    named CPU (-march=haswell): its flags say what it runs on. The folder holds only a finished build: it is
    built beside it (partial_dir) and renamed to this name when done."""
    tuned_for = cpu_features() if "-march=native" in flags else ""
    build = hashlib.sha256(repr((list(flags), tuned_for)).encode()).hexdigest()[:8]
    return cache_root() / "kernels" / f"{_kernel_key(source)}-{build}"


def partial_dir(final: Path) -> Path:
    """Where this process builds `final`: a sibling (a rename within one folder is atomic), named by the pid."""
    return final.with_name(f"{final.name}.building-{os.getpid()}")


def library(folder: Path, source: Path) -> Path:
    """The module file cpp_extension links in `folder`."""
    return folder / f"{module_name(source)}{'.pyd' if os.name == 'nt' else '.so'}"


def lock_path(source: Path) -> Path:
    return cache_root() / "kernels" / f"{_kernel_key(source)}.lock"


def build_and_load(source: Path) -> ModuleType:
    """Builds `source` (once per cache; its text, torch's installation, the CPU and the flags key the folder) and
    loads it. A finished build is imported as it is: ninja never runs again in a folder a process may have loaded."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"no C++ compiler ({compiler}) on PATH")
    if shutil.which("ninja") is None:  # the ninja package's binary, when its venv's bin/ is not on PATH
        try:
            import ninja
        except ImportError:
            raise KernelUnavailable("ninja is not installed (pip install ninja)") from None
        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ['PATH']}"
    check_target(FLAGS[0])
    if (kernel := _load_finished(source)) is not None:  # no lock to take: a finished build never changes
        return kernel
    lock_path(source).parent.mkdir(parents=True, exist_ok=True)
    with _one_builder(lock_path(source)) as locked:
        if (kernel := _load_finished(source)) is not None:  # built by the process we waited for
            return kernel
        print(f"building the C++ kernel {source.name} into {build_dir(FLAGS[0], source)} (once; about a minute)",
              file=sys.stderr, flush=True)
        error = ""
        for flags in FLAGS:
            try:
                return _build(flags, source, locked)
            except Exception as e:  # a compiler failing its version check, a compile error, a module that won't load
                error = _first_error(str(e))
    raise KernelUnavailable(f"the C++ kernel did not build ({error})")


def target(flags: Sequence[str]) -> str:
    """The CPU a flag set builds for ("native", "haswell"), or "" for the compiler's default."""
    return next((flag.split("=", 1)[1] for flag in flags if flag.startswith("-march=")), "")


def check_target(flags: Sequence[str]) -> None:
    """Raises KernelUnavailable for a CPU name that is not one, or for a -march=native build this process cannot
    run. The second happens under a user-mode emulator (qemu-x86_64 -cpu Haswell on an AVX-512 machine): the
    compiler runs natively and sees the real CPU, as /proc/cpuinfo does, so it builds AVX-512 code and the build
    folder's key cannot tell; torch asks the CPU this process runs on. Loading that build kills the process
    with an illegal instruction."""
    march = target(flags)
    if march and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", march):
        raise KernelUnavailable(f"-march={march!r} is not a CPU name; set ${MARCH_VAR} to one the compiler "
                                f"knows, e.g. haswell")
    if march != "native":
        return
    try:
        capabilities = torch.cpu.get_capabilities()
    except Exception:  # an older torch, another platform: nothing to compare, as before this check
        capabilities = {}
    listed = set(cpu_features().split())
    missing = [flag for flag, cap in SAME_ISA.items() if flag in listed and capabilities.get(cap) is False]
    if missing:
        raise KernelUnavailable(f"/proc/cpuinfo lists {', '.join(missing)}, which -march=native would use, but "
                                f"this process's CPU has not (an emulator?); set ${MARCH_VAR} to the CPU it "
                                f"runs as, e.g. haswell")


def _load_finished(source: Path) -> ModuleType | None:
    """The first flag set's finished build, imported straight from its file (no ninja, no lock); None if none."""
    for flags in FLAGS:
        path = library(build_dir(flags, source), source)
        if path.is_file():
            try:
                spec = importlib.util.spec_from_file_location(module_name(source), path)
                kernel = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(kernel)
                return kernel
            except Exception as e:  # a build that cannot load here is not rebuilt over: it may be loaded elsewhere
                raise KernelUnavailable(f"the C++ kernel in {path.parent} does not load ({_first_error(str(e))}); "
                                        f"delete that folder to rebuild it") from None
    return None


def _build(flags: Sequence[str], source: Path, locked: bool) -> ModuleType:
    """Builds with `flags` in a folder of this process's own, then renames it to build_dir(flags) whole."""
    from torch.utils import cpp_extension

    final = build_dir(flags, source)
    if locked:  # nobody else is building: these are the remains of builds that were killed
        for stale in final.parent.glob(f"{final.name}.building-*"):
            shutil.rmtree(stale, ignore_errors=True)
    partial = partial_dir(final)
    shutil.rmtree(partial, ignore_errors=True)  # a dead process's, with our pid
    partial.mkdir(parents=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # compiler-version chatter; a real failure raises
            kernel = cpp_extension.load(module_name(source), [str(staged_source(partial, source))],
                                        extra_cflags=list(flags), extra_ldflags=["-fopenmp"],
                                        build_directory=str(partial), verbose=False)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    try:
        partial.rename(final)  # atomic: a reader finds no folder, or the whole build
    except OSError:  # without a lock another process may have renamed its build first; this one is loaded anyway
        shutil.rmtree(partial, ignore_errors=True)
        return kernel
    kernel.__file__ = str(library(final, source))  # the same file, under the name it now has
    return kernel


def staged_source(folder: Path, source: Path) -> Path:
    """The kernel's source, copied into its (fresh) build folder: the build keeps the text it was compiled from
    (the folder's name holds its hash), whichever tree (a clone, a test's scratch copy) asked for it."""
    staged = folder / source.name
    staged.write_bytes(source.read_bytes())
    return staged


@contextmanager
def _one_builder(path: Path) -> Iterator[bool]:
    """Holds an exclusive flock on `path` (True), waiting up to BUILD_WAIT_S for another process's build. The OS
    drops a flock when its holder dies, however it dies: a killed build leaves nothing to wait on. Where there
    is no flock (Windows, a file system without locks) it holds nothing (False)."""
    if fcntl is None:
        yield False
        return
    with open(path, "a") as lock:  # closing it, on the way out, releases the lock
        yield _flock(lock, path)


def _flock(lock: IO[str], path: Path) -> bool:
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
            if not said:  # only a process with no finished build waits here: a minute's wait deserves a line
                print("waiting for another process that is building the C++ kernel", file=sys.stderr, flush=True)
                said = True
            time.sleep(0.1)
        except OSError:  # a file system without locks
            return False


def _first_error(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    return next((line for line in lines if "error" in line.lower() and "Error building" not in line), lines[0] if lines
                else "no output")[:200]
