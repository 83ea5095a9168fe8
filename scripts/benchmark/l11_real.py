"""L11 on a trained model: where speculation pays, on chats that copy from their prompt and on free chat.

    OMP_NUM_THREADS=1 python scripts/benchmark/l11_real.py [--model smollm2] [--batches 1,4,16]
        [--draft-layers 8] [--early-exit-everywhere] [--k 4] [--max-new-tokens 96] [--rounds 1] [--prompts copy,chat]
        [--json PATH]

Two sets of 16 chat requests (the checkpoint's own template), greedy, EOS honoured:
- copy: tasks whose answer copies the prompt -- correct the spelling of a paragraph, put one in the past
  tense, summarise one quoting its words, add type hints to a Python function (4 paragraphs, 4 functions);
- chat: 16 free questions (facts, advice, a short story).
Per set and batch B, the 16 requests all arrive at once and at most B run together (batch 1 runs them one
after another), so every batch size computes the same tokens. Systems: L11's engine without a drafter
(exactly L9's), the n-gram drafter (prompt lookup), and an early-exit draft (the model's first
--draft-layers layers; early_exit.py; at batch 1 only unless --early-exit-everywhere). In a round every system has a fresh engine and they take turns a step
at a time (one pass forward, the next backward), so a box that grows busier slows them alike. Only decode
steps are timed (a step in which no request gets its first token), so the ratio is decode throughput's.
Every system's outputs must equal the plain engine's, else the benchmark stops (exit status 1).

Reported per (set, batch, system): decode tokens/s, the speed-up over the plain engine in the same round
(decode throughput's ratio, median over rounds), acceptance (accepted / drafted), mean accepted length (tokens per verify row), and for
each drafter the acceptance at each draft position (of the proposals that reached position j, how many
were accepted there). Target (issue 41): >= 1.8x at batch 1 on the copy set with the n-gram drafter.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the conditions line's harness

import harness  # noqa: E402
from lessons.l11_speculative import L11Engine  # noqa: E402
from lessons.l11_speculative.draft_model import DraftModelDrafter  # noqa: E402
from lessons.l11_speculative.early_exit import early_exit  # noqa: E402
from lessons.l11_speculative.ngram import NgramDrafter  # noqa: E402
from shared.cli import OneLineParser  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402

BLOCK = 16
LENS_LAYERS = (4, 8, 12, 16, 20, 24, 26, 28, 29)
TARGET = {"speedup": 1.8, "set": "copy", "system": "ngram", "batch": 1}

PARAGRAPHS = [
    "The library opens at nine in the morning and closes at six in the evening. On Saturdays it closes at one. "
    "Books can be borrowed for three weeks and renewed twice, online or at the front desk. Late returns cost ten "
    "cents a day, and lost cards are replaced for free.",
    "Heat the oven to two hundred degrees. Mix the flour, the sugar and a pinch of salt in a large bowl. Add the "
    "butter in small pieces and rub it in until the mixture looks like breadcrumbs. Stir in the milk, shape the "
    "dough into a round and bake it for twenty minutes.",
    "The train to the coast leaves from platform four every hour. The journey takes ninety minutes and stops at "
    "five stations. Tickets bought on the day cost more than tickets bought online, and bicycles travel free "
    "outside the morning rush.",
    "Our team meets every Monday to plan the week. Each person says what they finished, what they will do next "
    "and what is blocking them. The meeting lasts fifteen minutes, and the notes are posted in the shared folder "
    "afterwards.",
]
FUNCTIONS = [
    "def average(values):\n    total = 0\n    for value in values:\n        total += value\n    return total / len(values)",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n        counts[word] = counts.get(word, 0) + 1\n"
    "    return counts",
    "def clamp(value, low, high):\n    if value < low:\n        return low\n    if value > high:\n        return high\n"
    "    return value",
    "def read_lines(path):\n    with open(path) as f:\n        lines = [line.strip() for line in f]\n"
    "    return [line for line in lines if line]",
]
QUESTIONS = [
    "What is the capital of France? Answer in one sentence.", "Give me three tips for sleeping better.",
    "Why is the sky blue?", "Write a short poem about the sea.", "What does a bicycle's gear do?",
    "How do I boil an egg?", "Name three planets and say one thing about each.", "What is photosynthesis?",
    "Tell me a very short story about a cat and a key.", "How can I learn a new language faster?",
    "What is the difference between weather and climate?", "Suggest a name for a small bakery and explain it.",
    "Why do we have seasons?", "What should I pack for a weekend hike?", "Explain what a computer's memory does.",
    "Give me two ideas for a rainy afternoon.",
]


def misspell(text: str) -> str:
    """Every fourth word of five letters or more gets its second and third letters swapped: typos to correct."""
    words = text.split(" ")
    long = [i for i, w in enumerate(words) if len(w.strip(".,")) >= 5 and w.strip(".,").isalpha()]
    for i in long[1::4]:
        w = words[i]
        words[i] = w[0] + w[2] + w[1] + w[3:]
    return " ".join(words)


def copy_tasks() -> list[str]:
    out = []
    for p, f in zip(PARAGRAPHS, FUNCTIONS):
        out += [f"Correct the spelling mistakes in this paragraph and write out the whole corrected paragraph:\n\n"
                f"{misspell(p)}",
                f"Rewrite this paragraph in the past tense, changing nothing else:\n\n{p}",
                f"Summarise this paragraph in two sentences, quoting its exact words:\n\n{p}",
                f"Add type hints to this Python function and return the whole function:\n\n```python\n{f}\n```"]
    return out


PROMPT_SETS = {"copy": copy_tasks, "chat": lambda: list(QUESTIONS)}


def ints(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"integers of at least 1, got {text!r}")
    return values


def prompt_sets(text: str) -> list[str]:
    chosen = [v.strip() for v in text.split(",") if v.strip()]
    if not chosen or any(v not in PROMPT_SETS for v in chosen):
        raise argparse.ArgumentTypeError(f"prompt sets are {', '.join(PROMPT_SETS)}, got {text!r}")
    return chosen


class Run:
    """One engine running every request to the end, a step at a time; decode steps timed."""

    def __init__(self, model: Qwen3ForCausalLM, prompts: list[list[int]], batch: int, drafter, args):
        longest = max(map(len, prompts)) + args.max_new_tokens + args.k + 1
        # A budget that prefills the first B prompts in one step: the decode steps after it hold all B.
        budget = sum(sorted(map(len, prompts))[-batch:]) + batch * (args.k + 1)
        self.engine = L11Engine(model, BLOCK, num_blocks=batch * -(-longest // BLOCK) + 1, max_running=batch,
                                graphs=True, max_batched_tokens=budget,
                                drafter=drafter, num_speculative_tokens=args.k)
        stop = StopRule(args.max_new_tokens, frozenset(model.config.eos_token_ids))
        self.seqs = [self.engine.add_request(p, stop) for p in prompts]
        self.decode_s, self.decode_tokens = 0.0, 0

    @property
    def busy(self) -> bool:
        return self.engine.scheduler.has_work()

    def step(self) -> None:
        started = sum(bool(s.output_ids) for s in self.seqs)
        before = sum(len(s.output_ids) for s in self.seqs)
        t0 = time.perf_counter()
        self.engine.step()
        seconds = time.perf_counter() - t0
        if sum(bool(s.output_ids) for s in self.seqs) == started:  # nobody's first token: a decode step
            self.decode_s += seconds
            self.decode_tokens += sum(len(s.output_ids) for s in self.seqs) - before


def drafter_for(name: str, model: Qwen3ForCausalLM, args):
    if name == "ngram":
        return NgramDrafter()
    if name.startswith("early exit"):
        return DraftModelDrafter(early_exit(model, args.draft_layers))
    return None


def measure(model: Qwen3ForCausalLM, prompts: list[list[int]], batch: int, args) -> list[dict]:
    """Every system at one batch size over --rounds rounds; parity against the plain engine on every run."""
    # The early exit's acceptance is the same at every batch and its draft forwards only cost more with more rows:
    # it runs where it has its best chance, batch 1 (every batch with --early-exit-everywhere).
    names = ["none", "ngram"] + ([f"early exit {args.draft_layers}"] if batch == 1 or args.early_exit_everywhere else [])
    got: dict[str, list[Run]] = {n: [] for n in names}
    for _ in range(args.rounds):
        runs = {n: Run(model, prompts, batch, drafter_for(n, model, args), args) for n in names}
        gc.collect()
        forward = True
        while any(r.busy for r in runs.values()):
            for n in (names if forward else names[::-1]):
                if runs[n].busy:
                    runs[n].step()
            forward = not forward
        for n in names:
            got[n].append(runs[n])
    reference = [list(s.output_ids) for s in got["none"][0].seqs]
    rows = []
    for n in names:
        for run in got[n]:
            outs = [list(s.output_ids) for s in run.seqs]
            if outs != reference:
                bad = next(i for i, (a, b) in enumerate(zip(outs, reference)) if a != b)
                raise RuntimeError(f"parity broken: batch {batch}, {n}, request {bad} differs from the plain engine's")
        spec = [r.engine.spec for r in got[n]]
        # Throughput's ratio: which steps count as decode-only differs a little between systems.
        ratios = [(r.decode_tokens / r.decode_s) / (b.decode_tokens / b.decode_s) for b, r in zip(got["none"], got[n])]
        drafted, accepted = sum(s.drafted for s in spec), sum(s.accepted for s in spec)
        verify_rows = sum(s.verify_rows for s in spec)
        at = [sum(s.accepted_at[j] if j < len(s.accepted_at) else 0 for s in spec) for j in range(args.k)]
        reached = [verify_rows] + at[:-1]  # a proposal reaches position j+1 only if draft j was accepted
        rows.append({
            "batch": batch, "system": n, "decode_tokens": got[n][0].decode_tokens,
            "tokens_per_s": harness.percentiles([r.decode_tokens / r.decode_s for r in got[n]], (50,))["p50"],
            "speedup": harness.percentiles(ratios, (50,))["p50"], "speedup_rounds": ratios,
            "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else None,
            "mean_accepted_length": 1 + accepted / verify_rows if verify_rows else None,
            "accepted_at_position": [a / r if r else None for a, r in zip(at, reached)]})
    return rows


def layer_agreement(model_dir: Path, prompts: list[list[int]], outputs: list[list[int]]) -> dict[int, float]:
    """Per exit depth L: how often the first L layers (then the final norm and LM head) pick the token the whole
    model picked, teacher-forced over every output position. An early-exit draft computes exactly those layers'
    K/V, so this is its acceptance at draft position 1. HF's model, so the lens is the oracle's own."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    depth = hf.config.num_hidden_layers
    hits, total = {layer: 0 for layer in range(1, depth + 1)}, 0
    with torch.inference_mode():
        for prompt, out in zip(prompts, outputs):
            ids = torch.tensor([prompt + out])
            states = hf(ids, output_hidden_states=True).hidden_states  # [0] embeddings .. [depth] normed final
            rows = slice(len(prompt) - 1, len(prompt) + len(out) - 1)  # the rows that predicted each output token
            want = torch.tensor(out)
            for layer in hits:
                h = states[layer][0, rows]
                h = h if layer == depth else hf.model.norm(h)
                hits[layer] += int((hf.lm_head(h).argmax(-1) == want).sum())
            total += len(out)
    return {layer: n / total for layer, n in hits.items()}


def parser() -> OneLineParser:
    p = OneLineParser(prog="l11_real.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a checkpoint directory or a named model (default: smollm2)")
    p.add_argument("--batches", type=ints, default=[1, 4, 16], help="most requests running at once (default 1,4,16)")
    p.add_argument("--prompts", type=prompt_sets, default=list(PROMPT_SETS), help="copy, chat or both (default)")
    p.add_argument("--draft-layers", type=int, default=8, help="the early-exit draft's layers (default 8)")
    p.add_argument("--early-exit-everywhere", action="store_true", help="the early exit at every batch (default: 1)")
    p.add_argument("--k", type=int, default=4, help="drafts per step, K (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="per request (default 96)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of every system (default 1)")
    p.add_argument("--json", help="write the rows here")
    return p


def main() -> int:
    p = parser()
    args = p.parse_args()
    if min(args.k, args.max_new_tokens, args.rounds) < 1:
        p.error(f"--k, --max-new-tokens and --rounds must be at least 1, got {args.k}, {args.max_new_tokens}, "
                f"{args.rounds}")
    console = Console(highlight=False, soft_wrap=True)
    try:
        model_dir, template = harness.chat_checkpoint(args.model)
        model = Qwen3ForCausalLM.from_dir(model_dir, torch.float32, torch.device("cpu"))
        early_exit(model, args.draft_layers)  # a bad --draft-layers fails here, in one line
    except CourseError as e:
        p.error(str(e))
    conditions = harness.start("cpu", torch.float32)
    tokenizer = load_tokenizer(model_dir)
    rows, lens_rows = [], []
    for name in args.prompts:
        chats = [template.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                              add_generation_prompt=True) for c in PROMPT_SETS[name]()]
        prompts = [tokenizer.encode(c).ids for c in chats]
        for batch in args.batches:
            got = measure(model, prompts, batch, args)
            rows += [{"set": name, **r} for r in got]
            console.print(f"{name}, batch {batch}: every system's outputs equal the plain engine's "
                          f"({got[0]['decode_tokens']:,} decode tokens)")
        plain = Run(model, prompts, len(prompts), None, args)
        while plain.busy:
            plain.step()
        outputs = [list(s.output_ids) for s in plain.seqs]
        console.print(f"  {name} example reply: {tokenizer.decode(outputs[0])!r}")
        lens = layer_agreement(model_dir, prompts, outputs)
        lens_rows.append([name] + [f"{lens[layer]:.0%}" for layer in LENS_LAYERS if layer in lens])
    table = [[r["set"], str(r["batch"]), r["system"], f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
              "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}",
              "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}",
              " ".join("-" if a is None else f"{a:.0%}" for a in r["accepted_at_position"]) if r["drafted"] else "-"]
             for r in rows]
    console.print(harness.table(
        f"L11 on {args.model}: K = {args.k}, greedy, 16 requests per set, decode steps only (median of {args.rounds} "
        "round(s))", ("set", "batch", "system", "decode tok/s", "speed-up", "accepted", "mean length",
                      "accepted at position 1..K"), table))
    console.print(harness.table(
        "early exit, teacher-forced: how often the first L layers pick the whole model's token (= an early-exit "
        "draft's acceptance at position 1)", ["set"] + [f"L={layer}" for layer in LENS_LAYERS], lens_rows))
    cell = next((r for r in rows if (r["set"], r["system"], r["batch"]) ==
                 (TARGET["set"], TARGET["system"], TARGET["batch"])), None)
    if cell is not None:
        console.print(f"target: >= {TARGET['speedup']:g}x at batch 1 on the copy set with the n-gram drafter: "
                      f"{'MET' if cell['speedup'] >= TARGET['speedup'] else 'NOT MET'} ({cell['speedup']:.2f}x)")
    conditions.backend = harness.resolve_backend("auto", "cpu", torch.float32)
    conditions.extra.update(model=str(args.model), k=str(args.k), draft_layers=str(args.draft_layers))
    harness.finish(conditions, console)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
