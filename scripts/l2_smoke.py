"""L2 smoke: the token-flat paged pool; exits 0 when its greedy tokens equal HF's and L1's."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's lessons/ and shared/, not an installed course's
from lessons.l1_contiguous import L1Engine  # noqa: E402
from lessons.l2_token_flat import L2Engine  # noqa: E402
from shared.cli import smoke_parser  # noqa: E402
from shared.smoke import main  # noqa: E402

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
