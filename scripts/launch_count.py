"""Count the kernels one decode step launches, piece by piece, on any Qwen3 shape, without weights.

    python scripts/launch_count.py                       # Qwen3-0.6B and Qwen3-8B, bf16 and fp32
    python scripts/launch_count.py --rows 8

The model is built on torch's meta device (shapes only, no memory, no weights) and one decode step of
`--rows` rows runs under a dispatch-mode counter: every aten op that is not a view is one kernel on CUDA.
Attention is a stand-in for a paged kernel (FlashInfer's decode `run`): one op, after the two indexed
stores that write K and V into the pool. Without inference mode, so a cast that changes nothing (`.float()`
of an fp32 tensor) is not counted, exactly as it launches nothing.
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.cli import OneLineParser  # noqa: E402
from shared.config import Qwen3Config  # noqa: E402
from shared.layers import RotaryEmbedding  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402

# Published shapes (each checkpoint's config.json), so the counts need no download.
QWEN3 = {
    "Qwen3-0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
# The larger dense models, for sizing.py's tp topic only: not in QWEN3, so this script's counts and the
# sizing topics that go through QWEN3 print what they printed before these were added.
QWEN3_LARGER = {
    "Qwen3-14B": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "Qwen3-32B": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}


def qwen3_config(name: str) -> Qwen3Config:
    return Qwen3Config(vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                       eos_token_ids=(151645, 151643), **{**QWEN3, **QWEN3_LARGER}[name])


class OpCounter(TorchDispatchMode):
    """Counts non-view aten ops under the piece of the model that is running (`self.piece`)."""

    def __init__(self):
        super().__init__()
        self.piece = "other"
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.counts[self.piece] += 1
        return func(*args, **(kwargs or {}))


class PagedStandIn:
    """The lesson seam with a paged kernel's launch shape: write K, write V, one attention op."""

    def __init__(self, counter: OpCounter, pool: torch.Tensor):
        self.counter, self.pool = counter, pool

    def attend(self, layer, q, k, v, slots):
        self.counter.piece = "K/V write"
        self.pool.index_copy_(0, slots, k)
        self.pool.index_copy_(0, slots, v)
        self.counter.piece = "attention"
        out = q.clone()  # stands for FlashInfer's decode run: one kernel
        self.counter.piece = "other"
        return out


PIECES = {  # module name suffix -> the piece its ops count under
    "layernorm": "RMSNorms", "q_norm": "RMSNorms", "k_norm": "RMSNorms",
    "q_proj": "projections", "k_proj": "projections", "v_proj": "projections", "o_proj": "projections",
    "gate_proj": "projections", "up_proj": "projections", "down_proj": "projections", "rotary": "RoPE",
}


def count_decode_step(cfg: Qwen3Config, dtype: torch.dtype, rows: int = 4) -> dict[str, Counter]:
    """{"layer": ops of one decoder layer by piece,
    "outside": embedding, RoPE tables, final norm, LM head, fp32 cast}."""
    counter = OpCounter()
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg).to(dtype)
        model.model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        pool = torch.empty(rows, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
        ids, positions = torch.zeros(rows, dtype=torch.long), torch.arange(rows)
    for name, module in model.named_modules():
        piece = next((p for suffix, p in PIECES.items() if name.endswith(suffix)), None)
        if piece is not None:
            module.register_forward_pre_hook(lambda m, a, p=piece: setattr(counter, "piece", p))
            module.register_forward_hook(lambda m, a, o: setattr(counter, "piece", "other"))
    kv = PagedStandIn(counter, pool)
    body = model.model
    with torch.no_grad():  # not inference_mode: under it the counter sees ops before they decompose
        with counter:
            counter.piece = "embedding"
            x = body.embed_tokens(ids)
            counter.piece = "RoPE tables"  # cos and sin of the step's positions: once per step, not per layer
            rope_tables = body.rotary.tables(positions, dtype)
        outside = counter.counts
        counter.counts = Counter()
        with counter:
            x = body.layers[0](x, rope_tables, body.rotary, kv, positions)
        layer, counter.counts = counter.counts, outside
        with counter:
            counter.piece = "final norm"
            x = body.norm(x)
            counter.piece = "LM head"
            logits = model.lm_head(x)
            counter.piece = "fp32 cast"
            logits.float()
    layer["SiLU, gate x up, residual adds"] = layer.pop("other")
    return {"layer": layer, "outside": outside}


def step_total(cfg: Qwen3Config, counts: dict[str, Counter]) -> int:
    return cfg.num_hidden_layers * sum(counts["layer"].values()) + sum(counts["outside"].values())


def main() -> None:
    p = OneLineParser(prog="launch_count.py", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4, help="decode rows in the step (default 4; the count does not depend on it)")
    args = p.parse_args()
    if args.rows < 1:
        p.error(f"--rows must be at least 1, got {args.rows}")
    for name in QWEN3:
        cfg = qwen3_config(name)
        for dtype in (torch.bfloat16, torch.float32):
            counts = count_decode_step(cfg, dtype, args.rows)
            per_layer = sum(counts["layer"].values())
            print(f"{name} {str(dtype).removeprefix('torch.')}: {per_layer} kernels per layer "
                  f"({', '.join(f'{k} {v}' for k, v in counts['layer'].items())}); outside the layers "
                  f"{', '.join(f'{k} {v}' for k, v in counts['outside'].items())}; "
                  f"step {cfg.num_hidden_layers} x {per_layer} + {sum(counts['outside'].values())} = "
                  f"{step_total(cfg, counts):,}")
            if dtype == torch.bfloat16:  # the graph path's dtype: FlashInfer runs no fp32
                print(f"  in one CUDA graph (L7): {graph_share(cfg, counts)}")


def graph_share(cfg: Qwen3Config, counts: dict[str, Counter]) -> str:
    """What L7's captured step holds: the body, and one copy of its output into the static hidden buffer.
    The LM head and the cast run after the replay, on the real rows only; sampling and plan() are host work."""
    out = counts["outside"]
    inside = (out["embedding"] + out["RoPE tables"] + cfg.num_hidden_layers * sum(counts["layer"].values())
              + out["final norm"] + 1)
    return (f"embedding {out['embedding']} + RoPE tables {out['RoPE tables']} + {cfg.num_hidden_layers} x "
            f"{sum(counts['layer'].values())} + final norm "
            f"{out['final norm']} + copy into the static hidden buffer 1 = {inside:,} replayed in one launch; "
            f"after it, eagerly: LM head {out['LM head']}, fp32 cast {out['fp32 cast']}, sampling; before it: plan()")


if __name__ == "__main__":
    main()
