"""See the pool: run a lesson's engine on a small workload (or read a trace) and write one self-contained page.

    python scripts/pool_viewer.py                              # L6 on the embedded model -> pool.html
    python scripts/pool_viewer.py --lesson l5 --policy swap    # preemption by swapping to host memory
    python scripts/pool_viewer.py --lesson l11 --out spec.html # speculative decoding: drafts kept, rolled back
    python scripts/pool_viewer.py --trace run.jsonl            # a trace a smoke or serve.py wrote (--trace)
    python scripts/pool_viewer.py --lesson l15                 # disaggregation: P's and D's pools side by side
    python scripts/pool_viewer.py --trace p.jsonl --trace d.jsonl  # two traces (L15's servers' --trace), two pools

Open the page from disk: no server, no network. It shows the pool as a grid of blocks coloured by the
request holding them (a shared block carries its reference count), each request's block table, the prefix
cache, and each step's events in words; a slider and play walk through the steps. The page draws what
shared/pool_replay.py rebuilt from the trace, and tests/test_pool_trace.py checks that replay against the
engine after every step.

The workload: --requests requests share a system prompt (so from L6 on later ones hit the prefix cache),
arrive --stagger steps apart, the fourth with a long prompt (from L8 on it is prefilled in slices), and one is
sampled n = 2 ways (from L6 on: a fork and its copy-on-write); from L9 on one is aborted; L11's drafts come
from the target's own continuation with some made wrong, so some are kept and some rolled back. The pool is
small enough that L5 on has to preempt.

L15 runs two engines in this process, a prefill engine P and a decode engine D, each with --num-blocks blocks, in
pair.py's flow, one request at a time at its arrival step on D's clock: P prefills it (one token) and leases its
full blocks; D takes blocks for the pull, steps once while the pages would travel (its server's split: start,
pull on another thread, finish), then pulls the blocks its prefix cache lacks over the loopback socket, files
them there and admits the request, which hits them. The later requests share the first's system prompt, so D
pulls only their own blocks: it hits what it pulled before. P frees each lease D released when it steps for the
next request. The page shows both pools side by side, each page whole with its own slider, and one slider above
both that steps them together in the order things happened; the leases and pulls are in each pool's words and
in its "Leases and pulls" (the blocks: amber for a lease, teal for a pull in flight). On D's 20 blocks a pulled
request that waits for room can lose its pulled blocks to eviction and compute them again: the page shows that
too. Several --trace files are drawn side by side the same way (stepped together when every record carries a
time: pool_trace.py stamps L15's, so two servers' --trace files step together in wall-clock order).
"""
from __future__ import annotations

import itertools
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from shared.cli import OneLineParser, resolve_model_dir  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.pool_page import page_data, render, render_panes  # noqa: E402
from shared.pool_replay import ReplayError  # noqa: E402
from shared.pool_trace import read_trace, record_engine  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

LESSONS = ("l2", "l3", "l4", "l5", "l6", "l7", "l8", "l9", "l11", "l12", "l13", "l14", "l15")  # L10: a smoke's --trace
PAIRED = ("l15",)  # two engines (prefill and decode), two traces, one page with both pools


def parser() -> OneLineParser:
    p = OneLineParser(prog="pool_viewer.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--lesson", default="l6", help=f"whose engine runs: {', '.join(LESSONS)} (default: l6)")
    p.add_argument("--trace", action="append", help="read this trace (JSON lines) instead of running a workload; "
                   "give it again for pools side by side (L15: P's trace, then D's)")
    p.add_argument("--save-trace", action="append", help="also write the run's trace here (--lesson l15: twice, "
                   "P's trace then D's)")
    p.add_argument("--out", default="pool.html", help="the page to write (default: pool.html)")
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--num-blocks", type=int, default=20)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--stagger", type=int, default=2, help="steps between arrivals (default: 2)")
    p.add_argument("--policy", default="recompute", help="L5's preemption policy: recompute | swap")
    p.add_argument("--seed", type=int, default=0, help="the workload's prompts and lengths")
    p.add_argument("--model", help="a checkpoint directory or a named model such as smollm2 (default: embedded)")
    return p


def workload(vocab: int, args) -> list[tuple[list[int], StopRule]]:
    rng = random.Random(args.seed)
    top = min(vocab, 100000)
    system = [rng.randrange(1000, top) for _ in range(3 * args.block_size + 1)]
    work = [(system + [rng.randrange(1000, top) for _ in range(rng.randint(2, 9))], StopRule(rng.randint(6, 14)))
            for _ in range(args.requests)]
    if len(work) > 3:  # one long prompt: from L8 on it is prefilled in slices beside the others' decodes
        prompt, stop = work[3]
        work[3] = (prompt + [rng.randrange(1000, top) for _ in range(5 * args.block_size)], stop)
    return work


def build(lesson: str, model, args):
    """The lesson's engine, set up to show its idea on this workload (L8 on: a 16-token budget, so long prompts
    are sliced; L11 on: drafts replayed from the target's own continuation, about 30% of them wrong)."""
    S, N = args.block_size, args.num_blocks
    if lesson in PAIRED:
        raise CourseError(f"--lesson {lesson} runs two engines: build_pair and record_pair run it")
    if lesson == "l2":
        from lessons.l2_token_flat import L2Engine
        return L2Engine(model, S, N)
    if lesson == "l3":
        from lessons.l3_block_tensor import L3Engine
        return L3Engine(model, S, N, backend="torch")
    if lesson == "l4":
        from lessons.l4_continuous import L4Engine
        return L4Engine(model, S, N, backend="torch")
    if lesson == "l5":
        from lessons.l5_preemption import L5Engine
        return L5Engine(model, S, N, backend="torch", policy=args.policy)
    if lesson == "l6":
        from lessons.l6_prefix_sharing import L6Engine
        return L6Engine(model, S, N, backend="torch")
    if lesson == "l7":
        from lessons.l7_cuda_graphs import L7Engine
        return L7Engine(model, S, N, backend="torch", graphs=False)
    budget = dict(max_batched_tokens=16)  # a prompt longer than the budget is prefilled in slices
    if lesson == "l8":
        from lessons.l8_chunked_prefill import L8Engine
        return L8Engine(model, S, N, backend="torch", graphs=False, **budget)
    if lesson == "l9":
        from lessons.l9_server.engine import L9Engine
        return L9Engine(model, S, N, backend="torch", graphs=False, **budget)
    from lessons.l11_speculative.replay import ReplayDrafter, wrong_with_rate
    from lessons.l9_server.engine import L9Engine
    plain = L9Engine(model, S, 256, backend="torch", graphs=False)  # what the target says: the drafts replay it
    work = workload(model.config.vocab_size, args)
    expected = {tuple(p): out for (p, _), out in
                zip(work, plain.generate_batch([p for p, _ in work], StopRule(max(s.max_new_tokens for _, s in work))))}
    spec = dict(drafter=ReplayDrafter(expected, model.config.vocab_size, wrong_with_rate(0.3, args.seed)),
                num_speculative_tokens=3, **budget)
    if lesson == "l11":
        from lessons.l11_speculative import L11Engine
        return L11Engine(model, S, N, backend="torch", graphs=False, **spec)
    if lesson == "l12":
        from lessons.l12_kv_quant import L12Engine
        return L12Engine(model, S, N, backend="torch", graphs=False, kv_dtype="int8", **spec)
    if lesson == "l13":
        from lessons.l13_structured import L13Engine
        return L13Engine(model, S, N, backend="torch", graphs=False, **spec)
    from lessons.l14_batch_invariant import L14Engine
    return L14Engine(model, S, N, graphs=False, **spec)


def run(engine, lesson: str, work: list[tuple[list[int], StopRule]], args) -> None:
    """Each request at its arrival step; one sampled n = 2 ways (L6 on), one aborted mid-run (L9 on)."""
    from lessons.l4_continuous.sampling import SamplingParams

    if lesson == "l2":
        for prompt, stop in work:
            engine.generate(prompt, stop)
        return
    if lesson == "l3":  # a static batch: all of it must fit at its longest, so two of the requests
        engine.generate_batch([p for p, _ in work[:2]], StopRule(max(s.max_new_tokens for _, s in work[:2])))
        return
    forks = lesson not in ("l4", "l5")
    aborts = hasattr(engine, "abort")
    k, victim = 0, None
    while k < len(work) or engine.scheduler.has_work():
        while k < len(work) and args.stagger * k <= engine.clock:
            prompt, stop = work[k]
            if forks and k == 1:
                engine.add_parallel(prompt, stop, SamplingParams(0.8, seed=args.seed), 2)
            else:
                seq = engine.add_request(prompt, stop)
                if aborts and k == len(work) - 1:
                    victim = seq
            k += 1
        if not engine.scheduler.has_work():
            engine.clock += 1
            continue
        engine.step()
        if victim is not None and victim.output_ids and len(victim.output_ids) >= 2:
            engine.abort([victim])  # a client hanging up mid-stream
            victim = None


def build_pair(model, args):
    """L15's prefill engine P and decode engine D, each a pool of --num-blocks blocks."""
    from lessons.l15_disaggregated import L15Engine

    S, N = args.block_size, args.num_blocks
    return (L15Engine(model, S, N, graphs=False, kv_role="kv_producer"),
            L15Engine(model, S, N, graphs=False, kv_role="kv_consumer"))


def run_pair(prefill, decode, work: list[tuple[list[int], StopRule]], args, settle_s: float = 5.0) -> None:
    """pair.py's flow, one request at a time at its arrival step on D's clock, with D's load in its server's three
    calls so that the page shows a pull in flight: P prefills the request (one token) and leases its blocks; D
    takes blocks for the pull (consumer.start), steps once while the pages would travel, then pulls, files them
    and admits the request, which hits them; one request is sampled n = 2 ways (D forks from the hit). A pull D has
    no room for waits for D's next step (its server answers 503 and the client retries). P frees released leases
    as it steps for the next request (L15Engine.step), and at the end steps once more and waits (at most
    settle_s) for the last releases."""
    from lessons.l4_continuous.sampling import SamplingParams
    from lessons.l15_disaggregated.connector import NoRoom
    from lessons.l15_disaggregated.pair import prefill_remote

    k, params, pulling = 0, None, None
    while k < len(work) or decode.scheduler.has_work() or pulling:
        if pulling is None and k < len(work) and args.stagger * k <= decode.clock:
            prompt, stop = work[k]
            params = params or prefill_remote(prefill, [prompt], stop)[0]
            try:
                pulling = (work[k], decode.consumer.start(prompt, params))
                k, params = k + 1, None
            except NoRoom:
                if not decode.scheduler.has_work():
                    raise
        if pulling is None and not decode.scheduler.has_work():
            decode.clock += 1  # idle until the next arrival
            continue
        decode.step()  # with a pull in flight: its blocks are held by no table, not yet in D's prefix cache
        if pulling is not None:
            (prompt, stop), pending = pulling
            decode.consumer.pull(pending)  # a server does this on a worker thread while its engine steps
            decode.consumer.finish(pending)
            sampling, n = (SamplingParams(0.8, seed=args.seed), 2) if k == 2 else (SamplingParams(), 1)
            decode.add_parallel(prompt, stop, sampling, n)
            pulling = None
    prefill.step()  # as if P had a next request: it frees the last lease D released (a record after the lease's)
    deadline = time.monotonic() + settle_s
    while len(prefill.producer.leases) and time.monotonic() < deadline:  # a release not in yet: P's server thread
        time.sleep(0.01)
        prefill.producer.reap()


def record_pair(model, args, paths: list[str]) -> None:
    """Run L15's workload with P recorded into paths[0], D into paths[1]. Both recorders take one counter as their
    stamp: the records interleave exactly as they happened, and the page steps both pools in that order."""
    prefill, decode = build_pair(model, args)
    stamp = itertools.count().__next__
    try:
        with record_engine(prefill, paths[0], "l15", stamp), record_engine(decode, paths[1], "l15", stamp):
            run_pair(prefill, decode, workload(model.config.vocab_size, args), args)
    finally:
        prefill.close()


def token_pieces(trace: list[dict], model_dir: Path) -> dict[int, str]:
    """The text of every token id the trace holds, for the page's hover (empty when there is no tokenizer)."""
    from shared.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(model_dir)
    except Exception:  # a checkpoint without a tokenizer: the page shows ids only
        return {}
    ids = {t for r in trace[1:] for s in r["seqs"].values() for t in s["ids"]}
    return {t: tok.decode([t]) for t in sorted(ids)}


def main() -> None:
    p = parser()
    args = p.parse_args()
    lesson = args.lesson.lower()
    given, saves = args.trace or [], args.save_trace or []
    if not given and lesson == "l10":
        p.error("--lesson l10 runs over several processes: record it with python scripts/l10_smoke.py --trace FILE, "
                "then pass --trace FILE here")
    if not given and lesson not in LESSONS:
        p.error(f"--lesson {args.lesson}: use one of {', '.join(LESSONS)} (L1 has no blocks)")
    if not given and lesson in PAIRED and len(saves) not in (0, 2):
        p.error(f"--save-trace: --lesson {lesson} records two engines: give it twice (P's trace, then D's), "
                f"not {len(saves)} time(s)")
    if not given and lesson not in PAIRED and len(saves) > 1:
        p.error(f"--save-trace: --lesson {lesson} records one engine: give it once, not {len(saves)} times")
    if args.policy not in ("recompute", "swap") or (args.policy == "swap" and lesson != "l5"):
        p.error(f"--policy {args.policy}: use recompute, or swap with --lesson l5 (L6 on refuse swap)")
    for name in ("requests", "num_blocks", "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.stagger < 0:
        p.error(f"--stagger must be at least 0, got {args.stagger}")
    try:
        model_dir = resolve_model_dir(args.model, default_model_dir)
        if given:
            names, traces = [f"--trace {path}" for path in given], [load_trace(path) for path in given]
        else:
            from shared.model import Qwen3ForCausalLM
            model = Qwen3ForCausalLM.from_dir(model_dir, torch.float32, torch.device("cpu"))
            out = Path(args.out)
            paths = saves or ([str(out.with_suffix(f".{role}.jsonl")) for role in ("prefill", "decode")]
                              if lesson in PAIRED else [str(out.with_suffix(".jsonl"))])
            try:
                if lesson in PAIRED:
                    record_pair(model, args, paths)
                else:
                    engine = build(lesson, model, args)
                    with record_engine(engine, paths[0], lesson):
                        run(engine, lesson, workload(model.config.vocab_size, args), args)
                names, traces = ["the run's trace"] * len(paths), [read_trace(path) for path in paths]
            finally:
                for path in paths if not saves else []:  # ours, not asked for: gone, even after an error
                    Path(path).unlink(missing_ok=True)
        pages = []
        for name, trace in zip(names, traces):
            try:
                pages.append(page_data(trace, pieces=token_pieces(trace, model_dir)))
            except (ReplayError, KeyError, TypeError, IndexError) as e:  # a trace cut short, edited or not a trace
                raise CourseError(f"{name}: not a pool trace this replay can follow ({type(e).__name__}: "
                                  f"{e})") from None
    except CourseError as e:
        p.error(str(e))
    Path(args.out).write_text(render(pages[0]) if len(pages) == 1 else render_panes(pages))
    said = [f"{d['title']}, {len(d['frames']) - 1} records, {d['num_blocks']} blocks of {d['block_size']}, "
            f"{len(d['seqs'])} requests" for d in pages]
    together = all("at" in f for d in pages for f in d["frames"])
    side = "" if len(pages) == 1 else f" (side by side{', stepping together in wall order' if together else ''})"
    print(f"{args.out}: {' | '.join(said)}{side}; open it in a browser (no server needed)")


def load_trace(path: str) -> list[dict]:
    try:
        trace = read_trace(path)
    except (OSError, ValueError) as e:
        raise CourseError(f"--trace {path}: {e}") from None
    if not trace or trace[0].get("kind") != "header":
        raise CourseError(f"--trace {path}: not a pool trace (its first line is no header)")
    return trace


if __name__ == "__main__":
    main()
