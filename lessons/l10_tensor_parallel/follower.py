"""What every rank but 0 runs: wait for rank 0's next message, make the same call, until told to stop."""
from __future__ import annotations

import importlib
from pathlib import Path

from lessons.l10_tensor_parallel.group import TpGroup
from lessons.l10_tensor_parallel.model import TpQwen3ForCausalLM
from lessons.l10_tensor_parallel.runner import TpRunner
from shared.cli import DTYPES
from shared.errors import RunFailure


# Task L10.8: a follower: receive rank 0's next call and make it (load, build the runner it names, run a step)
def runner_class(path: str, *args: str) -> type[TpRunner]:
    """The runner class rank 0's engine built, from the names its "build_runner" message carries (its class's
    `recipe`): `path`, "module:name" under lessons., names that class, or, with `args`, a runner_factory that
    returns it given them. This rank builds what it is sent; it does not know which lesson sent it."""
    module, _, name = path.partition(":")
    if not module.startswith("lessons.") or not name.isidentifier() or name.startswith("_"):
        raise RunFailure(f"tensor-parallel follower: runner {path!r} is not \"module:name\" under lessons.")
    try:
        found = getattr(importlib.import_module(module), name, None)
    except (ImportError, ValueError) as e:
        raise RunFailure(f"tensor-parallel follower: runner {path!r}: {e}") from None
    if getattr(found, "__module__", None) != module:  # defined there, not imported into it (os.system, say)
        raise RunFailure(f"tensor-parallel follower: {module} defines no {name}")
    if args:
        if getattr(found, "makes_tp_runner", False) is not True:  # marked by runner.py's runner_factory
            raise RunFailure(f"tensor-parallel follower: {path} is not a runner_factory")
        found = found(*args)
    if not (isinstance(found, type) and issubclass(found, TpRunner)):
        raise RunFailure(f"tensor-parallel follower: {path}{list(args) if args else ''} is not a TpRunner class")
    return found


# Task L10.8: a follower: receive rank 0's next call and make it (load, build the runner it names, run a step)
def follow(group: TpGroup) -> None:
    model: TpQwen3ForCausalLM | None = None
    runner: TpRunner | None = None
    while (message := group.receive()) is not None:
        kind, *args = message
        if kind == "load":  # rank 0 is loading its part of this checkpoint
            model_dir, dtype = args
            model = TpQwen3ForCausalLM.load(Path(model_dir), DTYPES[dtype], group)
        elif kind == "build_runner":  # rank 0's engine is building its runner (same class, pool size, backend)
            block_size, num_blocks, backend, *recipe = args
            runner = runner_class(*recipe)(model, block_size, num_blocks, backend)
        elif kind == "run_step":  # rank 0's step; its block tables arrive as changes to this rank's copies
            runner.follow_step(*args)  # logits come back None here: rank 0 samples
        else:  # "capture": the runner's own method, called as rank 0 called it
            getattr(runner, kind)(*args)
