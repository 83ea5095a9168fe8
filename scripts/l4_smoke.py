"""L4 smoke: continuous batching. Requests arrive two steps apart and join the running batch; each one's
greedy tokens must equal HF's for that prompt alone, and L3's static batch. With --temperature > 0 it also
checks that each seeded request samples the same tokens alone and in a crowd."""
from lessons.l3_block_tensor import L3Engine
from lessons.l3_block_tensor.backends import BACKENDS
from lessons.l4_continuous import Arrival, L4Engine, SamplingParams
from lessons.l4_continuous.engine import DEFAULT_MAX_RUNNING
from shared.cli import smoke_parser
from shared.smoke import main

STAGGER = 2  # request i arrives at engine step 2 * i: prefills land in the middle of others' decodes
DEFAULT_PROMPTS = [
    "a",
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Hello, world!",
    "Continuous batching admits a new request as soon as blocks free up, instead of waiting for the "
    "whole batch to finish; the scheduler runs prefills and decodes in the same forward.",
]


def parser():
    p = smoke_parser("L4", __doc__, blocks=True, default_prompts=DEFAULT_PROMPTS)
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="attention kernels (as in L3)")
    p.add_argument("--max-running", type=int, default=DEFAULT_MAX_RUNNING, help="most requests in one step")
    p.add_argument("--temperature", type=float, default=0.0, help="> 0 adds the seeded-sampling check")
    p.add_argument("--top-k", type=int, default=0, help="0 disables it")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="request i samples with seed SEED + i")
    return p


def sampling_for(args, i: int) -> SamplingParams:
    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed + i)


def build_engines(model, args):
    sampling_for(args, 0)  # bad sampling options fail here, before anything runs
    l4 = L4Engine(model, args.block_size, args.num_blocks, args.max_running, args.backend)
    l3 = L3Engine(model, args.block_size, args.num_blocks, args.backend)
    return {"L4": lambda prompts, stop: l4.generate_batch(prompts, stop, stagger=STAGGER), "L3": l3.generate_batch}


def seeded_check(model, setup, args):
    """Each prompt sampled alone, then all of them in a crowd with greedy companions: same tokens."""
    if args.temperature == 0:
        return None
    def engine():
        return L4Engine(model, args.block_size, args.num_blocks, args.max_running, args.backend)
    prompts, stop = setup.prompt_ids, setup.stop
    alone = [engine().run([Arrival(p, stop, sampling_for(args, i))])[0] for i, p in enumerate(prompts)]
    crowd = [Arrival(p, stop, sampling_for(args, i), STAGGER * i) for i, p in enumerate(prompts)]
    crowd += [Arrival(p, stop, SamplingParams(), 1 + STAGGER * i) for i, p in enumerate(prompts)]  # companions
    together = engine().run(crowd)[: len(prompts)]
    what = f"seeded sampling (temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}, seed {args.seed})"
    for i, (a, b) in enumerate(zip(alone, together)):
        if a != b:
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return False, f"{what}: request {i} differs at position {pos}: alone {a[pos:pos + 1]}, in a crowd {b[pos:pos + 1]}"
    return True, f"{what}: {len(prompts)} request(s) identical alone and in a crowd of {len(crowd)}"


if __name__ == "__main__":
    main("L4", parser(), build_engines, seeded_check)
