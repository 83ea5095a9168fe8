"""L2 smoke: the token-flat paged pool; exits 0 when its greedy tokens equal HF's and L1's."""
from lessons.l1_contiguous import L1Engine
from lessons.l2_token_flat import L2Engine
from shared.cli import smoke_parser
from shared.smoke import main

DEFAULT_PROMPTS = ["The capital of France is"]


def build_engines(model, args):
    l2 = L2Engine(model, args.block_size, args.num_blocks)
    l1 = L1Engine(model)
    return {
        "L2": lambda prompts, stop: [l2.generate(p, stop) for p in prompts],
        "L1": lambda prompts, stop: [l1.generate(p, stop) for p in prompts],
    }


if __name__ == "__main__":
    main("L2", smoke_parser("L2", __doc__, blocks=True, default_prompts=DEFAULT_PROMPTS), build_engines)
