"""L3 smoke: block-tensor pages and paged attention; all prompts run as one batch, and each one's greedy
tokens must equal HF's for that prompt alone and L2's."""
from lessons.l2_token_flat import L2Engine
from lessons.l3_block_tensor import L3Engine
from lessons.l3_block_tensor.backends import BACKENDS
from shared.cli import smoke_parser
from shared.smoke import main

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
