"""What every rank but 0 runs: wait for rank 0's next message, make the same call, until told to stop."""
from __future__ import annotations

from pathlib import Path

from lessons.l10_tensor_parallel.group import TpGroup
from lessons.l10_tensor_parallel.model import TpQwen3ForCausalLM
from lessons.l10_tensor_parallel.runner import TpRunner
from shared.cli import DTYPES


def runner_class(kv_dtype: str) -> type[TpRunner]:
    """L10's runner, or (L12) the same runner over a pool of quantized pages, as rank 0's engine built."""
    if kv_dtype == "auto":
        return TpRunner
    from lessons.l12_kv_quant.runner import quantized  # imported only when asked for

    return quantized(TpRunner, kv_dtype)


def follow(group: TpGroup) -> None:
    model: TpQwen3ForCausalLM | None = None
    runner: TpRunner | None = None
    while (message := group.receive()) is not None:
        kind, *args = message
        if kind == "load":  # rank 0 is loading its part of this checkpoint
            model_dir, dtype = args
            model = TpQwen3ForCausalLM.load(Path(model_dir), DTYPES[dtype], group)
        elif kind == "build_runner":  # rank 0's engine is building its runner (same pool size, same backend)
            *runner_args, kv_dtype = args
            runner = runner_class(kv_dtype)(model, *runner_args)
        elif kind == "run_step":  # rank 0's step; its block tables arrive as changes to this rank's copies
            runner.follow_step(*args)  # logits come back None here: rank 0 samples
        else:  # "capture": the runner's own method, called as rank 0 called it
            getattr(runner, kind)(*args)
