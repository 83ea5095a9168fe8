"""L14 smoke: batch invariance. Every prompt's greedy tokens must equal HF's (and L13's), with the engine in its
batch-invariant mode. Then, with a shared preamble of whole blocks before each prompt, each prompt's logits at
every output position must be bitwise equal to its run alone (a cold cache) in each of these runs: in a batch
with filler requests; every prompt cut into 3-token slices; after a prefix-cache hit; preempted and recomputed;
as verify rows (speculation); over int8 pages (int8 alone against int8 in a batch); and as n = 2 seeded siblings,
alone and in a batch, sampling the same tokens.

    python scripts/l14_smoke.py                            # the embedded model, fp32 on the CPU
    python scripts/l14_smoke.py --batch-invariant off      # the same checks in L13's default mode: differences
    python scripts/l14_smoke.py --dtype bfloat16           # invariant in bf16 too (parity: ties as the rule has them)
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lessons.l3_block_tensor.backends import BACKENDS  # noqa: E402
from lessons.l4_continuous.sampling import SamplingParams  # noqa: E402
from lessons.l11_speculative.draft_model import DraftModelDrafter  # noqa: E402
from lessons.l14_batch_invariant import L14Engine  # noqa: E402
from lessons.l14_batch_invariant.record import Recorded, first_difference, run_recorded  # noqa: E402
from l4_smoke import DEFAULT_PROMPTS  # noqa: E402  (scripts/ is on the path when a smoke runs)
from shared.cli import smoke_parser  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.smoke import main  # noqa: E402

FILLERS = 8  # filler requests in the batch runs: seeded random prompts of 3 to 40 tokens
FILLER_SEED = 14
SLICE_TOKENS = 3  # the sliced run: every prompt computed 3 tokens a step, beside the others' decodes
# Before each prompt in the invariance checks: a shared preamble of whole blocks, so a request can hit the prefix
# cache (a first request with it fills the cache in the hot run; the prompts share it in a batch)
PREAMBLE = ("A batch-invariant engine computes every request the same way whatever else it runs: the same "
            "kernels, the same reduction order, the same bits. ")
TEMPERATURE, FIRST_SEED = 0.8, 1000  # the sibling runs: prompt i's two siblings sample with seeds 1000 + 2i + j


def parser():
    p = smoke_parser("L14", __doc__.split("\n\n")[0], blocks=True, default_prompts=DEFAULT_PROMPTS)
    p.add_argument("--batch-invariant", default="on", choices=("on", "off"),
                   help="off: run the same checks on L13's default mode, to see what they catch (default: on)")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="attention kernels (as in L3); the invariant mode takes cpp or auto")
    return p


def run(model, args, prompts: list[list[int]], stop: StopRule, **options) -> Recorded:
    """run_recorded on a fresh engine: the command line's options, then any of `options` that are the engine's."""
    recorded = {name: options.pop(name) for name in ("keep", "first", "sampling", "n") if name in options}
    engine = L14Engine(model, **(dict(block_size=args.block_size, num_blocks=args.num_blocks, backend=args.backend,
                                      batch_invariant=args.batch_invariant == "on") | options))
    return run_recorded(engine, prompts, stop, **recorded)


def fillers(vocab: int) -> list[list[int]]:
    rng = random.Random(FILLER_SEED)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(3, 41))] for _ in range(FILLERS)]


def invariance(model, setup, args) -> tuple[bool, str]:
    """Each check: the same prompts' logits in two runs, bitwise; one line each, the first difference named. Every
    check's prompts start with PREAMBLE, whole blocks, so a run can hit the prefix cache; alone means cold."""
    stop, vocab = setup.stop, setup.config.vocab_size
    preamble = setup.tokenizer.encode(PREAMBLE).ids
    prompts = [preamble + p for p in setup.prompt_ids]
    count = len(prompts)
    crowd = fillers(vocab)
    mixed = crowd[:FILLERS // 2] + prompts + crowd[FILLERS // 2:]  # the prompts in the middle of the batch
    at = range(FILLERS // 2, FILLERS // 2 + count)
    alone = [run(model, args, [p], stop).logits[0] for p in prompts]

    lines, ok = [], True

    def check(name: str, ours: list[torch.Tensor], reference: list[torch.Tensor], note: str = "",
              happened: bool = True, required: bool = True) -> None:
        """`happened`: the run did what it is named for (a hit, a preemption, a draft); where it did not, the line
        fails on the default prompts (`required`) and says so on the user's own."""
        nonlocal ok
        problems = [(i, first_difference(a, b)) for i, (a, b) in enumerate(zip(ours, reference))]
        problems = [(i, d) for i, d in problems if d is not None]
        good = not problems and (happened or not required)
        ok &= good
        if problems:
            i, d = problems[0]
            what = f"prompt {i}: {d} ({len(problems)} of {len(ours)} prompts differ)"
        elif not happened:
            what = f"nothing to compare: {note}"
        else:
            what = f"{sum(len(x) for x in ours)} positions x {vocab:,} logits bitwise equal{note}"
        lines.append(f"{'PASS' if good else 'FAIL'} {name}: {what}")

    batch = run(model, args, mixed, stop)
    check(f"alone = in a batch of {len(mixed)} (at positions {at.start}-{at.stop - 1})",
          [batch.logits[i] for i in at], alone)
    sliced = run(model, args, prompts, stop, max_slice_tokens=SLICE_TOKENS)
    check(f"alone = every prompt in {SLICE_TOKENS}-token slices", sliced.logits, alone)
    hot = run(model, args, prompts, stop, first=preamble + [0])  # the cache holds the preamble's blocks first
    hits = hot.engine.stats.cached_tokens
    check("alone (a cold prefix cache) = after a prefix-cache hit", hot.logits, alone,
          f" ({hits} prompt tokens served from the cache)", happened=hits > 0)

    # a pool of just the largest request's blocks, plus one: the others take turns, recomputed when preempted
    need = max(-(-(len(p) + stop.max_new_tokens) // args.block_size) for p in prompts)
    squeezed = run(model, args, prompts, stop, num_blocks=need + 1, graphs=False)
    preempted = squeezed.engine.stats.preemptions
    check("alone = preempted and recomputed", squeezed.logits, alone,
          f" ({preempted} preemptions)" if preempted else f"no preemption in a pool of {need + 1} blocks",
          happened=preempted > 0, required=args.prompt is None)

    spec = run(model, args, prompts, stop, drafter=DraftModelDrafter(model, args.backend), num_speculative_tokens=4)
    s = spec.engine.spec
    check("alone = verified drafts (L11, K = 4, the model drafting for itself)", spec.logits, alone,
          f" ({s.accepted} of {s.drafted} drafts accepted)" if s.drafted else "nothing was drafted",
          happened=s.drafted > 0)
    int8_alone = [run(model, args, [p], stop, kv_dtype="int8").logits[0] for p in prompts]
    int8_batch = run(model, args, mixed, stop, kv_dtype="int8")
    check("int8 pages: alone = in a batch", [int8_batch.logits[i] for i in at], int8_alone)

    # seeded siblings: prompt i asks for n = 2 with seed 1000 + 2i (sibling j samples with 1000 + 2i + j, L6's rule),
    # alone and in the batch: each sibling must get the same logits and sample the same tokens
    def seeded(seed: int) -> SamplingParams:
        return SamplingParams(temperature=TEMPERATURE, seed=seed)

    two = lambda i: 2  # noqa: E731
    sampled_alone = [run(model, args, [p], stop, n=two, sampling=lambda _, s=FIRST_SEED + 2 * i: seeded(s))
                     for i, p in enumerate(prompts)]
    siblings = run(model, args, mixed, stop, n=lambda j: 2 if j in at else 1, keep=at.stop,
                   sampling=lambda j: seeded(FIRST_SEED + 2 * (j - at.start) if j in at else j))
    reference_tokens = [t for r in sampled_alone for t in r.tokens]
    same = sum(a == b for a, b in zip(siblings.tokens[-2 * count:], reference_tokens))
    check(f"n = 2 seeded siblings (temperature {TEMPERATURE}): alone = in the batch", siblings.logits[-2 * count:],
          [x for r in sampled_alone for x in r.logits], f"; {same} of {2 * count} sampled outputs the same tokens")
    ok &= same == 2 * count
    mode = "batch-invariant mode" if args.batch_invariant == "on" else "default mode (--batch-invariant off)"
    return ok, (f"{mode}; each prompt after a {len(preamble)}-token preamble, every check against its run alone "
                f"(a cold cache):\n  " + "\n  ".join(lines))


def build_engines(model, args):
    def l14(prompts, stop):
        return L14Engine(model, args.block_size, args.num_blocks, backend=args.backend,
                         batch_invariant=args.batch_invariant == "on").generate_batch(prompts, stop)

    def l13(prompts, stop):
        return L14Engine(model, args.block_size, args.num_blocks).generate_batch(prompts, stop)

    L14Engine(model, args.block_size, args.num_blocks, backend=args.backend,
              batch_invariant=args.batch_invariant == "on")  # bad options fail here, before any run
    return {"L14": l14, "L13": l13}


if __name__ == "__main__":
    main("L14", parser(), build_engines, invariance)
