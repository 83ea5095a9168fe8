"""Fixtures every lesson's tests share: the embedded model, our loaded copy, and HF's reference."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from shared.generation import StopRule
from shared.hf_reference import HfOutput, HfReference
from shared.model import Qwen3ForCausalLM
from shared.tiny_qwen3 import default_model_dir, write_tokenizer
from shared.tokenizer import load_tokenizer

CPU = torch.device("cpu")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest -n the workers share the cores: each runs torch on one thread, and so do the smokes, servers
    # and ranks it starts (they inherit the variable). No check depends on it: each compares within its own run.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# Prompts of different lengths; the last spans many 16-token blocks.
PROMPTS = [
    "The capital of France is",
    "Hello, world!",
    "a",
    "Paged attention stores the key/value cache in fixed-size blocks, so memory is allocated on demand "
    "instead of reserved for the longest possible sequence; a block table maps each request's logical "
    "positions to physical blocks, exactly as virtual memory maps pages to frames. " * 2,
]


# Test files whose engines never reach L3's kernel: a learner running L1's or L2's tests does not wait for its build.
NO_KERNEL = {"test_l1_l2_parity.py", "test_l1_tasks.py", "test_tiny_model.py", "test_l2_allocator.py", "test_l2_reserve.py",
             "test_l2_tasks.py", "test_cpu_ops.py"}


@pytest.fixture(scope="session", autouse=True)
def cpp_kernel_built(request) -> None:
    """Build the C++ decode ops every model uses on the CPU (shared/cpu_ops.cpp, half a minute) and L3's attention
    kernel (about a minute), once per cache, before the first test, so no test, and no smoke or server a test
    starts under a timeout, pays for a build. Where one cannot build, torch runs instead (`auto` takes the
    batched backend) and its own tests skip, saying why. L3's kernel is skipped when every collected test is L1's
    or L2's. Under xdist the second worker builds the ops while the first builds the kernel, then each loads the
    other's build."""
    from shared.cpu_ops import load_ops
    from shared.kernel_build import KernelUnavailable

    builds = [load_ops]
    if not all(item.path.name in NO_KERNEL for item in request.session.items):
        from lessons.l3_block_tensor.backends.cpp_backend import load_kernel

        builds.insert(0, load_kernel)
        if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
            builds.reverse()
    for build in builds:
        try:
            build()
        except KernelUnavailable:
            pass


@pytest.fixture(scope="session")
def l14_ops():
    """L14's compiled ops, or a skip saying why they cannot build here."""
    from lessons.l14_batch_invariant.ops import load_ops
    from shared.kernel_build import KernelUnavailable

    try:
        return load_ops()
    except KernelUnavailable as e:
        pytest.skip(f"L14's C++ ops are unavailable: {e}")


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return default_model_dir()


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    return load_tokenizer(tiny_dir)


@pytest.fixture(scope="session")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p).ids for p in PROMPTS]


@pytest.fixture(scope="session")
def tiny_model(tiny_dir) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.from_dir(tiny_dir, torch.float32, CPU)


@pytest.fixture
def fed_tokens(tiny_model, monkeypatch) -> list[int]:
    """How many tokens each forward of the tiny model is fed, in order: parity cannot see an engine that
    recomputes the whole history every step; this can."""
    fed: list[int] = []
    real_forward = type(tiny_model).forward

    def counting_forward(self, input_ids, *args):
        fed.append(len(input_ids))
        return real_forward(self, input_ids, *args)

    monkeypatch.setattr(type(tiny_model), "forward", counting_forward)
    return fed


class CachedHf:
    """HF generate, memoised per (prompt, stop rule): many tests compare against the same reference runs."""

    def __init__(self, model_dir: Path):
        self.ref = HfReference(model_dir, torch.float32, CPU)
        self._memo: dict[tuple, HfOutput] = {}

    def generate(self, prompt_ids: list[int], stop: StopRule) -> HfOutput:
        key = (tuple(prompt_ids), stop)
        if key not in self._memo:
            self._memo[key] = self.ref.generate(prompt_ids, stop)
        return self._memo[key]


@pytest.fixture(scope="session")
def hf(tiny_dir) -> CachedHf:
    return CachedHf(tiny_dir)


@pytest.fixture(scope="session")
def grammar_compiler(tokenizer, tiny_dir):
    """L13's compiler for the embedded model: llguidance reads the tokenizer once (about 1.4 s) per session."""
    from lessons.l13_structured.grammar import GrammarCompiler
    from shared.config import Qwen3Config

    cfg = Qwen3Config.from_dir(tiny_dir)
    return GrammarCompiler(tokenizer, cfg.vocab_size, frozenset(cfg.eos_token_ids))


def build_hf_checkpoint(out: Path, seed: int, **config) -> Path:
    """A small Qwen3 built by transformers itself (its own init), with the embedded model's tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM as HfQwen3

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=151936, max_position_embeddings=2048, rope_theta=1e6, **config)
    HfQwen3(cfg).save_pretrained(str(out))
    write_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def other_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Two configs unlike the default: untied embeddings; GQA 4:1 with head_dim 128."""
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "untied": build_hf_checkpoint(
            root / "untied", seed=1, hidden_size=96, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=3, num_key_value_heads=1, head_dim=64, tie_word_embeddings=False,
        ),
        "gqa4_d128": build_hf_checkpoint(
            root / "gqa4_d128", seed=2, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
            num_attention_heads=8, num_key_value_heads=2, head_dim=128, tie_word_embeddings=True,
        ),
    }


def assert_same_tokens(got: list[int], expected: list[int], what: str = "the output") -> None:
    """Token-for-token equality, failing in a learner's terms: where the first difference is and what each side
    has there."""
    if got == expected:
        return
    k = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    if k < min(len(got), len(expected)):
        raise AssertionError(f"{what}: token {k} is {got[k]}, HF's is {expected[k]} (tokens 0..{k - 1} match; "
                             f"got {got[: k + 1]}, expected {expected[: k + 1]})")
    raise AssertionError(f"{what}: {len(got)} tokens, HF gives {len(expected)} (the first {k} match); "
                         f"got {got}, expected {expected}")


def copy_default_tokenizer(src: Path, dst: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)


# The build track (scripts/course.py): `--tasks L2` (or `L2.3`, or `L2.3-4`) keeps only the tests marked for that lesson's tasks
# (or that task), and `--tasks-report FILE` writes each one's outcome, with its failure in a few lines.
def pytest_addoption(parser):
    parser.addoption("--tasks", help="only the build track's tests of this lesson (L2), task (L2.3) or tasks (L2.3-4)")
    parser.addoption("--tasks-report", help="write the task tests' outcomes to this JSON file")


def _task_of(item) -> str | None:
    mark = item.get_closest_marker("task")
    return mark.args[0] if mark else None


def _wanted(task: str, wanted: str) -> bool:
    """L2 (every task of L2), L2.3 (task 3), L2.3-4 (tasks 3 and 4)."""
    lesson, _, numbers = wanted.partition(".")
    if not task.startswith(lesson + "."):
        return False
    first, _, last = numbers.partition("-")
    return not numbers or int(first) <= int(task.split(".")[1]) <= int(last or first)


def pytest_collection_modifyitems(config, items):
    wanted = config.getoption("--tasks")
    if not wanted:
        return
    keep = [i for i in items if (t := _task_of(i)) and _wanted(t, wanted)]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = keep


_TASK_RESULTS: dict[str, dict] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if not item.config.getoption("--tasks-report") or _task_of(item) is None:
        return
    row = _TASK_RESULTS.setdefault(item.nodeid, {"nodeid": item.nodeid, "task": _task_of(item), "passed": True,
                                                 "message": ""})
    if report.failed and row["passed"]:
        row["passed"] = False
        error = call.excinfo
        if error is not None and error.errisinstance(NotImplementedError):
            row["message"] = f"not implemented yet: {error.value}"
        elif error is not None:
            row["message"] = "\n".join(error.exconly().splitlines()[:8])
        else:
            row["message"] = report.longreprtext.splitlines()[-1] if report.longreprtext else "failed"
    elif report.skipped and report.when == "setup":
        row["passed"], row["message"] = False, "skipped: " + str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)


def pytest_sessionfinish(session):
    path = session.config.getoption("--tasks-report")
    if path:
        import json

        Path(path).write_text(json.dumps(list(_TASK_RESULTS.values()), indent=1))
