"""L12's worked example on the real engine: one token's K row for one KV head, quantized by hand, found in the pool.

    python scripts/l12_walkthrough.py [--layer L] [--head H] [--position P] [--model smollm2]

A 7-token prompt through L12Engine with int8 KV (block size 4, the C++ kernel, graphs off): one prompt step.
The pool's write is watched, so the row the model computed (fp32, after RoPE for K) is kept beside what the
pool stored. Printed: the row's first 8 of D values, its absmax, the scale, the int8 codes, the round trip
and the largest error against half a step; then where the row sits (block table entry, block id, offset,
slot) and its D + 4 bytes there, the last 4 being the scale; then the step's attention output for that layer,
which the kernel computed from those pages, against the torch oracle reading the same pages again, and against
attention over the unquantized K/V. docs/l12_kv_quant.md shows this output, and the doc's test reruns it.
"""
from __future__ import annotations

import struct
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lessons.l12_kv_quant import L12Engine  # noqa: E402
from lessons.l12_kv_quant.backends import DequantTorchBackend  # noqa: E402
from lessons.l12_kv_quant.quantize import QMAX, SCALE_BYTES, dequantize, quantize  # noqa: E402
from shared.attention import causal_attention  # noqa: E402
from shared.cli import OneLineParser, resolve_model_dir  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.pool_trace import record_engines  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

S, BLOCKS, SHOWN = 4, 16, 8
# positions 0..6: the table's first block full, its second holds 4..6. Ids, not text: what is shown is one K row
# and where it is stored, so any model's vocabulary serves (on SmolLM2, 10 is a special token; no matter).
PROMPT = [10, 20, 30, 40, 50, 60, 70]


def floats(xs, digits: int = 4) -> str:
    return "[" + " ".join(f"{float(x):.{digits}f}" for x in xs) + "]"


def ints(xs) -> str:
    return "[" + " ".join(str(int(x)) for x in xs) + "]"


def parser() -> OneLineParser:
    p = OneLineParser(prog="l12_walkthrough.py", description=__doc__.splitlines()[0])
    p.add_argument("--layer", type=int, default=0, help="the layer whose K row is shown (default: 0)")
    p.add_argument("--head", type=int, default=0, help="the KV head (default: 0)")
    p.add_argument("--position", type=int, default=5, help=f"the prompt position, 0..{len(PROMPT) - 1} (default: 5)")
    p.add_argument("--model", help="a checkpoint directory or a named model (smollm2); default: the embedded tiny model")
    p.add_argument("--trace", metavar="FILE", help="write the pool trace (JSON lines) here; "
                                                 "python scripts/pool_viewer.py --trace FILE draws it")
    return p


def main() -> None:
    p = parser()
    args = p.parse_args()
    try:
        with record_engines(L12Engine, args.trace, "l12"):
            run(args.layer, args.head, args.position, resolve_model_dir(args.model, default_model_dir))
    except CourseError as e:
        p.error(str(e))


def run(layer: int, head: int, position: int, model_dir: Path) -> None:
    model = Qwen3ForCausalLM.from_dir(model_dir, torch.float32, torch.device("cpu"))
    cfg = model.config
    for name, value, limit in (("layer", layer, cfg.num_hidden_layers), ("head", head, cfg.num_key_value_heads),
                               ("position", position, len(PROMPT))):
        if not 0 <= value < limit:
            raise CourseError(f"--{name} {value}: choose 0..{limit - 1}")
    engine = L12Engine(model, S, BLOCKS, backend="cpp", graphs=False, kv_dtype="int8")
    runner, d = engine.runner, cfg.head_dim

    seen: dict[str, torch.Tensor] = {}
    attend = runner.attend

    def watching_attend(at: int, q, k, v, meta):  # the model's one seam into the pool: record, then do as usual
        out = attend(at, q, k, v, meta)
        if at == layer:
            seen.update(q=q.clone(), k=k.clone(), v=v.clone(), out=out.clone(), meta=meta)
        return out

    runner.attend = watching_attend
    seq = engine.add_request(PROMPT, StopRule(2, frozenset(), ignore_eos=True))  # still running after one step
    engine.step()  # the prompt step: every layer's K/V for positions 0..6 quantized into the pool
    runner.attend = attend

    x = seen["k"][position, head]  # [D] fp32: the K the model computed for this token and KV head
    codes, scale = quantize(x)
    back = dequantize(codes, scale)
    s = float(scale)
    i_max = int(x.abs().argmax())
    print(f"prompt {ints(PROMPT)}, block size {S}, kv-dtype int8; layer {layer}, KV head {head}, position {position} "
          f"(token {PROMPT[position]}): its K row, D = {d} values in fp32")
    print(f"  x, first {SHOWN}             {floats(x[:SHOWN])}")
    print(f"  absmax |x|             {float(x.abs().max()):.4f} (index {i_max})")
    print(f"  scale = absmax / {QMAX}   {s:.6f}")
    print(f"  codes = round(x / scale), first {SHOWN}   {ints(codes[:SHOWN])}; index {i_max}: {int(codes[i_max])}")
    print(f"  round trip code x scale, first {SHOWN}   {floats(back[:SHOWN])}")
    err = float((x - back).abs().max())
    within = "yes" if err <= s / 2 + 1e-7 else "NO"
    print(f"  largest |x - code x scale| over all {d}: {err:.6f}; half a step (scale / 2) {s / 2:.6f}: within it: {within}")

    entry, offset = divmod(position, S)
    block = seq.blocks[entry]
    slot = block * S + offset
    row = runner.pool.k[layer][block, offset, head]  # int8 [D + 4]
    scale_bytes = row[d:].contiguous()
    stored = struct.unpack("<f", bytes(scale_bytes.view(torch.uint8).tolist()))[0]
    same = "equal" if torch.equal(row[:d], codes) and stored == s else "DIFFER"
    print(f"where it lives: block table {ints(seq.blocks)}; position {position} -> entry {entry} (block {block}), "
          f"offset {offset} -> slot {block} x {S} + {offset} = {slot}")
    print(f"  pool.k[{layer}] is int8 {list(runner.pool.k[layer].shape)} = [N, S, Hkv, D + {SCALE_BYTES}]; "
          f"pool.k[{layer}][{block}, {offset}, {head}] holds {d} codes, first {SHOWN} {ints(row[:SHOWN])},")
    print(f"  then bytes {d}..{d + SCALE_BYTES - 1} {ints(scale_bytes.view(torch.uint8))} = {stored:.6f} as a "
          f"little-endian fp32: codes and scale {same} the hand computation")

    oracle = DequantTorchBackend()
    meta = seen["meta"]
    oracle.plan(meta)
    again = oracle.run(seen["q"], runner.pool.k[layer], runner.pool.v[layer], meta)
    exact = causal_attention(seen["q"], seen["k"], seen["v"])  # one request: the step's K/V are its whole history
    diff = float((seen["out"] - again).abs().max())
    quant = float((seen["out"] - exact).abs().max())
    agree = "yes" if diff < 1e-5 else "NO"
    print(f"layer {layer}'s attention in the prompt step, read by the kernel ({type(runner.backend).__name__}) from "
          f"these pages: the oracle reading them again agrees within 1e-5: {agree}; "
          f"against fp32 K/V it differs by up to {quant:.4f} "
          f"(its values reach {float(exact.abs().max()):.4f})")
    if within != "yes" or same != "equal" or agree != "yes":
        sys.exit(1)


if __name__ == "__main__":
    main()
