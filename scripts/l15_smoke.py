"""L15 smoke: prefill/decode disaggregation. Every prompt is prefilled by one engine (P), its K/V blocks pulled over a
loopback socket by a second (D), which decodes; greedy tokens must equal HF's (and L14's colocated engine's). Then,
with L14's batch-invariant mode on both engines, D's logits at every output position must be bitwise a colocated
L14 engine's: with D's prefix cache cold, with it holding a shared preamble (D pulls only the rest), over int8
pages, and for n = 2 seeded siblings.

    python scripts/l15_smoke.py                     # the embedded model, fp32 on the CPU
    python scripts/l15_smoke.py --model smollm2     # the real model
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lessons.l3_block_tensor.backends import BACKENDS  # noqa: E402
from lessons.l4_continuous.sampling import SamplingParams  # noqa: E402
from lessons.l14_batch_invariant import L14Engine  # noqa: E402
from lessons.l14_batch_invariant.record import first_difference, run_recorded  # noqa: E402
from lessons.l15_disaggregated import L15Engine  # noqa: E402
from lessons.l15_disaggregated.pair import run_disaggregated  # noqa: E402
from l4_smoke import DEFAULT_PROMPTS  # noqa: E402  (scripts/ is on the path when a smoke runs)
from shared.cli import smoke_parser  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.smoke import main  # noqa: E402

# Before each prompt in the exactness checks: whole blocks shared by every prompt, so D's cache can hold them
PREAMBLE = ("A disaggregated server prefills on one engine and decodes on another; the decode engine pulls the "
            "prompt's pages and continues exactly where the prefill engine stopped. ")
TEMPERATURE, FIRST_SEED = 0.8, 1500  # the sibling check: prompt i's two siblings sample with seeds 1500 + 2i + j


def parser():
    p = smoke_parser("L15", __doc__.split("\n\n")[0], blocks=True, default_prompts=DEFAULT_PROMPTS)
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="attention kernels (as in L3)")
    return p


def pair(model, args, invariant: bool, **options) -> tuple[L15Engine, L15Engine]:
    """P and D: the same options, one pool each."""
    common = dict(block_size=args.block_size, num_blocks=args.num_blocks, backend=args.backend,
                  batch_invariant=invariant) | options
    return (L15Engine(model, kv_role="kv_producer", **common), L15Engine(model, kv_role="kv_consumer", **common))


def disaggregated(model, args, prompts, stop, invariant: bool, warm: list[int] | None = None, **options):
    """prompts through a fresh P -> D pair (D's cache first holding `warm`'s blocks, if given); P's server closed."""
    recorded = {name: options.pop(name) for name in ("sampling", "n") if name in options}
    p, d = pair(model, args, invariant, **options)
    try:
        if warm:
            d.generate_batch([warm], StopRule(1))  # D prefills it once: its full blocks enter D's cache
        return run_disaggregated(p, d, prompts, stop, **recorded)
    finally:
        p.close()


def colocated(model, args, prompts, stop, **options):
    recorded = {name: options.pop(name) for name in ("sampling", "n") if name in options}
    engine = L14Engine(model, **(dict(block_size=args.block_size, num_blocks=args.num_blocks, backend=args.backend,
                                      batch_invariant=True) | options))
    return run_recorded(engine, prompts, stop, **recorded)


def exactness(model, setup, args) -> tuple[bool, str] | None:
    """With L14's mode on every engine: D's logits against a colocated engine's, each prompt alone, bitwise. L14's
    mode runs on the CPU only: on a GPU this check does not apply (None), and the smoke says so."""
    if setup.device.type != "cpu":
        print(f"note: the bitwise check against a colocated engine needs L14's mode, which runs on the CPU, not "
              f"{setup.device.type}: only HF parity is checked", file=sys.stderr)
        return None
    stop = setup.stop
    preamble = setup.tokenizer.encode(PREAMBLE).ids
    prompts = [preamble + p for p in setup.prompt_ids]
    alone = [colocated(model, args, [p], stop).logits[0] for p in prompts]
    lines, ok = [], True

    def check(name: str, run, reference: list[torch.Tensor], note: str = "", happened: bool = True) -> None:
        nonlocal ok
        problems = [(i, d) for i, (a, b) in enumerate(zip(run.logits, reference))
                    if (d := first_difference(a, b)) is not None]
        good = not problems and happened
        ok &= good
        if problems:
            what = f"prompt {problems[0][0]}: {problems[0][1]} ({len(problems)} of {len(reference)} prompts differ)"
        else:
            moved = sum(x.bytes for x in run.loads)
            what = (f"{sum(len(x) for x in run.logits)} positions bitwise equal; D held {sum(x.hits for x in run.loads)}"
                    f" blocks, pulled {sum(x.pulled for x in run.loads)} ({moved:,} bytes){note}")
        lines.append(f"{'PASS' if good else 'FAIL'} {name}: {what}")

    cold = disaggregated(model, args, prompts, stop, True)
    check("D's cache cold at the start (later prompts hit the preamble the first pulled): D = colocated", cold, alone,
          happened=cold.loads[0].pulled > 0 and cold.loads[0].hits == 0)
    warm = disaggregated(model, args, prompts, stop, True, warm=preamble + [0])
    check("D's cache holding the preamble first: D = colocated", warm, alone,
          happened=all(x.hits for x in warm.loads))
    int8_alone = [colocated(model, args, [p], stop, kv_dtype="int8").logits[0] for p in prompts]
    int8 = disaggregated(model, args, prompts, stop, True, kv_dtype="int8")
    check("int8 pages (scales in the rows): D = colocated", int8, int8_alone)

    def seeded(i: int) -> SamplingParams:
        return SamplingParams(temperature=TEMPERATURE, seed=FIRST_SEED + 2 * i)

    two = lambda i: 2  # noqa: E731
    sampled_alone = [colocated(model, args, [p], stop, n=two, sampling=lambda _, i=i: seeded(i))
                     for i, p in enumerate(prompts)]
    siblings = disaggregated(model, args, prompts, stop, True, n=two, sampling=seeded)
    reference = [t for r in sampled_alone for t in r.tokens]
    same = sum(a == b for a, b in zip(siblings.tokens, reference))
    check(f"n = 2 seeded siblings (temperature {TEMPERATURE}): D = colocated", siblings,
          [x for r in sampled_alone for x in r.logits], f"; {same} of {len(reference)} sampled outputs the same tokens")
    ok &= same == len(reference)
    layout = cold.engine.consumer.layout
    return ok, (f"batch-invariant mode on P, D and the colocated engine; each prompt after a {len(preamble)}-token "
                f"preamble; a block of pages is {layout.block_bytes:,} bytes, {layout.block_bytes // args.block_size:,} a "
                f"token:\n  " + "\n  ".join(lines))


def build_engines(model, args):
    def l15(prompts, stop):
        p, d = pair(model, args, invariant=False)
        try:
            return run_disaggregated(p, d, prompts, stop).tokens
        finally:
            p.close()

    def l14(prompts, stop):
        return L14Engine(model, args.block_size, args.num_blocks, backend=args.backend).generate_batch(prompts, stop)

    p, _ = pair(model, args, invariant=False)  # bad options fail here, before any run
    p.close()
    return {"L15": l15, "L14": l14}


if __name__ == "__main__":
    main("L15", parser(), build_engines, exactness)
