"""L1 smoke: one request on a contiguous KV cache; exits 0 when its greedy tokens equal HF's."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's lessons/ and shared/, not an installed course's
from lessons.l1_contiguous import L1Engine  # noqa: E402
from shared.cli import smoke_parser  # noqa: E402
from shared.smoke import main  # noqa: E402

DEFAULT_PROMPTS = ["The capital of France is"]


def build_engines(model, args):
    l1 = L1Engine(model)
    return {"L1": lambda prompts, stop: [l1.generate(p, stop) for p in prompts]}


if __name__ == "__main__":
    main("L1", smoke_parser("L1", __doc__, blocks=False, default_prompts=DEFAULT_PROMPTS), build_engines)
