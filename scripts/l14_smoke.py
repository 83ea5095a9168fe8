"""L14 smoke: batch invariance. Every prompt's greedy tokens must equal HF's (and L13's), with the engine in its
batch-invariant mode; then each prompt's logits, at every output position, must be bitwise equal to its logits
alone in every one of these runs: in a batch with other prompts and filler requests; with every prompt cut into
3-token slices; after a prefix-cache hit (cold against hot); preempted and recomputed; with speculation (verify
rows); as one of n = 2 siblings; over int8 pages (int8 alone against int8 in a batch); and seeded sampling must
give the same tokens alone and in a batch.

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
# The prefix run: a shared preamble of whole blocks before each prompt; a first request with it fills the cache
PREAMBLE = ("A batch-invariant engine computes every request the same way whatever else it runs: the same "
            "kernels, the same reduction order, the same bits. ")
TEMPERATURE, FIRST_SEED = 0.8, 1000  # the sibling run: prompt i's two siblings sample with seeds 1000 + 2i + j


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
    """Each check: the same prompts' logits in two runs, bitwise; one line each, the first difference named."""
    prompts, stop, vocab = setup.prompt_ids, setup.stop, setup.config.vocab_size
    count = len(prompts)
    crowd = fillers(vocab)
    mixed = crowd[:FILLERS // 2] + prompts + crowd[FILLERS // 2:]  # the prompts in the middle of the batch
    at = range(FILLERS // 2, FILLERS // 2 + count)
    alone = [run(model, args, [p], stop) for p in prompts]
    alone_logits = [r.logits[0] for r in alone]

    lines, ok = [], True

    def check(name: str, ours: list[torch.Tensor], reference: list[torch.Tensor], note: str = "",
              demanded: bool = True) -> None:
        nonlocal ok
        problems = [(i, first_difference(a, b)) for i, (a, b) in enumerate(zip(ours, reference))]
        problems = [(i, d) for i, d in problems if d is not None]
        good = not problems and demanded
        ok &= good
        positions = sum(len(x) for x in ours)
        if problems:
            i, d = problems[0]
            what = f"prompt {i}: {d} ({len(problems)} of {len(ours)} prompts differ)"
        elif not demanded:
            what = f"nothing to compare: {note}"
        else:
            what = f"{positions} positions x {vocab:,} logits bitwise equal{note}"
        lines.append(f"{'PASS' if good else 'FAIL'} {name}: {what}")

    batch = run(model, args, mixed, stop)
    check(f"alone = in a batch of {len(mixed)} (at positions {at.start}-{at.stop - 1})",
          [batch.logits[i] for i in at], alone_logits)
    sliced = run(model, args, prompts, stop, max_slice_tokens=SLICE_TOKENS)
    check(f"alone = every prompt in {SLICE_TOKENS}-token slices", sliced.logits, alone_logits)

    preamble = setup.tokenizer.encode(PREAMBLE).ids
    cold = [run(model, args, [preamble + p], stop).logits[0] for p in prompts]
    hot = [run(model, args, [preamble + p], stop, first=preamble + [0]) for p in prompts]
    hits = sum(r.engine.stats.cached_tokens for r in hot)
    check("cold prefix cache = hot", [r.logits[0] for r in hot], cold,
          f" ({hits} prompt tokens served from the cache)" if hits else "no full block of the preamble was cached",
          demanded=hits > 0)

    # a pool of just the largest request's blocks, plus one: the others take turns, recomputed when preempted
    need = max(-(-(len(p) + stop.max_new_tokens) // args.block_size) for p in prompts)
    squeezed = run(model, args, prompts, stop, num_blocks=need + 1, graphs=False)
    preempted = squeezed.engine.stats.preemptions
    check("alone = preempted and recomputed", squeezed.logits, alone_logits,
          f" ({preempted} preemptions)" if preempted else f"no preemption in a pool of {need + 1} blocks",
          demanded=preempted > 0 or args.prompt is not None)

    drafter = DraftModelDrafter(model, args.backend if args.backend != "auto" else "auto")
    spec = run(model, args, prompts, stop, drafter=drafter, num_speculative_tokens=4)
    s = spec.engine.spec
    check("alone = verified drafts (L11, K = 4, the model drafting for itself)", spec.logits, alone_logits,
          f" ({s.accepted} of {s.drafted} drafts accepted)" if s.drafted else "nothing was drafted",
          demanded=s.drafted > 0)
    int8_alone = [run(model, args, [p], stop, kv_dtype="int8").logits[0] for p in prompts]
    int8_batch = run(model, args, mixed, stop, kv_dtype="int8")
    check("int8 pages: alone = in a batch", [int8_batch.logits[i] for i in at], int8_alone)

    # seeded siblings: prompt i asks for n = 2 with seed 1000 + 2i; sibling j samples as the prompt alone with seed
    # 1000 + 2i + j does (L6's rule), so the batch must give each sibling that run's tokens and logits
    def seeded(seed: int) -> SamplingParams:
        return SamplingParams(temperature=TEMPERATURE, seed=seed)

    sampled_alone = [run(model, args, [p], stop, sampling=lambda _, s=FIRST_SEED + 2 * i + j: seeded(s))
                     for i, p in enumerate(prompts) for j in range(2)]
    siblings = run(model, args, mixed, stop, n=lambda j: 2 if j in at else 1, keep=at.stop,
                   sampling=lambda j: seeded(FIRST_SEED + 2 * (j - at.start) if j in at else j))
    ours = siblings.logits[-2 * count:]
    same = sum(a == b.tokens[0] for a, b in zip(siblings.tokens[-2 * count:], sampled_alone))
    check(f"alone = each of n = 2 seeded siblings (temperature {TEMPERATURE}) in the batch", ours,
          [r.logits[0] for r in sampled_alone], f"; {same} of {2 * count} sampled outputs the same tokens")
    ok &= same == 2 * count
    mode = "batch-invariant mode" if args.batch_invariant == "on" else "default mode (--batch-invariant off)"
    return ok, f"{mode}, every check against the prompt's own run alone:\n  " + "\n  ".join(lines)


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
