"""On a GPU: where a request's attention and matmul rows move with the batch, and whether the settings the GPU
engines use stop it. A report, not a pass/fail (L14's invariant mode runs on the CPU; this is its GPU recipe,
measured before anyone builds it). Run by scripts/gpu_check.py; alone:

    python scripts/checks/gpu_invariance.py [--history 4096] [--others 63]

1. cuBLAS (bf16): row 0 of x[:M] W^T against x[:1] W^T for M = 1 .. 256, with torch's defaults, then in a fresh
   process with vLLM's settings: CUBLAS_WORKSPACE_CONFIG=:16:8, CUBLASLT_WORKSPACE_SIZE=1 (no workspace for
   split-K) and reduced-precision bf16 reductions off (with split-K off where torch takes the pair).
2. FlashInfer decode (tensor-core kernel, bf16, pages of 16): one request of --history tokens alone and beside
   --others shorter ones: its output bitwise equal or not, planned by default (split-KV chosen by the batch),
   with fixed_split_size (SGLang's 2,048 tokens, given in pages), and with disable_split_kv (its CUDA-graph case).
Exit 0 with the report; 2 without CUDA.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from shared.cli import OneLineParser  # noqa: E402

ROWS = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256)
K = N = 4096
PAGE = 16
SPLIT_TOKENS = 2048  # SGLang's decode split, in tokens; FlashInfer's fixed_split_size counts pages
VLLM_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}


def parser() -> OneLineParser:
    p = OneLineParser(prog="gpu_invariance.py", description=__doc__.splitlines()[0])
    p.add_argument("--history", type=int, default=4096, help="the traced request's tokens (default: 4096)")
    p.add_argument("--others", type=int, default=63, help="requests beside it in the batch (default: 63)")
    p.add_argument("--matmul-only", action="store_true", help=argparse.SUPPRESS)  # the child of matmul_report
    p.add_argument("--strict", action="store_true", help=argparse.SUPPRESS)
    return p


def moved_rows(strict: bool) -> list[int]:
    """The M for which row 0 of x[:M] W^T differs from x[:1] W^T (bf16, cuBLAS)."""
    import torch

    if strict:  # vLLM's batch-invariant mode; the pair form (allow, allow_splitk) exists from torch 2.10
        try:
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = (False, False)
        except (TypeError, ValueError):
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(max(ROWS), K, device="cuda", generator=g).bfloat16()
    w = torch.randn(N, K, device="cuda", generator=g).bfloat16()
    alone = torch.nn.functional.linear(x[:1], w)[0]
    return [m for m in ROWS if not torch.equal(torch.nn.functional.linear(x[:m], w)[0], alone)]


def matmul_report() -> list[str]:
    lines = []
    for label, strict, env in (("torch's defaults", False, {}), ("vLLM's settings", True, VLLM_ENV)):
        argv = [sys.executable, __file__, "--matmul-only"] + (["--strict"] if strict else [])
        r = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **env}, timeout=600)
        if r.returncode != 0:
            lines.append(f"- cuBLAS bf16, {label}: did not run ({(r.stderr.strip().splitlines() or ['?'])[-1]})")
            continue
        moved = json.loads(r.stdout)
        said = "no M moves row 0" if not moved else f"row 0 moves for M = {', '.join(map(str, moved))}"
        lines.append(f"- cuBLAS bf16 [M, {K}] x [{K}, {N}], {label}: {said} (M tried: {', '.join(map(str, ROWS))})")
    return lines


def decode_report(history: int, others: int) -> list[str]:
    import flashinfer
    import torch

    hq, hkv, d = 32, 8, 128  # Qwen3-8B's heads
    g = torch.Generator(device="cuda").manual_seed(1)
    lengths = [history] + [64 + 37 * i % 900 for i in range(others)]
    pages = [-(-n // PAGE) for n in lengths]
    k = torch.randn(sum(pages), PAGE, hkv, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(sum(pages), PAGE, hkv, d, device="cuda", generator=g).bfloat16()
    q = torch.randn(len(lengths), hq, d, device="cuda", generator=g).bfloat16()
    starts = [0]
    for n in pages:
        starts.append(starts[-1] + n)
    workspace = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")

    def first_row(count: int, **split) -> torch.Tensor:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        i32 = dict(dtype=torch.int32, device="cuda")
        wrapper.plan(torch.tensor(starts[:count + 1], **i32), torch.arange(starts[count], **i32),
                     torch.tensor([(n - 1) % PAGE + 1 for n in lengths[:count]], **i32), hq, hkv, d, PAGE,
                     pos_encoding_mode="NONE", q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, **split)
        return wrapper.run(q[:count], (k, v))[0]

    lines = []
    fixed = SPLIT_TOKENS // PAGE
    for label, split in (("default plan", {}), (f"fixed_split_size={fixed} pages", {"fixed_split_size": fixed}),
                         ("disable_split_kv=True", {"disable_split_kv": True})):
        try:
            same = torch.equal(first_row(1, **split), first_row(len(lengths), **split))
            lines.append(f"- FlashInfer decode, {label}: a {history}-token request alone and beside {others} others: "
                         f"{'bitwise equal' if same else 'DIFFERS'}")
        except Exception as e:  # noqa: BLE001 - an API this FlashInfer lacks is a finding to report
            lines.append(f"- FlashInfer decode, {label}: did not run ({type(e).__name__}: {e})")
    return lines


def main() -> int:
    args = parser().parse_args()
    if args.matmul_only:
        print(json.dumps(moved_rows(args.strict)))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("error: gpu_invariance.py measures on a CUDA GPU; torch sees none here", file=sys.stderr)
        return 2
    if args.history < 1 or args.others < 1:
        print(f"error: --history and --others must be at least 1, got {args.history} and {args.others}",
              file=sys.stderr)
        return 2
    lines = [f"GPU invariance probe on {torch.cuda.get_device_name()}:", *matmul_report()]
    try:
        lines += decode_report(args.history, args.others)
    except ImportError:
        lines.append("- FlashInfer decode: flashinfer is not installed (pip install -e \".[flashinfer]\")")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
