"""scripts/sizing.py spec: one verify forward's bytes and FLOP on a shape small enough to count by hand, the
crossing q where FLOP time meets read time, and the printed table agreeing with both."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from scripts import sizing  # noqa: E402
from shared.config import Qwen3Config  # noqa: E402

# hidden 8, 2 heads of 4 (q and o: 8 x 8), 1 KV head (k and v: 8 x 4), MLP 16 wide, 2 layers, vocab 100, untied.
SMALL = Qwen3Config(vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=64,
                    tie_word_embeddings=False, eos_token_ids=(0,))


def test_one_verify_forward_counted_by_hand():
    matmul = 2 * (64 + 32 + 32 + 64 + 3 * 128)  # per layer q, k, v, o, gate, up, down
    head = 100 * 8
    act = 2 * (16 + 12 + 12 + 16 + 24 + 24 + 24)  # every matmul's input + output, per token, both layers
    kv = 2 * 1 * 4 * 2 * 2  # K and V, 1 head of 4, 2 layers, bf16
    moved, flop = sizing.spec_forward(SMALL, 2, batch=3, q=2, context=10)
    assert moved == (matmul + head) * 2 + 3 * 10 * kv + act * 2 * 6
    assert flop == 6 * (2 * matmul + 2 * head + 4 * 2 * 2 * 4 * 10)  # QK and PV: 2 layers, 2 heads of 4, 10 keys


@pytest.mark.parametrize("batch", [1, 16])
def test_the_crossing_is_where_flop_time_meets_read_time(batch):
    cfg, nbytes = sizing.MODELS["Qwen3-8B"]
    q = sizing.spec_crossing(cfg, nbytes, batch, 4096)
    moved, flop = sizing.spec_forward(cfg, nbytes, batch, q, 4096)
    assert math.isclose(moved / sizing.H100_HBM_BYTES_PER_S, flop / sizing.H100_BF16_FLOPS, rel_tol=1e-9)
    lower = sizing.spec_crossing(cfg, nbytes, batch, 4096, share=0.4)
    assert lower < q  # slower matmuls leave the read-bound region sooner


def test_the_printed_table_follows_the_arithmetic(capsys):
    sizing.topic_spec()
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == len(sizing.SPEC_BATCHES) * len(sizing.SPEC_QUERIES)
    cfg, nbytes = sizing.MODELS["Qwen3-8B"]
    for row in rows:
        batch, q = int(row[0]), int(row[1])
        bound = "reads" if q < sizing.spec_crossing(cfg, nbytes, batch, sizing.SPEC_CONTEXT) else "FLOP"
        assert row[-1] == bound, row
        if q == 1:
            assert row[-2] == "1.00x"
    crossings = ", ".join(f"B = {b}: q = {sizing.spec_crossing(cfg, nbytes, b, sizing.SPEC_CONTEXT):.1f}"
                          for b in sizing.SPEC_BATCHES)
    assert crossings in out
