"""L3 smoke: block-tensor pages and paged attention; all prompts run as one batch, and each one's greedy
tokens must equal HF's for that prompt alone and L2's."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's lessons/ and shared/, not an installed course's
from lessons.l2_token_flat import L2Engine  # noqa: E402
from lessons.l3_block_tensor import L3Engine  # noqa: E402
from lessons.l3_block_tensor.backends import BACKENDS  # noqa: E402
from shared.cli import smoke_parser  # noqa: E402
from shared.smoke import main  # noqa: E402

# Clearly different lengths (1, 5, 20 and 59 tokens): a ragged batch, one request spanning 4 blocks of 16.
DEFAULT_PROMPTS = [
    "a",
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Paged attention stores the key/value cache in fixed-size blocks, so memory is allocated on demand "
    "instead of reserved for the longest possible sequence; a block table maps each request's logical "
    "positions to physical blocks, exactly as virtual memory maps pages to frames, and a kernel reads "
    "them through that table.",
]


def build_engines(model, args):
    l3 = L3Engine(model, args.block_size, args.num_blocks, args.backend)
    l2 = L2Engine(model, args.block_size, args.num_blocks)
    return {
        "L3": l3.generate_batch,  # every prompt in one batch
        "L2": lambda prompts, stop: [l2.generate(p, stop) for p in prompts],
    }


def parser():
    p = smoke_parser("L3", __doc__, blocks=True, default_prompts=DEFAULT_PROMPTS)
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="attention kernels: flashinfer (CUDA), cpp (the C++ kernel that walks the block table, CPU; "
                        "built on first use), batched (one call for all decodes, anywhere), torch (the per-request "
                        "oracle), auto (flashinfer when it can run, else cpp on the CPU where it builds, else batched)")
    return p


if __name__ == "__main__":
    main("L3", parser(), build_engines)
