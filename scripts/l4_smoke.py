"""L4 smoke: continuous batching. Requests arrive two steps apart and join the running batch; each one's
greedy tokens must equal HF's for that prompt alone, and L3's static batch. With --temperature > 0 it also
checks that each seeded request samples the same tokens alone and in a crowd, or that where it does not,
its logits differed between the two runs and the uniform draw fell across the CDF boundary they moved."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's lessons/ and shared/, not an installed course's
from lessons.l3_block_tensor import L3Engine  # noqa: E402
from lessons.l3_block_tensor.backends import BACKENDS  # noqa: E402
from lessons.l4_continuous import Arrival, L4Engine, SamplingParams  # noqa: E402
from lessons.l4_continuous.engine import DEFAULT_MAX_RUNNING  # noqa: E402
from lessons.l4_continuous.sampling import check_seed, filtered_probs, pick  # noqa: E402
from shared.cli import smoke_parser  # noqa: E402
from shared.smoke import main  # noqa: E402

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
    check_seed(args.seed + i, f"request {i}'s seed (--seed + {i})")  # name which request overflows
    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed + i)


def build_engines(model, args):
    prompts = args.prompt if args.prompt is not None else args.prompt_defaults
    for i in range(len(prompts)):
        sampling_for(args, i)  # bad sampling options fail here, before anything runs
    l4 = L4Engine(model, args.block_size, args.num_blocks, args.max_running, args.backend)
    l3 = L3Engine(model, args.block_size, args.num_blocks, args.backend)
    return {"L4": lambda prompts, stop: l4.generate_batch(prompts, stop, stagger=STAGGER), "L3": l3.generate_batch}


class WatchedRunner:
    """Wraps the engine's runner, changing nothing: keeps each seeded request's logits row by (seed, position)."""

    def __init__(self, runner, rows: dict[tuple[int, int], torch.Tensor]):
        self.runner, self.rows = runner, rows

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def forward(self, batch):
        logits = self.runner.forward(batch)
        for seq, row in zip(batch, logits):
            if seq.sampling.seed is not None:  # the row this request samples its next token, output_ids[pos], from
                self.rows[seq.sampling.seed, len(seq.output_ids)] = row.clone()
        return logits


def uniform_at(seed: int, pos: int, device: torch.device) -> torch.Tensor:
    """The number a request drew for its token `pos`: one draw per token, so it is the (pos + 1)-th."""
    g = torch.Generator(device=device).manual_seed(seed)
    for _ in range(pos + 1):
        u = torch.rand(1, generator=g, device=device)
    return u


def cdf_after(probs: torch.Tensor, ids: torch.Tensor, token: int) -> float:
    """The normalised CDF (token-id order, as the sampler walks it) at the end of `token`'s interval."""
    return float(probs[ids <= token].sum() / probs.sum())


def explain(alone: torch.Tensor, crowd: torch.Tensor, u: torch.Tensor, p: SamplingParams,
            tokens: tuple[int, int]) -> tuple[bool, str]:
    """One position sampled differently alone and in a crowd: a sampling tie, or a real failure."""
    if torch.equal(alone, crowd):
        return False, "the logits were bitwise equal, so the sampler itself is not batch-invariant"
    kept_alone, kept_crowd = filtered_probs(alone, p), filtered_probs(crowd, p)
    probs = kept_alone[0]
    boundaries = (torch.cumsum(probs, dim=-1) / probs.sum())[:-1]  # 0 and 1 never move
    margin = float((boundaries - u.to(boundaries.device)).abs().min()) if boundaries.numel() else float("inf")
    first = min(tokens)  # in token-id order, the boundary after the smaller token is the one u fell across
    moved = abs(cdf_after(*kept_alone, first) - cdf_after(*kept_crowd, first))
    numbers = (f"logits differ by up to {float((alone - crowd).abs().max()):.3g}; u = {float(u):.7f} lies "
               f"{margin:.3g} from the nearest CDF boundary; the boundary after token {first} moved {moved:.3g}")
    replayed = (pick(*kept_alone, u), pick(*kept_crowd, u))
    if replayed != tokens:
        return False, f"{numbers}, yet the two rows with that u sample {replayed}: the draws themselves differed"
    return True, f"NUMERICAL TIE, not a failure ({numbers}, across u)"


def seeded_check(model, setup, args):
    """Each prompt sampled alone, then all of them in a crowd with greedy companions: same tokens, or a
    divergence explained by logits that differ between the two batch shapes (a sampling tie)."""
    if args.temperature == 0:
        return None
    alone_rows: dict[tuple[int, int], torch.Tensor] = {}
    crowd_rows: dict[tuple[int, int], torch.Tensor] = {}
    def engine(rows):
        l4 = L4Engine(model, args.block_size, args.num_blocks, args.max_running, args.backend)
        l4.runner = WatchedRunner(l4.runner, rows)
        return l4
    prompts, stop = setup.prompt_ids, setup.stop
    alone = [engine(alone_rows).run([Arrival(p, stop, sampling_for(args, i))])[0] for i, p in enumerate(prompts)]
    crowd = [Arrival(p, stop, sampling_for(args, i), STAGGER * i) for i, p in enumerate(prompts)]
    crowd += [Arrival(p, stop, SamplingParams(), 1 + STAGGER * i) for i, p in enumerate(prompts)]  # companions
    together = engine(crowd_rows).run(crowd)[: len(prompts)]
    what = f"seeded sampling (temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}, seed {args.seed})"
    ties = []
    for i, (a, b) in enumerate(zip(alone, together)):
        if a == b:
            continue
        pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        where = f"request {i} differs at position {pos}: alone {a[pos:pos + 1]}, in a crowd {b[pos:pos + 1]}"
        if pos == min(len(a), len(b)):  # same tokens, different lengths: nothing was sampled differently
            return False, f"{what}: {where}"
        key = (args.seed + i, pos)
        tie, why = explain(alone_rows[key], crowd_rows[key], uniform_at(*key, model.lm_head.weight.device),
                           sampling_for(args, i), (a[pos], b[pos]))
        if not tie:
            return False, f"{what}: {where}; {why}"
        ties.append(f"{where}; {why}")
    if ties:
        return True, f"{what}: " + " | ".join(ties)
    gap = max(float((alone_rows[k] - crowd_rows[k]).abs().max()) for k in alone_rows)
    return True, (f"{what}: {len(prompts)} request(s) identical alone and in a crowd of {len(crowd)} "
                  f"(their logits differed by up to {gap:.3g} between the two runs)")


if __name__ == "__main__":
    main("L4", parser(), build_engines, seeded_check)
