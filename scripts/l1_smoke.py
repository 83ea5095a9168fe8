"""L1 smoke: one request on a contiguous KV cache; exits 0 when its greedy tokens equal HF's."""
from lessons.l1_contiguous import L1Engine
from shared.cli import smoke_parser
from shared.smoke import main

DEFAULT_PROMPTS = ["The capital of France is"]


def build_engines(model, args):
    l1 = L1Engine(model)
    return {"L1": lambda prompts, stop: [l1.generate(p, stop) for p in prompts]}


if __name__ == "__main__":
    main("L1", smoke_parser("L1", __doc__, blocks=False, default_prompts=DEFAULT_PROMPTS), build_engines)
