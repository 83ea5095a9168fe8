"""L5 smoke: preemption. A pool barely larger than the biggest single request forces running requests to be
evicted (recompute: dropped and prefilled again; swap: copied to host memory and back); every request's
greedy tokens must still equal HF's for that prompt alone, and L4's."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's lessons/ and shared/, not an installed course's
from lessons.l2_token_flat.engine import blocks_for  # noqa: E402
from lessons.l3_block_tensor.backends import BACKENDS  # noqa: E402
from lessons.l4_continuous import L4Engine  # noqa: E402
from lessons.l4_continuous.engine import DEFAULT_MAX_RUNNING  # noqa: E402
from lessons.l5_preemption import L5Engine  # noqa: E402
from lessons.l5_preemption.scheduler import POLICIES  # noqa: E402
from shared.cli import smoke_parser  # noqa: E402
from shared.smoke import main  # noqa: E402

STAGGER = 1  # request i arrives at step i: each new prompt squeezes the ones already decoding
DEFAULT_PROMPTS = [
    "a",
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Hello, world!",
    "Preemption evicts the most recently admitted request when a running one needs a block and none "
    "is free; it comes back later, by recomputing its cache or by copying it back from host memory.",
]


def parser():
    p = smoke_parser("L5", __doc__, blocks=True, default_prompts=DEFAULT_PROMPTS, block_size=4,
                     pool_default="the biggest single request plus one block, so the others must be preempted")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="attention kernels (as in L3)")
    p.add_argument("--max-running", type=int, default=DEFAULT_MAX_RUNNING, help="most requests in one step")
    p.add_argument("--policy", choices=(*POLICIES, "both"), default="both", help="preemption policy to run")
    p.add_argument("--host-blocks", type=int, help="swap space in blocks (default: as many as the device pool)")
    return p


def build_engines(model, args):
    args.engines = {}  # kept for the preemption report
    policies = POLICIES if args.policy == "both" else (args.policy,)

    def pool_size(prompts, stop) -> int:
        # Default pool: the biggest request alone fits with one block to spare; together they cannot.
        return args.num_blocks or 1 + max(blocks_for(len(p) + stop.max_new_tokens - 1, args.block_size) for p in prompts)

    def l5(policy):
        def run(prompts, stop):
            eng = L5Engine(model, args.block_size, pool_size(prompts, stop), args.max_running, args.backend,
                           policy=policy, host_blocks=args.host_blocks)
            args.engines[policy] = eng
            return eng.generate_batch(prompts, stop, stagger=STAGGER)
        return run

    def l4(prompts, stop):
        eng = L4Engine(model, args.block_size, pool_size(prompts, stop), args.max_running, args.backend)
        return eng.generate_batch(prompts, stop, stagger=STAGGER)

    return {**{f"L5-{p}": l5(p) for p in policies}, "L4": l4}


def preemption_report(model, setup, args):
    parts, ok = [], True
    for policy, eng in args.engines.items():
        s = eng.stats
        parts.append(f"{policy}: {s.preemptions} preemption(s), {s.swaps_out} swapped out / {s.swaps_in} in, "
                     f"pool {eng.allocator.num_blocks} blocks, {eng.allocator.num_free} free at the end")
        leak = eng.allocator.num_free != eng.allocator.num_blocks
        # Only the default prompts are chosen to force preemption (a single prompt of one's own never can be):
        # that run must preempt; any run must end with every block free.
        ok &= not leak and (s.preemptions > 0 or args.num_blocks is not None or args.prompt is not None)
    return ok, "; ".join(parts)


if __name__ == "__main__":
    main("L5", parser(), build_engines, preemption_report)
