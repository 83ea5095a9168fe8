"""The C++ kernel as a neighbour (paged_attention.cpp, cpp_backend.py): it lets other Python threads run while it
computes, turns a bad shape into an error rather than a dead process, builds into a folder that names the
flags, CPU and torch installation it was built for, never rebuilds a finished build (another environment's
included), and survives a build that was killed half-way.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lessons.l3_block_tensor.backends import cpp_backend
from shared import kernel_build
from test_l3_cpp_backend import ROOT, needs_kernel


def one_request(history: int, rows: int, s: int, hq: int, hkv: int, d: int):
    """One request feeding `rows` new tokens over `history` tokens, its pages blocks 0, 1, ... in order."""
    pages = -(-history // s)
    i32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    k = torch.randn(pages, s, hkv, d)
    v = torch.randn(pages, s, hkv, d)
    q = torch.randn(rows, hq, d)
    last_page_len = history - (pages - 1) * s
    return q, k, v, i32([0, rows]), i32([0, pages]), torch.arange(pages, dtype=torch.int32), i32([last_page_len])


@needs_kernel
def test_other_python_threads_run_while_the_kernel_computes():
    # A server's event loop (SSE writes, /health, new requests) is another Python thread: it must not stop for
    # the length of an attention call. 64 rows over a 32k history take ~0.6 s on one thread of a 2-core Zen3,
    # so a thread that wakes every millisecond gets hundreds of turns, and none while the kernel holds the GIL.
    kernel = cpp_backend.load_kernel()
    args = one_request(history=32768, rows=64, s=16, hq=16, hkv=2, d=128)
    ticks, stop = [0], threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            time.sleep(0.001)
            ticks[0] += 1

    thread = threading.Thread(target=ticker)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    thread.start()
    try:
        time.sleep(0.02)
        before = ticks[0]
        kernel.paged_attention(*args)
        during = ticks[0] - before
    finally:
        stop.set()
        thread.join()
        torch.set_num_threads(threads)
    assert during > 5, f"the ticker ran {during} time(s) during the kernel call"


# Run in a child process: a division by zero there is a signal that kills the child, not the test session.
ZERO_KV_HEADS = """
import torch
from lessons.l3_block_tensor.backends import cpp_backend
from shared import kernel_build
i32 = lambda values: torch.tensor(values, dtype=torch.int32)
k = torch.zeros(2, 4, 0, 64)
try:
    cpp_backend.load_kernel().paged_attention(torch.zeros(1, 4, 64), k, k.clone(), i32([0, 1]), i32([0, 1]), i32([0]),
                                              i32([1]))
except RuntimeError as e:
    print(str(e).splitlines()[0])
"""


@needs_kernel
def test_a_pool_with_no_kv_heads_is_an_error_not_a_crash():
    r = subprocess.run([sys.executable, "-c", ZERO_KV_HEADS], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-500:]}"
    assert r.stdout.strip() == "Hq (4) must be a positive multiple of Hkv (0)"


@needs_kernel
@pytest.mark.parametrize("q_shape,k_shape,message", [
    ((1, 6, 64), (2, 4, 4, 64), r"^Hq \(6\) must be a positive multiple of Hkv \(4\)"),
    ((1, 4, 64), (2, 4, 2, 32), r"^head_dim: q has 64, so the pool.s rows need 64 elements, it has 32"),
    ((1, 4, 12), (2, 4, 2, 12), r"^head_dim must be a positive multiple of 8, got 12"),
    ((1, 4, 64), (2, 0, 2, 64), r"^block size must be at least 1, got 0"),
])
def test_a_bad_shape_is_one_clear_error(q_shape, k_shape, message):
    q, k = torch.zeros(q_shape), torch.zeros(k_shape)
    i32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    with pytest.raises(RuntimeError, match=message):
        cpp_backend.load_kernel().paged_attention(q, k, k.clone(), i32([0, 1]), i32([0, 1]), i32([0]), i32([1]))


def test_the_build_folder_names_the_flags_and_the_cpu(monkeypatch):
    native, portable = kernel_build.flag_sets()  # not FLAGS: $PAGED_COURSE_MARCH may name one set
    monkeypatch.setattr(kernel_build, "cpu_features", lambda: "fpu sse2 avx2")
    avx2 = kernel_build.build_dir(native, cpp_backend.SOURCE)
    assert kernel_build.build_dir(native, cpp_backend.SOURCE) == avx2  # the same machine finds its build again
    assert kernel_build.build_dir(portable, cpp_backend.SOURCE) != avx2  # each flag set builds into a folder of its own
    assert kernel_build.build_dir([*native, "-g"], cpp_backend.SOURCE) != avx2
    portable_build = kernel_build.build_dir(portable, cpp_backend.SOURCE)
    monkeypatch.setattr(kernel_build, "cpu_features", lambda: "fpu sse2 avx2 avx512f")
    assert kernel_build.build_dir(native, cpp_backend.SOURCE) != avx2  # a CPU with other instructions does not load this one's build
    assert kernel_build.build_dir(portable, cpp_backend.SOURCE) == portable_build  # a portable build runs on either


def test_cpu_features_reads_the_flags_line():
    features = kernel_build.cpu_features()
    assert isinstance(features, str)
    if sys.platform == "linux" and os.uname().machine == "x86_64":
        assert "sse2" in features.split()


def test_a_build_waits_for_another_builder_with_a_deadline(monkeypatch, tmp_path):
    fcntl = pytest.importorskip("fcntl")  # Windows has none: there the build takes no lock of its own
    from torch.utils import cpp_extension

    def must_not_build(*args, **kwargs):
        raise AssertionError("built while another process held the build lock")

    monkeypatch.setattr(kernel_build, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(kernel_build, "BUILD_WAIT_S", 0.3)
    monkeypatch.setattr(cpp_extension, "load", must_not_build)
    lock = kernel_build.lock_path(cpp_backend.SOURCE)
    lock.parent.mkdir(parents=True)
    with open(lock, "w") as held:  # another process building: flock is per open file, so this counts as one
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(kernel_build.KernelUnavailable,
                           match=r"^another process has been building the C\+\+ kernel for 0\.3 s \(lock: .*\)$"):
            kernel_build.build_and_load(cpp_backend.SOURCE)


# Builds the kernel from scratch into $PAGED_COURSE_CACHE: one real build, through load_kernel as ever, but of one
# flag set without optimisation (-O0): what is tested is the lock around a build, not the code it makes (the
# session's own build is FLAGS' -O3 one). -O0 takes about 80% of -O3's CPU time (30.6 s against 37.6 s on a
# 2-core box): torch's headers, not the kernel's loops, are most of a build.
LOAD = """
from lessons.l3_block_tensor.backends import cpp_backend
from shared import kernel_build
kernel_build.FLAGS = (["-O0"],)
print(cpp_backend.load_kernel().paged_attention.__name__)
"""


def kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid`: ninja starts each compiler in a process group of its own, so
    killing the build's group would leave the compiler running."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (name)": state, ppid, pgrp, session
            if int(fields[3]) == sid:
                os.kill(int(stat.parent.name), signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            pass  # a process that has already gone


@pytest.mark.slow  # a real kernel build, killed, then another
@needs_kernel
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the build's processes in /proc")
def test_a_killed_build_does_not_block_the_next(tmp_path):
    # A build killed mid-way (OOM killer, CI timeout) leaves cpp_extension's own `lock` file behind, fresh: its
    # stale check would not fire, and torch's lock waits on it forever. The next process must build anyway.
    env = {**os.environ, "PAGED_COURSE_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-c", LOAD], cwd=ROOT, env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("kernels/*/lock")) and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.05)
        time.sleep(1.0)  # the compiler is running now
    finally:
        kill_session(first.pid)  # the build and its compiler, as a CI timeout kills them
        first.wait()
    assert list(tmp_path.glob("kernels/*/lock")), "the killed build left no lock file: nothing was tested"
    assert not list(tmp_path.glob("kernels/*/*.so"))
    second = subprocess.run([sys.executable, "-c", LOAD], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stderr[-500:]
    assert second.stdout.strip() == "paged_attention"
    assert not list(tmp_path.glob("kernels/*.building-*")), "the killed build's folder was left behind"


@needs_kernel
def test_the_same_source_in_another_tree_loads_the_same_build(tmp_path):
    """A fresh clone or a test's scratch copy of the course loads the build that exists: the folder is keyed by
    the source's text, not its path, and a finished build is imported, never handed to ninja again (whose
    command line names the source file: each tree would rebuild it after the other had, a minute each time)."""
    import shutil
    for part in ("lessons", "shared"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    built = [kernel_build.build_dir(flags, cpp_backend.SOURCE) / ".ninja_log" for flags in kernel_build.FLAGS]
    before = [log.read_text() if log.is_file() else "" for log in built]
    code = "from lessons.l3_block_tensor.backends import cpp_backend as c; c.load_kernel(); print(c.SOURCE)"
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert run.returncode == 0 and run.stdout.strip().startswith(str(tmp_path)), run.stderr[-2000:]
    assert [log.read_text() if log.is_file() else "" for log in built] == before, "the copy rebuilt the kernel"
    assert "waiting" not in run.stderr and "building" not in run.stderr, run.stderr


def test_two_torch_installations_never_share_a_build_folder(monkeypatch, tmp_path):
    # cpp_extension writes torch's own path into the compile command: two venvs with one torch version at two
    # paths sharing a folder each saw the other's paths and rebuilt it in place, under processes that loaded it.
    monkeypatch.setattr(kernel_build, "cache_root", lambda: tmp_path)
    here = [kernel_build.build_dir(flags, cpp_backend.SOURCE) for flags in kernel_build.FLAGS]
    lock = kernel_build.lock_path(cpp_backend.SOURCE)
    assert [kernel_build.build_dir(flags, cpp_backend.SOURCE) for flags in kernel_build.FLAGS] == here  # the same environment, again
    installed = torch.__file__
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-venv/lib/python3.11/site-packages/torch/__init__.py"))
    there = [kernel_build.build_dir(flags, cpp_backend.SOURCE) for flags in kernel_build.FLAGS]
    assert all(a != b for a, b in zip(here, there)), "another torch installation shares this one's build folder"
    assert kernel_build.lock_path(cpp_backend.SOURCE) != lock  # and builds without waiting for this one
    monkeypatch.setattr(torch, "__file__", installed)
    assert [kernel_build.build_dir(flags, cpp_backend.SOURCE) for flags in kernel_build.FLAGS] == here


@needs_kernel
def test_a_finished_build_is_imported_without_ninja_or_the_lock(monkeypatch, tmp_path):
    # The session's build exists (needs_kernel made it): loading it again must neither run ninja (which rewrites
    # a .so that other processes have loaded) nor wait for a build lock.
    fcntl = pytest.importorskip("fcntl")
    from torch.utils import cpp_extension

    def must_not_build(*args, **kwargs):
        raise AssertionError("ran cpp_extension.load on a finished build")

    monkeypatch.setattr(cpp_extension, "load", must_not_build)
    monkeypatch.setattr(kernel_build, "BUILD_WAIT_S", 0.3)
    monkeypatch.setattr(kernel_build, "lock_path", lambda source: tmp_path / "held.lock")
    with open(tmp_path / "held.lock", "w") as held:  # a build in progress elsewhere
        fcntl.flock(held, fcntl.LOCK_EX)
        kernel = kernel_build.build_and_load(cpp_backend.SOURCE)
    assert Path(kernel.__file__).parent in [kernel_build.build_dir(flags, cpp_backend.SOURCE) for flags in kernel_build.FLAGS]
    assert kernel.paged_attention.__name__ == "paged_attention"


# A module as small as a build gets (pybind11 only, no torch headers: seconds, not a minute), built through the
# kernel's builder as L14's ops are; what is tested is where builds go and who rebuilds them, not the kernel.
PROBE_SOURCE = """
#include <pybind11/pybind11.h>
int answer() { return 42; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""
PROBE = """
import sys
from pathlib import Path
import torch
from lessons.l3_block_tensor.backends import cpp_backend
from shared import kernel_build
kernel_build.FLAGS = (["-O0"],)
module = kernel_build.build_and_load(Path(sys.argv[1]))
print(torch.__file__, module.__file__, module.answer())
"""


@pytest.mark.slow  # two real (small) builds, four processes
@needs_kernel
@pytest.mark.skipif(os.name == "nt", reason="a symlinked torch package stands in for a second installation")
def test_two_torch_installations_share_a_cache_without_rebuilding_each_other(tmp_path):
    """Two environments with the same torch version at two paths, one cache folder, taking turns: each builds
    once into a folder of its own, and neither rewrites the other's build (the bug: one folder, each ninja run
    seeing the other's include paths and relinking the .so under the processes that had loaded it)."""
    source = tmp_path / "probe.cpp"
    source.write_text(PROBE_SOURCE)
    other = tmp_path / "other-env"  # a second torch installation: the same package, found at another path
    other.mkdir()
    (other / "torch").symlink_to(Path(torch.__file__).parent, target_is_directory=True)
    cache = tmp_path / "cache"

    def run(env_path: Path | None) -> tuple[Path, Path, str]:
        env = {**os.environ, "PAGED_COURSE_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
        env.pop("PYTHONPATH", None)
        if env_path is not None:
            env["PYTHONPATH"] = str(env_path)
        r = subprocess.run([sys.executable, "-c", PROBE, str(source)], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        torch_file, module_file, answer = r.stdout.split()
        assert answer == "42"
        return Path(torch_file), Path(module_file), r.stderr

    def snapshot(path: Path) -> tuple[int, int, bytes]:
        return path.stat().st_ino, path.stat().st_mtime_ns, path.read_bytes()

    torch_a, so_a, err = run(None)
    assert "building" in err
    first = snapshot(so_a)
    torch_b, so_b, err = run(other)
    assert torch_b == other / "torch" / "__init__.py" and torch_a != torch_b  # two torch paths really
    assert snapshot(so_a) == first, "the second environment rebuilt the first one's kernel in place"
    assert so_b.parent != so_a.parent and "building" in err  # it built one of its own
    second = snapshot(so_b)
    for env_path, so, before in [(None, so_a, first), (other, so_b, second)]:  # each loads its own, as it is
        _, again, err = run(env_path)
        assert again == so and snapshot(so) == before, f"{so} was rebuilt"
        assert "building" not in err and "waiting" not in err, err
    assert snapshot(so_a) == first
    assert sorted(p.name for p in (cache / "kernels").iterdir() if p.is_dir()) == sorted([so_a.parent.name,
                                                                                           so_b.parent.name])


def test_a_named_cpu_replaces_native_and_names_its_build(monkeypatch):
    # $PAGED_COURSE_MARCH (read at import into FLAGS): the one flag set, keyed by its name, not by this CPU
    native, portable = kernel_build.flag_sets()
    assert kernel_build.flag_sets("") == (native, portable) and "-march=native" in native
    assert kernel_build.flag_sets("haswell") == (["-O3", "-fopenmp", "-march=haswell"],)  # no portable fallback
    haswell = kernel_build.flag_sets("haswell")[0]
    monkeypatch.setattr(kernel_build, "cpu_features", lambda: "fpu sse2 avx2 fma")
    here = kernel_build.build_dir(haswell, cpp_backend.SOURCE)
    assert here not in (kernel_build.build_dir(native, cpp_backend.SOURCE), kernel_build.build_dir(portable, cpp_backend.SOURCE))
    monkeypatch.setattr(kernel_build, "cpu_features", lambda: "fpu sse2 avx2 fma avx512f")
    assert kernel_build.build_dir(haswell, cpp_backend.SOURCE) == here  # any CPU that runs haswell code shares the build


def refuse_to_build(monkeypatch, tmp_path) -> list[list[str]]:
    """A scratch cache where cpp_extension.load fails at once; the flag sets it was asked to build, in order."""
    from torch.utils import cpp_extension

    tried = []

    def fail(name, sources, extra_cflags, **kwargs):
        tried.append(extra_cflags)
        raise RuntimeError("error: not built in this test")

    monkeypatch.setattr(kernel_build, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(cpp_extension, "load", fail)
    return tried


def test_with_a_named_cpu_no_native_or_portable_build_is_loaded(monkeypatch, tmp_path):
    tried = refuse_to_build(monkeypatch, tmp_path)
    for flags in kernel_build.flag_sets():  # finished builds for this CPU: loading either would fail loudly
        kernel_build.build_dir(flags, cpp_backend.SOURCE).mkdir(parents=True)
        kernel_build.library(kernel_build.build_dir(flags, cpp_backend.SOURCE), cpp_backend.SOURCE).write_bytes(b"not a module")
    monkeypatch.setattr(kernel_build, "FLAGS", kernel_build.flag_sets("haswell"))
    with pytest.raises(kernel_build.KernelUnavailable, match=r"^the C\+\+ kernel did not build \(error: not built"):
        kernel_build.build_and_load(cpp_backend.SOURCE)
    assert tried == [["-O3", "-fopenmp", "-march=haswell"]]


def test_a_cpu_name_that_is_not_one_is_one_line(monkeypatch, tmp_path):
    tried = refuse_to_build(monkeypatch, tmp_path)
    monkeypatch.setattr(kernel_build, "FLAGS", kernel_build.flag_sets("haswell; rm -rf ~"))  # ninja runs a shell
    with pytest.raises(kernel_build.KernelUnavailable, match=r"^-march='haswell; rm -rf ~' is not a CPU name; set "
                                                             r"\$PAGED_COURSE_MARCH to one the compiler knows"):
        kernel_build.build_and_load(cpp_backend.SOURCE)
    assert tried == []


@needs_kernel  # a compiler to ask: it fails on the flag in about 2 s, before compiling anything
def test_a_cpu_the_compiler_does_not_know_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(kernel_build, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(kernel_build, "FLAGS", kernel_build.flag_sets("no-such-cpu"))
    with pytest.raises(kernel_build.KernelUnavailable, match=r"^the C\+\+ kernel did not build \(.*no-such-cpu.*\)$"):
        kernel_build.build_and_load(cpp_backend.SOURCE)  # GCC: "bad value 'no-such-cpu' for '-march=' switch"; no portable build
    assert not [p for p in (tmp_path / "kernels").iterdir() if p.is_dir()], "a failed build left a folder"


def test_a_native_build_this_process_cannot_run_is_refused(monkeypatch, tmp_path):
    # qemu-x86_64 -cpu Haswell on an AVX-512 machine: /proc/cpuinfo and the compiler (a native subprocess) see
    # the host's AVX-512, the emulated process has none; loading the native build died on an illegal instruction.
    tried = refuse_to_build(monkeypatch, tmp_path)
    monkeypatch.setattr(kernel_build, "FLAGS", kernel_build.flag_sets())  # -march=native, whatever $PAGED_COURSE_MARCH
    monkeypatch.setattr(kernel_build, "cpu_features", lambda: "avx avx2 avx512f fma fpu sse2")
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, "fma3": True, "avx512_f": False})
    with pytest.raises(kernel_build.KernelUnavailable, match=r"^/proc/cpuinfo lists avx512f, which -march=native would "
                                                             r"use, but this process's CPU has not \(an emulator\?\); "
                                                             r"set \$PAGED_COURSE_MARCH to the CPU it runs as"):
        kernel_build.build_and_load(cpp_backend.SOURCE)
    assert tried == []
    monkeypatch.setattr(kernel_build, "FLAGS", kernel_build.flag_sets("haswell"))  # the fix the message names
    with pytest.raises(kernel_build.KernelUnavailable, match=r"^the C\+\+ kernel did not build"):
        kernel_build.build_and_load(cpp_backend.SOURCE)
    assert tried == [["-O3", "-fopenmp", "-march=haswell"]]
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, "fma3": True, "avx512_f": True})
    monkeypatch.setattr(kernel_build, "FLAGS", kernel_build.flag_sets())  # a process that runs what it sees
    with pytest.raises(kernel_build.KernelUnavailable, match=r"^the C\+\+ kernel did not build"):
        kernel_build.build_and_load(cpp_backend.SOURCE)
    assert tried[1:] == [list(flags) for flags in kernel_build.flag_sets()]
