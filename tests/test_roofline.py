"""FLOP counting of scripts/benchmark/roofline.py and the hooks of scripts/benchmark/work_log.py, on a config small enough to
count by hand.

The config: vocab V=10, hidden E=4, MLP I=6, 2 layers, H_q=2 query heads and H_kv=1 KV head of D=2.
One layer's matmuls, (in, out): q (4, 4) = 16, k (4, 2) = 8, v (4, 2) = 8, o (4, 4) = 16,
gate (4, 6) = 24, up (4, 6) = 24, down (6, 4) = 24 -> P_lin = 120 weights.

The work: one request, a 3-token prompt, 2 output tokens, no cache between steps but its own.
  forward 1 feeds positions 0, 1, 2 (one sequence: 3 query rows, 3 keys), samples 1 row;
  forward 2 feeds position 3 (1 query row, 4 keys), samples 1 row.
Tokens fed 4; causal pairs 1 + 2 + 3 = 6 in forward 1 and 4 in forward 2 = 10; vocab rows 2.
  layers    2 x 120 x 2 layers x 4 tokens = 1,920
  attention 2 x 2 x H_q 2 x D 2 x 2 layers x 10 pairs = 320
  vocab     2 x E 4 x V 10 x 2 rows = 160
"""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "benchmark"))
from roofline import (Rates, WorkLog, bucket, causal_pairs, flops, linear_params, matmul_weights,  # noqa: E402
                      roofline_by_op, roofline_seconds)
from work_log import hf_forward, ours_forward  # noqa: E402

from shared.config import Qwen3Config  # noqa: E402

CFG = Qwen3Config(vocab_size=10, hidden_size=4, intermediate_size=6, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=2, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=64,
                  tie_word_embeddings=True, eos_token_ids=())


def the_log() -> WorkLog:
    log = WorkLog()
    log.add_forward(3, [(3, 3)])
    log.vocab_rows[1] += 1
    log.add_forward(1, [(1, 4)])
    log.vocab_rows[1] += 1
    return log


def test_linear_params_by_hand():
    assert linear_params(CFG) == 120


def test_causal_pairs():
    assert causal_pairs(3, 3) == 6  # a prefill: 1 + 2 + 3
    assert causal_pairs(1, 4) == 4  # a decode sees its whole history
    assert causal_pairs(2, 5) == 9  # a chunk ending the history: positions 3 and 4 see 4 + 5 keys


def test_flops_by_hand():
    log = the_log()
    assert (log.tokens_fed, log.rows_sampled) == (4, 2)
    assert flops(CFG, log) == {"layers": 1920, "attention": 320, "vocab": 160}


def test_recompute_counts_the_re_prefill():
    """A preempted request re-fed from scratch: its 4 tokens go through the layers again (every token fed)."""
    log = the_log()
    log.add_forward(4, [(4, 4)])  # recompute: positions 0..3 again, 1 + 2 + 3 + 4 = 10 pairs
    log.vocab_rows[1] += 1
    assert flops(CFG, log) == {"layers": 2 * 120 * 2 * 8, "attention": 32 * 20, "vocab": 80 * 3}


class FlatRates(Rates):
    """Every shape at 1,000 FLOP/s: the roofline time is then the total FLOPs / 1,000."""

    def linear(self, m: int, k: int, n: int) -> float:
        return 1000.0

    def attention(self, queries: int, keys: int) -> float:
        return 1000.0


def test_roofline_seconds_sums_every_op():
    rates = FlatRates(CFG, torch.float32, torch.device("cpu"))
    assert roofline_by_op(CFG, the_log(), rates) == pytest.approx({"layers": 1.92, "attention": 0.32, "vocab": 0.16})
    assert roofline_seconds(CFG, the_log(), rates) == pytest.approx((1920 + 320 + 160) / 1000)


def test_measured_rates_are_positive_in_the_runs_dtype():
    rates = Rates(CFG, torch.bfloat16, torch.device("cpu"))
    assert rates.linear(4, 4, 6) > 0 and rates.attention(1, 4) > 0
    assert rates.pool.dtype == torch.bfloat16


def test_each_timed_matmul_reads_the_next_weight_of_a_model_sized_pool():
    """A step reads each weight once, the rest of the model passing through the cache in between; one weight
    timed again and again would come from the cache. So the timed weights walk a pool of the model's matmul
    weights: 2 layers x 120 + the vocab's 4 x 10 = 280 here, so 280 // 24 = 11 distinct gate-shaped [6, 4]
    weights, in order, then round again; the next shape starts where the last timing stopped."""
    rates = Rates(CFG, torch.float32, torch.device("cpu"))
    assert matmul_weights(CFG) == rates.pool.numel() == 280
    gates = rates._weights(4, 6)
    starts = [next(gates).data_ptr() for _ in range(12)]
    assert len(set(starts[:11])) == 11 and starts[11] == starts[0] == rates.pool.data_ptr()
    assert [(b - a) // 4 for a, b in zip(starts, starts[1:11])] == [24] * 10  # fp32: 4 bytes
    # The 12th stopped 24 in; a [4, 4] weight's slices start every 16, so the next one starts at 32.
    assert next(rates._weights(4, 4)).data_ptr() == rates.pool.data_ptr() + 32 * 4


def test_bucket_is_the_nearest_power_of_4():
    assert [bucket(n) for n in (1, 3, 5, 9, 40, 600, 3000)] == [1, 4, 4, 16, 64, 1024, 4096]


def test_ours_hook_reads_the_flat_stream():
    """Two requests in one step: a 3-token prompt and a decode at position 7 (8 keys)."""
    log = WorkLog()
    meta = SimpleNamespace(qo_indptr=torch.tensor([0, 3, 4]))
    ours_forward(log, (torch.zeros(4, dtype=torch.long), torch.tensor([0, 1, 2, 7]), None, meta))
    assert log.layer_tokens == {4: 1} and log.attention == {(3, 3): 1, (1, 8): 1}


def test_hf_hooks_read_generate_and_continuous_batching():
    log = WorkLog()
    cache = SimpleNamespace(get_seq_length=lambda: 9)  # generate: a padded batch of 2 rows, decoding after 9
    hf_forward(log, {"input_ids": torch.zeros(2, 1, dtype=torch.long), "past_key_values": cache})
    packed = {"input_ids": torch.zeros(1, 3, dtype=torch.long), "cu_seq_lens_q": torch.tensor([0, 1, 2, 3]),
              "cu_seq_lens_k": {"full_attention": torch.tensor([0, 9, 15, 25])}}
    hf_forward(log, packed)  # generate_batch: three decodes with 9, 6 and 10 keys
    assert log.layer_tokens == {2: 1, 3: 1}
    assert log.attention == {(1, 10): 3, (1, 9): 1, (1, 6): 1}
