"""scripts/sizing.py kvquant: KV bytes per token in bf16, int8 (a 4-byte scale per row) and fp8 counted by hand
for Qwen3-8B, and the printed table agreeing with the arithmetic (tokens, blocks, requests, ratios)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from scripts import sizing  # noqa: E402
from scripts.launch_count import qwen3_config  # noqa: E402


def test_bytes_per_token_counted_by_hand():
    cfg = qwen3_config("Qwen3-8B")  # 36 layers, 8 KV heads, D = 128
    assert sizing.kvq_token_bytes(cfg, "bf16") == 2 * 36 * 8 * 128 * 2 == cfg.kv_bytes_per_token(2)
    assert sizing.kvq_token_bytes(cfg, "int8") == 2 * 36 * 8 * (128 + 4)  # the scale rides in every row
    assert sizing.kvq_token_bytes(cfg, "fp8") == 2 * 36 * 8 * 128  # one scale per tensor: nothing per row
    big = qwen3_config("Qwen3-32B")
    assert sizing.kvq_token_bytes(big, "int8") == 2 * 64 * 8 * 132


def test_the_printed_table_follows_the_arithmetic(capsys):
    sizing.topic_kvquant()
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in sizing.KVQ_FORMATS]
    assert [r[0] for r in rows] == list(sizing.KVQ_FORMATS) * len(sizing.KVQ_MODELS)
    for name, block in zip(sizing.KVQ_MODELS, (rows[:3], rows[3:])):
        cfg = qwen3_config(name)
        left = sizing.GPU_BYTES - sizing.params(cfg)[0] * 2
        for row in block:
            per = sizing.kvq_token_bytes(cfg, row[0])
            tokens = int(left // per)
            assert row[5] == f"{sizing.kvq_token_bytes(cfg, 'bf16') / per:.3f}x"
            assert [int(x.replace(",", "")) for x in row[6:9]] == [tokens, tokens // 16, tokens // 4096]
    assert "int8 holds 256 / 132 = 1.939x the bf16 tokens" in out  # the lesson's 1.9x target, at Qwen3's D
    assert "int8 holds 128 / 68 = 1.882x the bf16 tokens" in out  # and why the small models fall short of it
