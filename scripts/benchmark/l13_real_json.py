"""L13 on a trained model: chat requests that state a JSON schema, answered with and without the grammar.

    OMP_NUM_THREADS=1 python scripts/benchmark/l13_real_json.py [--model smollm2] [--n 100] [--rounds 2]

N chat requests (the checkpoint's own template) each ask for a JSON object with three stated fields for one of
ten people, sampled (temperature 0.7, seeds 0..N-1). The same N requests run twice in one L13Engine batch each:
free text, and with the schema as `response_format` would give it (a ConstrainedSampling grammar). Counted: how
many replies parse as JSON on their own (a client's `json.loads(content)`), how many validate against the schema,
and how many hold a valid object somewhere in the text; and decode throughput, tokens per second, alternating
the two batches over --rounds (the batches' lengths differ: a free reply runs longer, so its batch stays fuller).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the conditions line's harness

import harness  # noqa: E402
from lessons.l13_structured import L13Engine  # noqa: E402
from lessons.l13_structured.grammar import GrammarCompiler, GrammarSpec  # noqa: E402
from lessons.l13_structured.sampling import ConstrainedSampling  # noqa: E402
from shared.cli import OneLineParser  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"type": "string", "maxLength": 24}},
          "required": ["name", "age", "city"], "additionalProperties": False}
PEOPLE = ["Ana, 31, who lives in Lisbon", "Tom, 45, from Leeds", "Mei, 27, in Taipei", "Omar, 52, from Cairo",
          "Lena, 19, a student in Berlin", "Raj, 38, living in Pune", "Sofia, 64, from Bologna",
          "Kwame, 29, in Accra", "Ines, 41, from Quito", "Yuki, 33, who lives in Osaka"]
TEMPERATURE, MAX_NEW, BLOCK = 0.7, 96, 16


def question(person: str) -> str:
    """The schema stated in words (a 135M model given the schema's own JSON tends to write the schema back)."""
    return (f"Give me a JSON object with the fields name (a string), age (an integer) and city (a string) for "
            f"{person}. Reply with the JSON object only.")


def judge(text: str) -> tuple[bool, bool, bool]:
    """(the whole reply parses, it also validates, a valid object sits somewhere in it)."""
    def valid(obj) -> bool:
        try:
            jsonschema.validate(obj, SCHEMA)
            return True
        except jsonschema.ValidationError:
            return False
    try:
        whole = json.loads(text)
        return True, valid(whole), valid(whole)
    except ValueError:
        pass
    start, end = text.find("{"), text.rfind("}")
    try:
        inner = json.loads(text[start:end + 1]) if 0 <= start < end else None
    except ValueError:
        inner = None
    return False, False, inner is not None and valid(inner)


def run_batch(model, prompts: list[list[int]], grammar) -> tuple[list[list[int]], float, float]:
    """All requests in one L13Engine batch: (outputs without EOS, wall seconds, seconds in decode-only steps)."""
    eos = frozenset(model.config.eos_token_ids)
    longest = max(map(len, prompts))
    engine = L13Engine(model, BLOCK, num_blocks=len(prompts) * -(-(longest + MAX_NEW) // BLOCK) + 1,
                       max_running=len(prompts), graphs=False, max_batched_tokens=sum(map(len, prompts)))
    seqs = [engine.add_request(p, StopRule(MAX_NEW, eos), ConstrainedSampling(
        temperature=TEMPERATURE, seed=i, grammar=grammar)) for i, p in enumerate(prompts)]
    start, first_step_end = time.perf_counter(), None
    while engine.scheduler.has_work():
        engine.step()
        first_step_end = first_step_end or time.perf_counter()  # the first step prefills every prompt
    end = time.perf_counter()
    return [[t for t in s.output_ids if t not in eos] for s in seqs], end - start, end - first_step_end


def parser() -> OneLineParser:
    p = OneLineParser(prog="l13_real_json.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a checkpoint directory or a named model (default: smollm2)")
    p.add_argument("--n", type=int, default=100, help="requests per batch (default 100)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of the two batches (default 2)")
    return p


def planned(args, env: dict[str, str], measured_device: str) -> dict[str, str]:
    """What this command runs with today (tests/test_doc_measured.py): the CPU, fp32, the engine's backend, the
    thread count its command line sets."""
    out = {"device": "cpu", "dtype": "float32", "backend": harness.resolve_backend("auto", "cpu", torch.float32)}
    if "OMP_NUM_THREADS" in env:
        out["threads"] = env["OMP_NUM_THREADS"]
    return out


def main() -> int:
    p = parser()
    args = p.parse_args()
    if args.n < 1 or args.rounds < 1:
        p.error(f"--n and --rounds must be at least 1, got {args.n} and {args.rounds}")
    console = Console(highlight=False, soft_wrap=True)
    try:
        model_dir, template = harness.chat_checkpoint(args.model)
    except CourseError as e:
        p.error(str(e))
    conditions = harness.start("cpu", torch.float32)
    model = Qwen3ForCausalLM.from_dir(model_dir, torch.float32, torch.device("cpu"))
    tokenizer = load_tokenizer(model_dir)
    cfg = model.config
    grammar = GrammarCompiler(tokenizer, cfg.vocab_size, frozenset(cfg.eos_token_ids)).compile(
        GrammarSpec("json_schema", SCHEMA))
    chats = [template.apply_chat_template([{"role": "user", "content": question(PEOPLE[i % len(PEOPLE)])}],
                                          tokenize=False, add_generation_prompt=True) for i in range(args.n)]
    prompts = [tokenizer.encode(c).ids for c in chats]
    runs: dict[str, list[tuple[list[list[int]], float, float]]] = {"free text": [], "with the schema": []}
    for _, (label, grammar_or_none) in harness.alternate([("free text", None), ("with the schema", grammar)],
                                                         args.rounds):
        runs[label].append(run_batch(model, prompts, grammar_or_none))
    console.print(f"{args.n} chat requests (10 people, temperature {TEMPERATURE:g}, seeds 0..{args.n - 1}, at most "
                  f"{MAX_NEW} new tokens), each batch of {args.n} in one L13Engine, {args.rounds} alternating rounds")
    console.print(f"example request: {chats[0]!r}")
    rates = {}
    for label, results in runs.items():
        outputs = results[0][0]  # seeded: every round gives the same tokens
        assert all(r[0] == outputs for r in results), "a seeded batch gave other tokens in another round"
        verdicts = [judge(tokenizer.decode(o)) for o in outputs]
        tokens = sum(map(len, outputs))
        rates[label] = statistics.median(tokens / r[2] for r in results)
        console.print(f"{label:>15}: {sum(v[0] for v in verdicts)} of {args.n} parse whole, "
                      f"{sum(v[1] for v in verdicts)} validate, {sum(v[2] for v in verdicts)} hold a valid object "
                      f"somewhere; {tokens:,} tokens, mean {tokens / args.n:.1f}; decode {rates[label]:.0f} tok/s "
                      f"(median of {args.rounds})")
        console.print(f"{'':>15}  first reply: {tokenizer.decode(outputs[0])!r}")
    console.print(f"with the schema / free text decode throughput: {rates['with the schema'] / rates['free text']:.2f}x")
    conditions.backend = harness.resolve_backend("auto", "cpu", torch.float32)
    conditions.extra.update(model=str(args.model), n=str(args.n))
    harness.finish(conditions, console)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
