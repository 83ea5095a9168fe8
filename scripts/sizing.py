"""Every sizing figure the lesson docs use, computed from Qwen3's published shapes and stated hardware numbers.

    python scripts/sizing.py              # every topic
    python scripts/sizing.py kv prefix    # the topics a doc quotes

The docs quote this script's output in `<!-- output -->` blocks, which tests/test_doc_claims.py reruns, so a
figure in a doc is the figure this arithmetic gives. Change an input below and the docs that quote it fail
until they are updated. Sizes: KiB / MiB / GiB are powers of 1024; GB and GB/s are powers of 1000.
"""
from __future__ import annotations

import math
import sys
from functools import lru_cache
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lessons.l3_block_tensor.backends.flashinfer_args import WORKSPACE_BYTES  # noqa: E402
from lessons.l7_cuda_graphs.capture_sizes import default_capture_sizes  # noqa: E402
from scripts.launch_count import QWEN3, QWEN3_LARGER, qwen3_config  # noqa: E402
from shared.cli import OneLineParser  # noqa: E402
from shared.config import Qwen3Config  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.tiny_qwen3 import TINY_CONFIG  # noqa: E402

# Hardware figures: data-sheet peaks, and the share of them the docs assume real kernels reach.
H100_BF16_FLOPS = 989e12  # H100 SXM, dense bf16 tensor-core peak
H100_HBM_BYTES_PER_S = 3.35e12  # H100 SXM HBM3
PCIE4_BYTES_PER_S = 25e9  # PCIe 4.0 x16 in practice (32 GB/s nominal)
NVLINK4_BYTES_PER_S = 450e9  # H100 SXM NVLink 4: 900 GB/s per GPU in all, 450 GB/s each direction (data-sheet peak)
GPU_BYTES = 80e9  # an 80 GB card
HOST_US_PER_OP = 2.0  # one eager op's CPU side, measured on the course machine (docs/l7_cuda_graphs.md)

KIB, MIB, GIB = 1024, 1024**2, 1024**3


def tiny_config() -> Qwen3Config:
    keys = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
            "tie_word_embeddings"}
    return Qwen3Config(**{k: v for k, v in TINY_CONFIG.items() if k in keys}, eos_token_ids=(TINY_CONFIG["eos_token_id"],))


MODELS = {"tiny": (tiny_config(), 4), **{name: (qwen3_config(name), 2) for name in QWEN3}}  # name -> (config, bytes)


@lru_cache(maxsize=None)  # several topics ask; the meta model is built once per shape
def params(cfg: Qwen3Config) -> tuple[int, int]:
    """(all parameters as stored, those of the layers' matmuls), counted from the model built on meta."""
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    total = sum(p.numel() for p in model.parameters()) - (cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0)
    matmul = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    return total, matmul


def prefill_flop(cfg: Qwen3Config, tokens: int) -> float:
    """One request's prefill: 2 FLOP per matmul weight per token, the causal attention's QK and PV over
    tokens (tokens + 1) / 2 query-key pairs, and the LM head for the one row that is sampled."""
    _, matmul = params(cfg)
    attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * tokens * (tokens + 1) / 2
    return 2 * matmul * tokens + attention + 2 * cfg.vocab_size * cfg.hidden_size


def kib(n: float) -> str:
    return f"{n / KIB:,.4g} KiB"


def mib(n: float, digits: int = 1) -> str:
    return f"{n / MIB:,.{digits}f} MiB".replace(".0 MiB", " MiB")


def gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB"


def kv_bytes(name: str) -> int:
    cfg, nbytes = MODELS[name]
    return cfg.kv_bytes_per_token(nbytes)


def topic_kv() -> None:
    print("KV bytes per token = 2 (K and V) x Hkv x D x layers x dtype bytes")
    for name, (cfg, nbytes) in MODELS.items():
        b = kv_bytes(name)
        dtype = "fp32" if nbytes == 4 else "bf16"
        print(f"  {name:<11} 2 x {cfg.num_key_value_heads} x {cfg.head_dim} x {cfg.num_hidden_layers} x {nbytes} B "
              f"({dtype}) = {b:,} B = {kib(b)}")


def topic_reserve() -> None:
    per, prompt, max_new, used_new, S = kv_bytes("Qwen3-8B"), 100, 4096, 150, 16
    rows, used = prompt + max_new - 1, prompt + used_new - 1
    print(f"Qwen3-8B bf16, {prompt}-token prompt, max-new-tokens {max_new:,}, EOS after {used_new} tokens:")
    print(f"  L1 reserves {rows:,} rows x {kib(per)} = {mib(rows * per, 0)}; it uses {used} rows = {mib(used * per, 0)} "
          f"({used / rows:.1%})")
    blocks = math.ceil(used / S)
    print(f"  paged, S = {S}: ceil({used} / {S}) = {blocks} blocks = {blocks * S} slots = {mib(blocks * S * per, 0)}; "
          f"at most {S - 1} slots wasted = {mib((S - 1) * per)}")
    print(f"  a 32k context: {32768:,} x {kib(per)} = {gib(32768 * per)}")
    print("the default pool (4,096 slots), and L2's gather of a 1,024-token history per decode step (all layers, K and V):")
    for name in MODELS:
        print(f"  {name:<11} pool {mib(4096 * kv_bytes(name), 0)}, gather {mib(1024 * kv_bytes(name), 0)}")


def topic_pages() -> None:
    cfg, nbytes = MODELS["Qwen3-8B"]
    per, S, hkv, d = kv_bytes("Qwen3-8B"), 16, cfg.num_key_value_heads, cfg.head_dim
    pool, reqs = 40 * GIB, 32
    print(f"Qwen3-8B bf16, S = {S}:")
    print(f"  one page of one layer's K: {S} x {hkv} x {d} x {nbytes} B = {kib(S * hkv * d * nbytes)}")
    print(f"  one block, all layers, K and V: {S} x {kib(per)} = {mib(S * per, 2)}")
    print(f"  a 1,024-token history: L2 gathers 1,024 x {kib(per)} = {mib(1024 * per, 0)} per step; "
          f"L3's page table is {1024 // S} int32 = {1024 // S * 4} B")
    print(f"  a {pool // GIB} GiB pool: {pool // per:,} tokens = {pool // (per * S):,} blocks of {S}")
    print(f"  {reqs} requests x 1,024 tokens: {gib(reqs * 1024 * per)}")


def topic_pool() -> None:
    cfg, nbytes = MODELS["Qwen3-8B"]
    per, S, ctx = kv_bytes("Qwen3-8B"), 16, 32768
    weights = params(cfg)[0] * nbytes
    kv = 60e9
    print(f"Qwen3-8B bf16 on an {GPU_BYTES / 1e9:.0f} GB GPU: weights {params(cfg)[0]:,} x {nbytes} B = "
          f"{weights / 1e9:.1f} GB, about {kv / 1e9:.0f} GB left for KV = {kv / per / 1e3:,.1f}k tokens "
          f"({int(kv // (per * S)):,} blocks of {S})")
    print(f"  reserving the {ctx:,}-token context per request: {ctx * per / 1e9:.2f} GB each, {int(kv // (ctx * per))} requests")
    need = math.ceil(1999 / S)
    print(f"  L4's promise for 1,000 prompt + 1,000 output tokens: ceil(1,999 / {S}) = {need} blocks, "
          f"{int(kv // (per * S)) // need} requests")


def topic_swap() -> None:
    per, tokens = kv_bytes("Qwen3-8B"), 2000
    moved = tokens * per
    flop = prefill_flop(MODELS["Qwen3-8B"][0], tokens)
    print(f"Qwen3-8B bf16, a request holding {tokens:,} tokens:")
    print(f"  swap moves {tokens:,} x {kib(per)} = {moved / 1e6:.0f} MB each way; over PCIe 4.0 x16 at "
          f"{PCIE4_BYTES_PER_S / 1e9:.0f} GB/s: {moved / PCIE4_BYTES_PER_S * 1e3:.0f} ms out, the same back")
    print(f"  recompute is a {tokens:,}-token prefill: {flop / 1e12:.1f} TFLOP = "
          + ", ".join(f"{flop / (share * H100_BF16_FLOPS) * 1e3:.0f} ms at {share:.0%}" for share in (0.4, 0.6))
          + f" of an H100's bf16 peak ({H100_BF16_FLOPS / 1e12:.0f} TFLOP/s)")


def topic_prefix() -> None:
    prefix, n = 900, 64
    print(f"a {prefix}-token shared prefix, {n} requests (bf16):")
    for name in ("Qwen3-0.6B", "Qwen3-8B"):
        per = kv_bytes(name)
        print(f"  {name:<11} {kib(per)} per token; the prefix {mib(prefix * per)}; {n} unshared copies "
              f"{gib(n * prefix * per)}, shared {mib(prefix * per)}")
    cfg = MODELS["Qwen3-8B"][0]
    total, matmul = params(cfg)
    one = prefill_flop(cfg, prefix)
    print(f"  Qwen3-8B: {total:,} parameters, {matmul:,} in the layers' matmuls; one {prefix}-token prefill "
          f"{one / 1e12:.1f} TFLOP")
    saved = (n - 1) * one
    print(f"  prefix sharing saves {n - 1} of the {n}: {saved / 1e12:.0f} TFLOP = {saved / (0.4 * H100_BF16_FLOPS):.1f} s "
          f"of an H100 at 40% of its bf16 peak ({H100_BF16_FLOPS / 1e12:.0f} TFLOP/s)")
    S = 16
    blocks = prefix // S
    print(f"  the cache's collision check keeps each block's own tokens and its parent entry: at S = {S}, {blocks} "
          f"blocks hold {S * blocks:,} token ids (whole prefixes would be {S * blocks * (blocks + 1) // 2:,})")


def topic_launches() -> None:
    from scripts.launch_count import count_decode_step, step_total

    cfg, nbytes = MODELS["Qwen3-0.6B"]
    ops = step_total(cfg, count_decode_step(cfg, torch.bfloat16))
    weights = params(cfg)[0] * nbytes
    host = ops * HOST_US_PER_OP * 1e-6
    stream = weights / H100_HBM_BYTES_PER_S
    print(f"Qwen3-0.6B bf16, one eager decode step of batch 1: {ops:,} kernels (scripts/launch_count.py)")
    print(f"  host side at {HOST_US_PER_OP:g} us per op: {host * 1e3:.1f} ms")
    print(f"  the arithmetic: read the weights once, {weights / 1e9:.2f} GB at {H100_HBM_BYTES_PER_S / 1e12:.2f} TB/s "
          f"= {stream * 1e3:.2f} ms")
    print(f"  the GPU would be idle {1 - stream / host:.0%} of the step")


def topic_buffers() -> None:
    cfg, nbytes = MODELS["Qwen3-8B"]
    bmax, S, pool_tokens = 64, 16, 65536
    sizes = len(default_capture_sizes(bmax))
    pages = pool_tokens // S + 1  # the pool and L7's dummy block
    indices = bmax * pages * 4
    print(f"L7's static buffers for Qwen3-8B bf16 at Bmax {bmax}, a {pool_tokens:,}-token pool at S = {S}:")
    print(f"  hidden {bmax} x {cfg.hidden_size} x {nbytes} B = {kib(bmax * cfg.hidden_size * nbytes)}")
    print(f"  kv_indices {bmax} x {pages:,} x 4 B = {mib(indices, 2)}; the graph-mode wrappers' own copies, "
          f"{sizes} sizes: {mib(sizes * indices, 1)}")
    print(f"  one FlashInfer float workspace: {mib(WORKSPACE_BYTES, 0)}")


RDMA_BYTES_PER_S = 50e9  # one 400 Gb/s InfiniBand NDR / RoCE port, line rate: a common prefill-to-decode link
CHUNK_TOKENS = (1, 64, 256, 512, 2048, 8192, 16384)  # tokens in one step (the budget, when it is full)
CHUNK_PROMPT, DISAGG_PROMPT = 32768, 4096


def topic_chunk() -> None:
    name = "Qwen3-8B"
    cfg, nbytes = MODELS[name]
    _, matmul = params(cfg)
    head = cfg.vocab_size * cfg.hidden_size  # untied: the LM head is its own matrix, read whole every step
    weights = (matmul + head) * nbytes  # the embedding table is gathered by row, not read whole
    with torch.device("meta"):
        linears = [m for m in Qwen3ForCausalLM(cfg).model.layers.modules() if isinstance(m, torch.nn.Linear)]
    act = sum(m.in_features + m.out_features for m in linears) * nbytes  # each matmul reads its input, writes its output
    flop = 2 * matmul  # per token, the layers' matmuls
    ridge = H100_BF16_FLOPS / H100_HBM_BYTES_PER_S
    print(f"{name} bf16, one step of T tokens on an H100 SXM: ridge {H100_BF16_FLOPS / 1e12:.0f} TFLOP/s / "
          f"{H100_HBM_BYTES_PER_S / 1e12:.2f} TB/s = {ridge:.0f} FLOP/byte")
    print(f"  weights read once per step: {matmul:,} matmul weights in the layers + the LM head's {head:,} = "
          f"{matmul + head:,} x {nbytes} B = {weights / 1e9:.1f} GB")
    print(f"  per token: 2 x {matmul:,} = {flop / 1e9:.1f} GFLOP in the layers' matmuls, and "
          f"{act / 1e6:.1f} MB of their inputs and outputs (unfused)")
    crossing = ridge * weights / (flop - ridge * act)  # solves flop T / (weights + act T) = ridge
    print(f"  intensity(T) = {flop / 1e9:.1f} GFLOP x T / ({weights / 1e9:.1f} GB + {act / 1e6:.1f} MB x T) "
          f"reaches the ridge at T = {crossing:.0f} tokens")
    print(f"  {'T':>7} {'FLOP/byte':>10} {'read time':>10} {'matmul time at peak':>20}  bound by")
    for t in CHUNK_TOKENS:
        moved, work = weights + act * t, flop * t
        read, compute = moved / H100_HBM_BYTES_PER_S, work / H100_BF16_FLOPS
        print(f"  {t:>7,} {work / moved:>10.1f} {read * 1e3:>7.2f} ms {compute * 1e3:>17.2f} ms  "
              f"{'weight reads' if read > compute else 'matmuls'}")
    per = cfg.kv_bytes_per_token(nbytes)
    whole = prefill_flop(cfg, CHUNK_PROMPT) / H100_BF16_FLOPS
    print(f"a {CHUNK_PROMPT:,}-token prompt in slices of c: every slice re-reads the KV before it "
          f"({kib(per)} per token); the whole prefill at peak: {whole * 1e3:.0f} ms")
    for c in (512, 2048, 8192):
        n = CHUNK_PROMPT // c
        reread = c * n * (n - 1) // 2 * per  # slice k reads k * c tokens of history
        print(f"  c = {c:>5,}: {n} slices, {reread / 1e9:.1f} GB of KV re-read = "
              f"{reread / H100_HBM_BYTES_PER_S * 1e3:.1f} ms at {H100_HBM_BYTES_PER_S / 1e12:.2f} TB/s")
    kv = DISAGG_PROMPT * per
    prefill = prefill_flop(cfg, DISAGG_PROMPT) / H100_BF16_FLOPS
    print(f"disaggregated prefill, a {DISAGG_PROMPT:,}-token prompt: {DISAGG_PROMPT:,} x {kib(per)} = "
          f"{kv / 1e6:.0f} MB of KV moved to the decode instance")
    print(f"  over one {RDMA_BYTES_PER_S * 8 / 1e9:.0f} Gb/s RDMA link: {kv / RDMA_BYTES_PER_S * 1e3:.1f} ms; over "
          f"NVLink 4 ({NVLINK4_BYTES_PER_S / 1e9:.0f} GB/s): {kv / NVLINK4_BYTES_PER_S * 1e3:.1f} ms; the prefill "
          f"itself at peak: {prefill * 1e3:.0f} ms; one decode step's weight read: "
          f"{weights / H100_HBM_BYTES_PER_S * 1e3:.1f} ms")


SPEC_BATCHES, SPEC_QUERIES, SPEC_CONTEXT = (1, 4, 16, 64), (1, 2, 4, 8, 16), 4096


def spec_forward(cfg: Qwen3Config, nbytes: int, batch: int, q: int, context: int) -> tuple[float, float]:
    """(bytes moved, FLOP) of one verify forward: `batch` requests each feeding q tokens after `context` in the
    pool. Bytes: the layers' matmul weights and the LM head once, each request's KV read once, every matmul's
    input and output per token (unfused, as in topic_chunk). FLOP: 2 per matmul weight per token, the LM head
    on every row (a verify step scores all q), attention's QK and PV over about `context` keys per query."""
    _, matmul = params(cfg)
    head = cfg.vocab_size * cfg.hidden_size
    with torch.device("meta"):
        linears = [m for m in Qwen3ForCausalLM(cfg).model.layers.modules() if isinstance(m, torch.nn.Linear)]
    act = sum(m.in_features + m.out_features for m in linears) * nbytes
    tokens = batch * q
    moved = (matmul + head) * nbytes + batch * context * cfg.kv_bytes_per_token(nbytes) + act * tokens
    attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * context
    return moved, tokens * (2 * matmul + 2 * head + attention)


def spec_crossing(cfg: Qwen3Config, nbytes: int, batch: int, context: int, share: float = 1.0) -> float:
    """The q at which one forward's FLOP time (at `share` of the bf16 peak) reaches its read time (both
    linear in q): past it, each more query token per request costs matmul time."""
    b0, _ = spec_forward(cfg, nbytes, batch, 0, context)
    b1, f1 = spec_forward(cfg, nbytes, batch, 1, context)
    ridge = share * H100_BF16_FLOPS / H100_HBM_BYTES_PER_S
    return ridge * b0 / (f1 - ridge * (b1 - b0))


def topic_spec() -> None:
    name, ctx = "Qwen3-8B", SPEC_CONTEXT
    cfg, nbytes = MODELS[name]
    b0, f1 = spec_forward(cfg, nbytes, 1, 0, ctx)[0], spec_forward(cfg, nbytes, 1, 1, ctx)[1]
    kv = ctx * cfg.kv_bytes_per_token(nbytes)
    print(f"{name} bf16 on an H100 SXM, one verify forward: B requests each feed q tokens (K = q - 1 drafts) after "
          f"{ctx:,} in the pool; time = max(bytes / {H100_HBM_BYTES_PER_S / 1e12:.2f} TB/s, FLOP / "
          f"{H100_BF16_FLOPS / 1e12:.0f} TFLOP/s)")
    print(f"  read once: weights and LM head {(b0 - kv) / 1e9:.1f} GB, plus {kv / 1e9:.2f} GB of KV per request; "
          f"per query token {f1 / 1e9:.1f} GFLOP (matmuls, LM head, attention over {ctx:,} keys)")
    print(f"  {'B':>3} {'q':>3} {'tokens':>6} {'read':>9} {'FLOP time':>10} {'forward':>9} {'x q=1':>6}  bound by")
    for batch in SPEC_BATCHES:
        base = None
        for q in SPEC_QUERIES:
            moved, flop = spec_forward(cfg, nbytes, batch, q, ctx)
            read, compute = moved / H100_HBM_BYTES_PER_S, flop / H100_BF16_FLOPS
            step = max(read, compute)
            base = base or step
            print(f"  {batch:>3} {q:>3} {batch * q:>6,} {read * 1e3:>6.2f} ms {compute * 1e3:>7.2f} ms "
                  f"{step * 1e3:>6.2f} ms {step / base:>5.2f}x  {'reads' if read >= compute else 'FLOP'}")
    print("  the q where FLOP time reaches read time (past it, each more token costs matmul time): "
          + ", ".join(f"B = {b}: q = {spec_crossing(cfg, nbytes, b, ctx):.1f}" for b in SPEC_BATCHES))
    print("  the same with the matmuls at 40% of the bf16 peak: "
          + ", ".join(f"B = {b}: q = {spec_crossing(cfg, nbytes, b, ctx, 0.4):.1f}" for b in SPEC_BATCHES))
    print("  (a roofline: kernels at peak, nothing overlapped or lost; a real step of few rows reaches neither peak)")


TP_MODELS = ("Qwen3-8B", *QWEN3_LARGER)  # bf16, like MODELS' Qwen3 entries; 14B and 32B only in this topic
TP_SIZES, TP_REQUEST_TOKENS, TP_DECODE_T, TP_PREFILL_T = (1, 2, 4, 8), 4096, 64, 4096


@lru_cache(maxsize=None)
def tp_rank(cfg: Qwen3Config, tp: int):
    """(rank 0's TpLayout, its parameters as stored), counted from L10's model built on meta. Every rank holds
    as many: each split is even, and the norms are whole on every rank."""
    from lessons.l10_tensor_parallel.group import TpGroup
    from lessons.l10_tensor_parallel.layout import TpLayout
    from lessons.l10_tensor_parallel.model import TpQwen3ForCausalLM

    layout = TpLayout.of(cfg, 0, tp)
    with torch.device("meta"):
        model = TpQwen3ForCausalLM(cfg, layout, TpGroup(0, tp, torch.device("meta")))
    tied = len(layout.vocab) * cfg.hidden_size if cfg.tie_word_embeddings else 0  # one tensor when tied
    return layout, sum(p.numel() for p in model.parameters()) - tied


def mib_g(n: float) -> str:
    return f"{n / MIB:,.4g} MiB"


def us(seconds: float) -> str:
    t = seconds * 1e6
    return f"{t:.1f} us" if t < 100 else f"{t:.0f} us" if t < 1000 else f"{t / 1e3:.2f} ms"


def topic_tp() -> None:
    from lessons.l10_tensor_parallel.layout import check_tp
    from shared.errors import CourseError

    print(f"Tensor parallelism, bf16, one {GPU_BYTES / 1e9:.0f} GB card per rank; KV gets the card minus the rank's weights")
    print("(no reserve for activations or workspace: an upper bound). A rank holds its KV heads of every token, so the")
    print(f"tokens that fit on one rank are the tokens the group holds. requests: how many of {TP_REQUEST_TOKENS:,} tokens "
          f"each fit at once.")
    for name in TP_MODELS:
        cfg, nbytes = qwen3_config(name), 2
        total, per = params(cfg)[0], cfg.kv_bytes_per_token(nbytes)
        hkv = cfg.num_key_value_heads
        print(f"{name}: {total:,} parameters x {nbytes} B = {total * nbytes / 1e9:.1f} GB; KV 2 x {hkv} x {cfg.head_dim} x "
              f"{cfg.num_hidden_layers} x {nbytes} B = {kib(per)} per token")
        print(f"  {'tp':>3} {'weights/rank':>13} {'KV heads/rank':>14} {'KV/token/rank':>14} {'left for KV':>12} "
              f"{'tokens of KV':>13} {'requests':>9} {'per card':>9}")
        for tp in TP_SIZES:
            try:
                check_tp(cfg, tp)
            except CourseError as e:
                print(f"  {tp:>3} refused: {e}")
                continue
            layout, weights = tp_rank(cfg, tp)
            kv_tok = layout.local_config(cfg).kv_bytes_per_token(nbytes)
            heads = f"{len(layout.kv_heads)}" + (f" (x{tp // hkv})" if tp > hkv else "")  # each head on tp/Hkv ranks
            left = GPU_BYTES - weights * nbytes
            tokens = int(left // kv_tok) if left > 0 else 0
            reqs = tokens // TP_REQUEST_TOKENS
            print(f"  {tp:>3} {weights * nbytes / 1e9:>10.1f} GB {heads:>14} {kib(kv_tok):>14} "
                  f"{max(left, 0) / 1e9:>9.1f} GB {tokens:>13,} {reqs:>9,} {reqs / tp:>9,.1f}")
    print("  KV heads (xN): each KV head held by N ranks (tp above Hkv); per card: requests / tp, to set beside tp 1")


# The per-collective latency of a small all-reduce: not a data-sheet figure, an assumption rounded from reported
# nccl-tests runs. NVIDIA/nccl issue 1259: about 6 us for 2 H100 SXM over NVLink (NVLS, CUDA graphs, 128 B to
# 64 KiB); rounded up to 10 us for runs without graphs or NVLS. NVIDIA/nccl issue 1530: 42 us for an 8-byte
# all-reduce across 8 RTX 4090s over PCIe; 40 us here. Held fixed across tp (a ring's latency grows with tp).
NVLINK_AR_LATENCY_S, PCIE_AR_LATENCY_S = 10e-6, 40e-6
TP_COMM_TOKENS = ((1, "decode"), (64, "decode"), (256, "decode"), (4096, "prefill"))


def all_reduce_s(nbytes: float, tp: int, latency_s: float, link_bytes_per_s: float) -> float:
    """One ring all-reduce: a fixed latency, then each rank sends (and receives) 2(tp-1)/tp of the tensor."""
    return latency_s + nbytes * 2 * (tp - 1) / tp / link_bytes_per_s


def topic_tp_comm() -> None:
    name = "Qwen3-8B"
    cfg, nbytes = qwen3_config(name), 2
    e, layers = cfg.hidden_size, cfg.num_hidden_layers
    layer_weights = params(cfg)[1] // layers
    print(f"{name}'s all-reduces, on paper: 2 per layer (o_proj, down_proj), each [T, {e:,}] x {nbytes} B. One costs a "
          f"latency (NVLink {NVLINK_AR_LATENCY_S * 1e6:g} us,")
    print(f"PCIe {PCIE_AR_LATENCY_S * 1e6:g} us: assumed, rounded from nccl-tests runs reported in NVIDIA/nccl "
          f"issue 1259, about 6 us for 128 B to 64 KiB between 2 H100s")
    print("over NVLink with CUDA graphs, and issue 1530, 42 us for 8 B across 8 RTX 4090s over PCIe) + bytes x "
          f"2(tp-1)/tp / link (ring; NVLink 4 {NVLINK4_BYTES_PER_S / 1e9:.0f} GB/s,")
    print(f"PCIe 4.0 x16 {PCIE4_BYTES_PER_S / 1e9:.0f} GB/s per direction). layer/rank: the layer's {layer_weights:,} "
          f"matmul weights / tp read at {H100_HBM_BYTES_PER_S / 1e12:.2f} TB/s, or 2 FLOP")
    print(f"each per token at {H100_BF16_FLOPS / 1e12:.0f} TFLOP/s, the longer (KV reads, not counted, only lengthen "
          f"it). lat: the latencies' share of the NVLink time.")
    print(f"  {'T':>5} {'tp':>3} {'all-reduce':>10} {'layer/rank':>11} {'bound by':>12} {'NVLink x2':>10} {'lat':>4} "
          f"{'PCIe x2':>9} {'NVLink/layer':>13} {'PCIe/layer':>11}")
    for tokens, what in TP_COMM_TOKENS:
        payload = tokens * e * nbytes
        for tp in TP_SIZES[1:]:
            read = layer_weights / tp * nbytes / H100_HBM_BYTES_PER_S
            matmul = 2 * layer_weights / tp * tokens / H100_BF16_FLOPS
            layer = max(read, matmul)
            nvlink = 2 * all_reduce_s(payload, tp, NVLINK_AR_LATENCY_S, NVLINK4_BYTES_PER_S)
            pcie = 2 * all_reduce_s(payload, tp, PCIE_AR_LATENCY_S, PCIE4_BYTES_PER_S)
            print(f"  {tokens:>5,} {tp:>3} {mib_g(payload) if payload >= MIB else kib(payload):>10} {us(layer):>11} "
                  f"{'weight reads' if read >= matmul else 'matmuls':>12} {us(nvlink):>10} "
                  f"{2 * NVLINK_AR_LATENCY_S / nvlink:>4.0%} {us(pcie):>9} {nvlink / layer:>12.2f}x "
                  f"{pcie / layer:>10.2f}x")
    print(f"  T = 1 to 256: decode batches; T = 4,096: a prefill. vLLM's custom all-reduce takes tensors under 8 MiB "
          f"(its default max_size) off NCCL.")


# Qwen3's MoE models, from their published config.json (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B): every layer's MLP
# is num_experts experts of moe_intermediate_size, of which num_experts_per_tok run per token; untied embeddings.
QWEN3_MOE = {
    "Qwen3-30B-A3B": dict(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128, active=8,
                          expert_width=768),
    "Qwen3-235B-A22B": dict(hidden=4096, layers=94, heads=64, kv_heads=4, head_dim=128, experts=128, active=8,
                            expert_width=1536),
}
PP_MODEL, LONG_PROMPT = "Qwen3-32B", 131072


def moe_params(m: dict) -> tuple[int, int, int, int]:
    """(all parameters, those one token uses, one layer's experts, the rest of the model: attention, router,
    norms, embeddings), counted from the shapes."""
    e, d = m["hidden"], m["head_dim"]
    attention = e * m["heads"] * d * 2 + e * m["kv_heads"] * d * 2 + 2 * d  # q, o; k, v; q_norm, k_norm
    expert = 3 * e * m["expert_width"]  # gate, up, down
    layer_rest = attention + e * m["experts"] + 2 * e  # + the router and the two norms
    rest = m["layers"] * layer_rest + 2 * 151936 * e + e  # + embedding, LM head, final norm
    experts = m["experts"] * expert
    return rest + m["layers"] * experts, rest + m["layers"] * m["active"] * expert, experts, rest


def topic_parallel() -> None:
    print("Past tensor parallelism, bf16, 80 GB cards:")
    cfg, nbytes = qwen3_config(PP_MODEL), 2
    e, layers = cfg.hidden_size, cfg.num_hidden_layers
    hop = e * nbytes
    tp_traffic = 2 * layers * hop * 2 * (2 - 1) / 2  # tp 2: 2 all-reduces a layer, 2(tp-1)/tp of [E] each
    print(f"pipeline, {PP_MODEL} in 2 stages of {layers // 2} layers: one [{e:,}] activation crosses the stage "
          f"boundary per token, {kib(hop)}; tp 2 instead sends {kib(tp_traffic)} per token per rank in "
          f"{2 * layers} all-reduces a forward ({tp_traffic / hop:.0f}x the bytes; 1 send a boundary instead)")
    for name, m in QWEN3_MOE.items():
        total, active, experts, rest = moe_params(m)
        weights = total * nbytes
        ep = 8
        per_rank = (rest + m["layers"] * experts / ep) * nbytes
        dispatch = m["active"] * m["hidden"] * nbytes
        print(f"{name}: {total:,} parameters ({weights / 1e9:.1f} GB), {active:,} used per token "
              f"({active / total:.1%}); {m['experts']} experts a layer, {m['active']} per token")
        print(f"  expert parallel over {ep} cards ({m['experts'] // ep} experts each, the rest replicated): "
              f"{per_rank / 1e9:.1f} GB a card; a token's MLP input goes to at most {m['active']} cards and back, "
              f"{kib(dispatch)} each way per layer")
    cfg, nbytes = qwen3_config("Qwen3-8B"), 2
    per = cfg.kv_bytes_per_token(nbytes)
    weights = params(cfg)[0] * nbytes
    kv = LONG_PROMPT * per
    flop = prefill_flop(cfg, LONG_PROMPT)
    attention = flop - 2 * params(cfg)[1] * LONG_PROMPT - 2 * cfg.vocab_size * cfg.hidden_size
    print(f"context, Qwen3-8B, a {LONG_PROMPT:,}-token prompt: KV {LONG_PROMPT:,} x {kib(per)} = {kv / 1e9:.1f} GB "
          f"({int((GPU_BYTES - weights) // kv)} such requests beside the weights on one card); prefill "
          f"{flop / 1e15:.1f} PFLOP, {attention / flop:.0%} of it attention,")
    print(f"  {flop / H100_BF16_FLOPS:.1f} s at one H100's bf16 peak; split over 8 ranks by sequence, "
          f"{kv / 8 / 1e9:.1f} GB of KV and {flop / 8 / H100_BF16_FLOPS:.2f} s each")


# KV storage formats for topic_kvquant: (bytes per element, bytes added per row of D, i.e. per token and KV head).
# int8 is this course's (lessons/l12_kv_quant: an fp32 scale after each row's codes); fp8 e4m3 as vLLM and
# FlashInfer store it, one scale per tensor (per layer), which adds no bytes per token.
KVQ_FORMATS = {"bf16": (2, 0), "int8": (1, 4), "fp8": (1, 0)}
KVQ_MODELS = ("Qwen3-8B", "Qwen3-32B")
KVQ_REQUEST_TOKENS, KVQ_CONTEXTS, KVQ_BLOCK = 4096, (4096, 32768), 16


def kvq_row_bytes(cfg: Qwen3Config, fmt: str) -> int:
    """One token's K (or V) for one KV head, as stored."""
    nbytes, extra = KVQ_FORMATS[fmt]
    return cfg.head_dim * nbytes + extra


def kvq_token_bytes(cfg: Qwen3Config, fmt: str) -> int:
    """One token's K and V over every layer and KV head, as stored: 2 x layers x Hkv x row bytes."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * kvq_row_bytes(cfg, fmt)


def topic_kvquant() -> None:
    print(f"Quantized KV on one {GPU_BYTES / 1e9:.0f} GB card, weights in bf16 beside it (no reserve for activations or "
          "workspace: an upper bound).")
    print("A row is one token's K or V for one KV head: bf16 D x 2 B; int8 D x 1 B + a 4 B fp32 scale (per token and "
          "KV head); fp8 D x 1 B, one scale per tensor (no bytes per row).")
    print(f"requests: how many of {KVQ_REQUEST_TOKENS:,} tokens each fit at once; decode read: the KV one request's "
          f"new token reads at a context of {KVQ_CONTEXTS[0]:,} / {KVQ_CONTEXTS[1]:,} tokens, and that read at "
          f"{H100_HBM_BYTES_PER_S / 1e12:.2f} TB/s (H100 SXM).")
    for name in KVQ_MODELS:
        cfg, nbytes = qwen3_config(name), 2
        total = params(cfg)[0]
        left = GPU_BYTES - total * nbytes
        base = kvq_token_bytes(cfg, "bf16")
        print(f"{name}: {total:,} parameters x {nbytes} B = {total * nbytes / 1e9:.1f} GB, {left / 1e9:.1f} GB left "
              f"for KV; per token 2 (K, V) x {cfg.num_hidden_layers} layers x {cfg.num_key_value_heads} KV heads x "
              f"a row (D = {cfg.head_dim})")
        print(f"  {'format':<6} {'row':>6} {'per token':>10} {'x bf16':>7} {'tokens of KV':>13} "
              f"{f'blocks of {KVQ_BLOCK}':>13} {'requests':>9} {'read at 4k':>11} {'time':>8} {'read at 32k':>12} "
              f"{'time':>8}")
        for fmt in KVQ_FORMATS:
            row, per = kvq_row_bytes(cfg, fmt), kvq_token_bytes(cfg, fmt)
            tokens = int(left // per)
            reads = [(ctx * per, ctx * per / H100_HBM_BYTES_PER_S) for ctx in KVQ_CONTEXTS]
            print(f"  {fmt:<6} {row:>4} B {kib(per):>10} {base / per:>6.3f}x {tokens:>13,} "
                  f"{tokens // KVQ_BLOCK:>13,} {tokens // KVQ_REQUEST_TOKENS:>9,} "
                  + " ".join(f"{mib(b, 0):>11} {us(t):>8}" for b, t in reads))
    scale = KVQ_FORMATS["int8"][1]
    for d in (128, 64):  # Qwen3's D; the course's small models' (embedded, bench shape)
        int8, bf16 = d + scale, 2 * d
        print(f"  D = {d}: the int8 scale is {scale} B of every {int8} B row ({scale / int8:.1%}); int8 holds "
              f"{bf16} / {int8} = {bf16 / int8:.3f}x the bf16 tokens in the same bytes (fp8: 2x)")


TOPICS = {"kv": topic_kv, "reserve": topic_reserve, "pages": topic_pages, "pool": topic_pool, "swap": topic_swap,
          "prefix": topic_prefix, "launches": topic_launches, "buffers": topic_buffers, "chunk": topic_chunk,
          "spec": topic_spec, "tp": topic_tp, "tp-comm": topic_tp_comm, "parallel": topic_parallel,
          "kvquant": topic_kvquant}


def main() -> None:
    p = OneLineParser(prog="sizing.py", description=__doc__.splitlines()[0])
    p.add_argument("topics", nargs="*", metavar="TOPIC", help=f"any of {', '.join(TOPICS)} (default: all)")
    args = p.parse_args()
    unknown = [t for t in args.topics if t not in TOPICS]
    if unknown:
        p.error(f"unknown topic {unknown[0]!r}: choose from {', '.join(TOPICS)}")
    for name in args.topics or TOPICS:
        TOPICS[name]()


if __name__ == "__main__":
    main()
