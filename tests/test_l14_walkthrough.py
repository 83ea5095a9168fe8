"""scripts/l14_walkthrough.py in-process (seconds): in the default mode the first op whose row differs alone and in a
crowd is layer 0's q_proj, the first matmul, after the embedding and the first RMSNorm agree; in the
batch-invariant mode all 52 agree. The walkthrough keeps each module's output with forward hooks: a hook that
returned what it stored would replace the module's output and crash the forward (docs/l14_batch_invariant.md,
pitfalls); this test runs it every time, the doc's output test only in the slow suite."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from test_l3_cpp_backend import needs_kernel
from test_l14_ops import needs_ops

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "l14_walkthrough.py"


@pytest.fixture(scope="module")
def walkthrough():
    spec = importlib.util.spec_from_file_location("l14_walkthrough_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_kernel
@needs_ops
def test_the_first_row_to_differ_is_the_first_matmuls_and_the_mode_makes_every_op_agree(walkthrough, capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the doc runs it
    try:
        code = walkthrough.run(walkthrough.parser().parse_args([]))
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert code == 0, f"the walkthrough returned {code}:\n{out[-2000:]}"
    default, _, invariant = out.partition("batch-invariant mode:")
    assert ("the first 2 ops agree bitwise (model.embed_tokens, model.layers.0.input_layernorm); the first that "
            "differs: model.layers.0.self_attn.q_proj") in default, (
        f"default mode: the embedding and the first RMSNorm agree, layer 0's q_proj (an M = 1 product alone, M = 17 "
        f"in the crowd: torch's GEMM past the few-row matmul's 16) is the first op to differ; the walkthrough printed:\n{default}")
    assert "every one of the 52 ops gives its row bitwise the same alone and among 16 others" in invariant, (
        f"batch-invariant mode: every op's row is the same bits alone and in the crowd; the walkthrough printed:\n"
        f"{invariant}")
