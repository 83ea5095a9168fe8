"""L8 smoke: chunked prefill. Four short requests start decoding; at step 4 a long prompt arrives, and the
token budget (--max-batched-tokens) cuts it into slices that share each step with the short requests'
decodes. Every request's greedy tokens must equal HF's for that prompt alone, and L7's (which prefills the
long prompt whole, in one step). The report gives the slices each request's prompt took, and the longest
wait between two tokens of a short request: with chunking, and on L7 without it, in tokens computed by
the step it waited for and in seconds."""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's lessons/ and shared/, not an installed course's
from lessons.l3_block_tensor.backends import BACKENDS  # noqa: E402
from lessons.l4_continuous.engine import DEFAULT_MAX_RUNNING, Arrival  # noqa: E402
from lessons.l7_cuda_graphs import L7Engine  # noqa: E402
from lessons.l8_chunked_prefill import L8Engine  # noqa: E402
from lessons.l8_chunked_prefill.scheduler import DEFAULT_MAX_BATCHED_TOKENS  # noqa: E402
from shared.cli import smoke_parser  # noqa: E402
from shared.smoke import main  # noqa: E402

LONG = ("The night ferry leaves the harbour at ten, and the crossing takes most of the dark hours. Passengers "
        "who have made it before bring a blanket, a flask of tea and a book they do not mind losing to the "
        "spray. The engine room sits under the car deck, so the floor hums the whole way, and children fall "
        "asleep to it faster than to any song. Halfway across, the lights of the mainland vanish behind the "
        "swell before the island lighthouse shows itself, and for twenty minutes the only thing to look at "
        "is the wake, white against black water. The crew serve soup at midnight from a counter beside the "
        "stairs; the queue forms long before the shutter goes up. At dawn the gulls find the boat first, then "
        "the smell of seaweed and diesel reaches the deck, and the harbour master waves the ferry in with two "
        "orange paddles, as he has done every morning for thirty years. Tell me what happens next:")
SHORT = ["The capital of France is", "Hello, world!", "def fibonacci(n):", "Why is the sky blue?"]
DEFAULT_PROMPTS = [*SHORT, LONG, "1, 2, 3, 4,"]
LONG_ARRIVES = 4  # the short requests have been decoding for three steps when the long prompt comes


def arrival_step(i: int) -> int:
    return 0 if i < len(SHORT) else LONG_ARRIVES


def parser():
    p = smoke_parser("L8", __doc__, blocks=True, default_prompts=DEFAULT_PROMPTS)
    p.add_argument("--max-batched-tokens", type=int, default=DEFAULT_MAX_BATCHED_TOKENS,
                   help=f"the token budget of one step, decodes included (default: {DEFAULT_MAX_BATCHED_TOKENS})")
    p.add_argument("--max-slice-tokens", type=int, help="most prompt tokens one request computes in a step (default: no cap)")
    p.add_argument("--max-long-prefills", type=int,
                   help="most long prompts part-way through at once; shorter ones pass the rest (default: no limit; "
                        "needs --long-prefill-threshold)")
    p.add_argument("--long-prefill-threshold", type=int,
                   help="a prompt with more tokens than this still to compute is long; no slice is longer")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="attention kernels (as in L3)")
    p.add_argument("--max-running", type=int, default=DEFAULT_MAX_RUNNING, help="most requests in one step")
    p.add_argument("--graphs", default="on", choices=("on", "off"), help="off: every step eager")
    return p


class StepWatch:
    """Wraps an engine's runner: per step, the tokens it computed and its seconds; per request, the step of
    each new token. Works on L7 and L8 alike, so both are measured the same way."""

    def __init__(self, engine):
        self.engine, self.steps = engine, []  # (tokens computed, seconds)
        self.fed: int | None = None  # tokens the current step's forward computed (None: no forward yet)
        self.token_steps: dict[int, list[int]] = {}  # seq_id -> index into steps of each token
        forward = engine.runner.forward

        def timed(requests):
            t0 = time.perf_counter()
            out = forward(requests)
            self.steps.append((self.fed, time.perf_counter() - t0))
            return out

        step = engine.step

        def watched():
            self.fed = None
            before = {s.seq_id: len(s.output_ids) for s in engine.scheduler.running}
            finished = step()
            if self.fed is not None:
                for s in list(engine.scheduler.running) + finished:
                    if len(s.output_ids) > before.get(s.seq_id, 0):
                        self.token_steps.setdefault(s.seq_id, []).append(len(self.steps) - 1)
            return finished

        def counted(requests):
            self.fed = sum(r.num_tokens - r.num_cached for r in requests)
            return timed(requests)

        engine.runner.forward, engine.step = counted, watched

    def longest_wait(self, seq_ids) -> tuple[int, float]:
        """Over the given requests' consecutive tokens: the most tokens one step between them computed, and
        the longest time between them."""
        tokens, seconds = 0, 0.0
        for sid in seq_ids:
            marks = self.token_steps.get(sid, [])
            for a, b in zip(marks, marks[1:]):
                tokens = max(tokens, max(self.steps[i][0] for i in range(a + 1, b + 1)))
                seconds = max(seconds, sum(self.steps[i][1] for i in range(a + 1, b + 1)))
        return tokens, seconds


def build_engines(model, args):
    def workload(prompts, stop):
        return [Arrival(p, stop, step=arrival_step(i)) for i, p in enumerate(prompts)]

    def l8_engine():
        return L8Engine(model, args.block_size, args.num_blocks, args.max_running, args.backend,
                        graphs=args.graphs == "on", max_batched_tokens=args.max_batched_tokens,
                        max_slice_tokens=args.max_slice_tokens, max_long_prefills=args.max_long_prefills,
                        long_prefill_threshold=args.long_prefill_threshold)

    def l8(prompts, stop):
        args.l8 = l8_engine()
        args.l8_watch = StepWatch(args.l8)
        return args.l8.run(workload(prompts, stop))

    def l7(prompts, stop):
        args.l7 = L7Engine(model, args.block_size, args.num_blocks, args.max_running, args.backend,
                           graphs=args.graphs == "on")
        args.l7_watch = StepWatch(args.l7)
        return args.l7.run(workload(prompts, stop))

    l8_engine()  # bad options (a budget below 1) fail here, before any run
    return {"L8": l8, "L7": l7}


def chunk_report(model, setup, args):
    eng = args.l8
    budget = args.max_batched_tokens
    short = [i for i, ids in enumerate(setup.prompt_ids) if len(ids) <= budget]
    slices = ", ".join(f"{i}: {eng.prompt_slices.get(i, 0)}" for i in range(len(setup.prompt_ids)))
    leak = eng.allocator.num_free != eng.usable_blocks
    over = max(eng.step_tokens) > budget
    chunked, whole = args.l8_watch.longest_wait(short), args.l7_watch.longest_wait(short)
    split = any(eng.prompt_slices.get(i, 0) > 1 for i in range(len(setup.prompt_ids)))
    ok = not leak and not over and (split or args.prompt is not None)
    line = (f"L8 (budget {budget} tokens/step): prompt slices per request {{{slices}}}; largest step "
            f"{max(eng.step_tokens)} tokens{' (OVER BUDGET)' if over else ''}; {eng.allocator.num_free} of "
            f"{eng.usable_blocks} usable blocks free or cached at the end{' (LEAK)' if leak else ''}\n"
            f"  longest wait between two tokens of a short request (prompt <= budget, {len(short)} of them): a "
            f"step of {chunked[0]} tokens here, {whole[0]} on L7 (whole prompts); "
            f"{chunked[1] * 1e3:.1f} ms here, {whole[1] * 1e3:.1f} ms on L7")
    return ok, line


if __name__ == "__main__":
    main("L8", parser(), build_engines, chunk_report)
