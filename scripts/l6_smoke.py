"""L6 smoke: prefix sharing. The default prompts share a 40-token system prompt (10 blocks of 4) and end
differently; the last one is exactly that system prompt. Request i arrives at step i, so each one finds
what the earlier ones cached. Every request's greedy tokens must equal HF's for that prompt alone, and
L5's; the run must serve tokens from the cache and leave every block free or cached-unreferenced.
With --n N --temperature T --seed S, each prompt is also sampled N times in one L6 request (one prefill,
N forks) and child i must equal the prompt run alone on L5 with seed S + i."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's lessons/ and shared/, not an installed course's
from lessons.l3_block_tensor.backends import BACKENDS  # noqa: E402
from lessons.l4_continuous.engine import DEFAULT_MAX_RUNNING, Arrival  # noqa: E402
from lessons.l4_continuous.sampling import SamplingParams  # noqa: E402
from lessons.l5_preemption import L5Engine  # noqa: E402
from lessons.l6_prefix_sharing import L6Engine  # noqa: E402
from lessons.l6_prefix_sharing.engine import check_n  # noqa: E402
from shared.cli import smoke_parser  # noqa: E402
from shared.smoke import main  # noqa: E402

STAGGER = 1  # request i arrives at step i: the first is prefilled (and its blocks cached) before the second
SYSTEM = ("You are a careful assistant for a small town library. Answer in one short sentence, name the shelf "
          "where the book is kept, and never invent a title that is not in the catalogue. Question:")
DEFAULT_PROMPTS = [
    SYSTEM + " where are the atlases?",
    SYSTEM + " who wrote the oldest book here?",
    SYSTEM + " can I borrow two novels at once?",
    SYSTEM,  # entirely cached and block-aligned: its last block is recomputed, never an empty query
]


def parser():
    p = smoke_parser("L6", __doc__, blocks=True, default_prompts=DEFAULT_PROMPTS, block_size=4)
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="attention kernels (as in L3)")
    p.add_argument("--max-running", type=int, default=DEFAULT_MAX_RUNNING, help="most requests in one step")
    p.add_argument("--policy", default="recompute", help="preemption policy: recompute (swap is refused in L6)")
    p.add_argument("--n", type=int, default=1, help="parallel samples per prompt (needs --temperature > 0)")
    p.add_argument("--temperature", type=float, default=0.0, help="for the --n check (0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="child i of the --n check samples with seed + i")
    return p


def build_engines(model, args):
    check_n(args.n, SamplingParams(args.temperature, seed=args.seed))  # bad --n fails before any run
    args.l6 = None

    def l6(prompts, stop):
        args.l6 = L6Engine(model, args.block_size, args.num_blocks, args.max_running, args.backend, policy=args.policy)
        return args.l6.generate_batch(prompts, stop, stagger=STAGGER)

    def l5(prompts, stop):
        eng = L5Engine(model, args.block_size, args.num_blocks, args.max_running, args.backend)
        return eng.generate_batch(prompts, stop, stagger=STAGGER)

    L6Engine(model, args.block_size, args.num_blocks, args.max_running, args.backend, policy=args.policy)  # options
    return {"L6": l6, "L5": l5}


def sharing_report(model, setup, args):
    eng = args.l6
    leak = eng.allocator.num_free != eng.allocator.num_blocks
    ok = not leak and (eng.stats.cached_tokens > 0 or args.prompt is not None)  # the default run must hit
    line = (f"L6: {eng.stats.prefix_line()}; pool {eng.allocator.num_blocks} blocks, {eng.allocator.num_free} free "
            f"or cached-unreferenced at the end ({len(eng.cache)} cached)")
    if args.n > 1:
        sampled, message = parallel_check(model, setup, args)
        ok &= sampled
        line += "; " + message
    return ok, line


def parallel_check(model, setup, args) -> tuple[bool, str]:
    """Each prompt's n samples in an engine of their own: a hit on K/V another prompt's prefill computed
    differs from a fresh prefill in the last bits (different matmul shapes), which greedy absorbs but a
    sampled draw over 151k near-flat probabilities may not (docs/l6_prefix_sharing_appendix.md, more pitfalls)."""
    sampling = SamplingParams(args.temperature, seed=args.seed)
    bad, copies, prefilled = [], 0, 0
    for p, ids in enumerate(setup.prompt_ids):
        eng = L6Engine(model, args.block_size, args.num_blocks, args.max_running, args.backend)
        group = eng.add_parallel(ids, setup.stop, sampling, args.n)
        while eng.scheduler.has_work():
            eng.step()
        copies, prefilled = copies + eng.stats.cow_copies, prefilled + eng.stats.prefill_tokens
        for i, child in enumerate(group):
            alone = L5Engine(model, args.block_size, args.num_blocks, 1, args.backend)
            want = alone.run([Arrival(ids, setup.stop, SamplingParams(args.temperature, seed=args.seed + i))])[0]
            if child.output_ids != want:
                bad.append(f"prompt {p} child {i}")
    total = args.n * len(setup.prompt_ids)
    verdict = f"all {total} children equal their seed alone" if not bad else f"MISMATCH {', '.join(bad)}"
    return not bad, (f"parallel sampling n={args.n}, T={args.temperature}, seeds {args.seed}..{args.seed + args.n - 1}: "
                     f"{verdict}; {copies} copy-on-write, {prefilled} prompt tokens prefilled for "
                     f"{sum(len(i) for i in setup.prompt_ids) * args.n} sampled")


if __name__ == "__main__":
    main("L6", parser(), build_engines, sharing_report)
