"""scripts/benchmark/l16_bench.py's pure parts, fast: bad options are one line and exit 2 before anything loads; the
ledger's arithmetic against numbers worked by hand for SmolLM2 (and the shipped Q4_1 file's size), and its weight
counts against the model built on meta for Qwen3. The engines' comparison itself (llama.cpp, the real model) is
measured in docs/l16_weight_quant_appendix.md; no timing is asserted here."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "benchmark"))
import l16_bench  # noqa: E402
from shared.errors import CourseError  # noqa: E402

SCRIPT = ROOT / "scripts" / "benchmark" / "l16_bench.py"


@pytest.mark.parametrize("argv, message", [
    (["--formats", "q4"], "error: --formats 'q4': use q4_1, q8_0 or both, once each"),
    (["--formats", "q8_0,q8_0"], "error: --formats 'q8_0,q8_0': use q4_1, q8_0 or both, once each"),
    (["--rounds", "0", "--ledger"], "error: --rounds must be at least 1, got 0"),
])
def test_bad_options_are_one_line_and_exit_2(argv, message):
    r = subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2 and r.stderr == message + "\n" and r.stdout == ""


def test_lengths_past_the_context_are_refused_before_anything_loads():
    with pytest.raises(CourseError, match="must each fit 2,048 tokens"):
        l16_bench.check(l16_bench.parser().parse_args(["--prefill-len", "4096", "--ledger"]))


def test_the_ledger_reads_smollm2s_bytes_as_worked_by_hand():
    cfg = l16_bench.SMOLLM2
    # a layer: q 576x576, k and v 576x192 each, o 576x576, gate, up and down 576x1536 each
    per_layer = 576 * 576 + 2 * 576 * 192 + 576 * 576 + 3 * 576 * 1536
    assert per_layer == 3_538_944
    assert l16_bench.weight_counts(cfg) == (30 * per_layer, 49152 * 576, 30 * 2 * 576 + 576)
    norms_bytes = 35_136 * 4
    assert l16_bench.weight_bytes(cfg, "fp32") == 4 * (106_168_320 + 28_311_552) + norms_bytes == 538_060_032
    assert l16_bench.weight_bytes(cfg, "bf16") == 2 * (106_168_320 + 28_311_552) + norms_bytes
    assert l16_bench.weight_bytes(cfg, "q8_0") == (106_168_320 + 28_311_552) // 32 * 34 + norms_bytes == 143_025_408
    # Q4_1 matrices, the tied embedding (the LM head) Q8_0: the shipped file's tensors, 92.10 MiB as llama.cpp says
    assert l16_bench.weight_bytes(cfg, "q4_1") == 106_168_320 // 32 * 20 + 28_311_552 // 32 * 34 + norms_bytes
    assert l16_bench.weight_bytes(cfg, "q4_1") == 96_576_768 and f"{96_576_768 / 2**20:.2f}" == "92.10"
    assert l16_bench.stored_bytes(cfg, "q4_1") == 96_576_768  # tied: nothing held beyond what a token reads
    # KV per token of context: 2 x 3 kv heads x 64 x 30 layers x 4 bytes (fp32: the blocks' activations)
    assert l16_bench.kv_bytes(cfg, "q4_1") == 46_080 and l16_bench.kv_bytes(cfg, "bf16") == 23_040
    assert l16_bench.read_per_token(cfg, "q4_1", 160) == 96_576_768 + 160 * 46_080
    rows = l16_bench.ledger_rows(10.0, 160, {"q4_1": {"ours": 50.0}})
    q4 = rows[-1]
    assert q4[0] == "q4_1 (+ Q8_0 embedding)" and q4[1] == "92.10" and q4[2] == "7.03"
    floor = 10e9 / (96_576_768 + 160 * 46_080)  # 103,949,568 bytes: 96.2 tok/s
    assert q4[4] == f"{floor:,.1f}" == "96.2" and q4[5] == f"50.0 ({50 / floor:.0%})" == "50.0 (52%)" and q4[6] == "-"


def test_the_ledgers_counts_are_the_models_parameters_and_an_untied_head_is_held_twice():
    from scripts.launch_count import qwen3_config
    from scripts.sizing import params

    for name in ("Qwen3-0.6B", "Qwen3-8B"):
        cfg = qwen3_config(name)
        layers, head, norms = l16_bench.weight_counts(cfg)
        total, matmul = params(cfg)  # the model built on meta: every parameter stored, a tied one once
        assert layers == matmul and total == layers + head * (1 if cfg.tie_word_embeddings else 2) + norms
    untied = qwen3_config("Qwen3-8B")
    head = l16_bench.weight_counts(untied)[1]
    # q4_1: the untied head is a Q4_1 matrix read every token; the embedding, held beside it, stays Q8_0
    assert l16_bench.head_format(untied, "q4_1") == "q4_1"
    assert l16_bench.stored_bytes(untied, "q4_1") == l16_bench.weight_bytes(untied, "q4_1") + head // 32 * 34


def test_smollm2s_constants_are_the_converted_checkpoints_config():
    from shared.config import Qwen3Config
    from shared.named_models import named_model_dir
    from shared.tiny_qwen3 import cache_root

    folder = named_model_dir("smollm2", cache_root())
    if not (folder / "config.json").is_file():
        pytest.skip("the real model is not converted here (README: A real model)")
    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "tie_word_embeddings", "qk_norm")  # what the ledger reads
    converted = Qwen3Config.from_dir(folder)
    assert {k: getattr(converted, k) for k in shape} == {k: getattr(l16_bench.SMOLLM2, k) for k in shape}


def test_our_q8_0_quantizer_writes_llama_cpps_bytes_for_every_smollm2_matrix():
    """The bench's Q8_0 file is llama.cpp's own quantizer on the F32 export; the lesson's quantize, given the same F32
    values, writes the same bytes for every Q8_0 matrix. Runs where the bench has made both files (outside CI)."""
    import numpy as np
    import torch

    gguf = pytest.importorskip("gguf")
    from lessons.l16_weight_quant.blocks import quantize
    from shared.tiny_qwen3 import cache_root

    folder = cache_root() / "gguf"
    f32, q8 = (folder / f"smollm2-135m-instruct-q4_1-v1-{kind}.gguf" for kind in ("f32", "q8_0"))
    if not (f32.is_file() and q8.is_file()):
        pytest.skip("made by `python scripts/benchmark/l16_bench.py` (needs the llamacpp extra and the real model)")
    values = {t.name: t for t in gguf.GGUFReader(str(f32)).tensors}
    blocks = [t for t in gguf.GGUFReader(str(q8)).tensors if t.tensor_type == gguf.GGMLQuantizationType.Q8_0]
    assert len(blocks) > 200, f"{q8.name}: only {len(blocks)} Q8_0 matrices"
    for t in blocks:
        w = torch.from_numpy(np.array(values[t.name].data)).reshape(t.data.shape[0], -1)
        assert np.array_equal(quantize(w, "q8_0").numpy(), np.asarray(t.data)), f"{t.name}: not llama.cpp's bytes"
