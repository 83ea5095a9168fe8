"""L13's worked example on the embedded model: JSON asked for and not given, then one grammar walked step by step.

    python scripts/l13_walkthrough.py [--n N] [--seed S] [--steps K] [--model smollm2]

Part 1, the wall. A prompt asks for a JSON object with a city, an age and a name. N seeded sampled completions
(temperature 1, seeds 0..N-1, at most 48 new tokens) without a grammar, and the same N seeds with a small bounded
JSON schema, all 2N in one L13Engine batch: how many parse (`json.loads`) and validate (`jsonschema`). Part 2:
one constrained request (seed S) through its first K engine steps. Before each step, the matcher's bitmask
(lessons/l13_structured/mask.py): how many tokens it allows, a few of them decoded, and how many of the
model's own top 50 it allows; after it, the token the engine sampled, the same token drawn by hand (L4's
sampler on the captured logits after `mask.apply`, from the request's seed), and the matcher's state (the
text so far, is_accepting, is_stopped). Then the request runs to its end: the step where only EOS is allowed,
and the finished output. Exit 0 when every constrained output validates and every hand draw equals the
engine's; 1 otherwise; 2 on bad input. docs/l13_structured_output.md shows this output. With --model, the
prompt is the user turn of the checkpoint's chat template when it has one (an instruct model answers a turn;
the embedded model's outputs are random either way, and the doc's are of the bare prompt).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jsonschema
import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "benchmark"))  # the conditions line's harness

import harness  # noqa: E402
from lessons.l4_continuous.sampling import sample_row  # noqa: E402
from lessons.l8_chunked_prefill.scheduler import DEFAULT_MAX_BATCHED_TOKENS  # noqa: E402
from lessons.l13_structured import L13Engine, mask  # noqa: E402
from lessons.l13_structured.engine import matcher_of  # noqa: E402
from lessons.l13_structured.grammar import GrammarCompiler, GrammarSpec  # noqa: E402
from lessons.l13_structured.sampling import ConstrainedSampling  # noqa: E402
from shared.cli import OneLineParser, resolve_model_dir  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.pool_trace import record_engines  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402

PROMPT = ('Reply with one JSON object and nothing else: a city (Paris, Rome or Oslo), an age and a name, '
          'for example {"city": "Rome", "age": 36, "name": "Ada"}.\n')
# Bounded on purpose: every string, number and list has an end, so a random model finishes well inside MAX_NEW.
SCHEMA = {"type": "object",
          "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "name": {"type": "string", "maxLength": 8}},
          "required": ["city", "age", "name"], "additionalProperties": False}
MAX_NEW, TEMPERATURE, TOP, SHOWN, BLOCK = 48, 1.0, 50, 9, 16
MAX_N, MAX_STEPS = 1000, 20


def quoted(text: str, limit: int = 60) -> str:
    """A text in one line, as Python writes a string (escapes visible), cut at `limit` characters."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def bounded(name: str, low: int, high: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise CourseError(f"--{name} {text}: not an integer") from None
        if not low <= value <= high:
            raise CourseError(f"--{name} {value}: choose {low}..{high}")
        return value
    return parse


def parser() -> OneLineParser:
    p = OneLineParser(prog="l13_walkthrough.py", description=__doc__.splitlines()[0])
    p.add_argument("--n", default="200", help=f"completions with and without the schema, 1..{MAX_N} (default: 200)")
    p.add_argument("--seed", default="0", help="the seed of the request walked step by step (default: 0)")
    p.add_argument("--steps", default="5", help=f"engine steps shown for that request, 1..{MAX_STEPS} (default: 5)")
    p.add_argument("--model", help="a checkpoint directory or a named model (smollm2); default: the embedded tiny "
                                   "model; a model named here gets the prompt through its chat template")
    p.add_argument("--trace", metavar="FILE", help="write the pool trace (JSON lines) here; "
                                                 "python scripts/pool_viewer.py --trace FILE draws it")
    return p


def main() -> None:
    p = parser()
    args = p.parse_args()
    try:
        n = bounded("n", 1, MAX_N)(args.n)
        seed = bounded("seed", 0, 2**63 - 1)(args.seed)
        steps = bounded("steps", 1, MAX_STEPS)(args.steps)
        model_dir = resolve_model_dir(args.model, default_model_dir)
        loaded = load(model_dir)
        text = PROMPT if args.model is None else chat_prompt(model_dir)
        with record_engines(L13Engine, args.trace, "l13"):
            ok = run(n, seed, steps, loaded, text)
    except CourseError as e:
        p.error(str(e))
    sys.exit(0 if ok else 1)


def load(model_dir: Path) -> tuple[Qwen3ForCausalLM, object, GrammarCompiler]:
    model = Qwen3ForCausalLM.from_dir(model_dir, torch.float32, torch.device("cpu"))
    tokenizer = load_tokenizer(model_dir)
    cfg = model.config
    return model, tokenizer, GrammarCompiler(tokenizer, cfg.vocab_size, frozenset(cfg.eos_token_ids))


def chat_prompt(model_dir: Path) -> str:
    """PROMPT as the user turn of the checkpoint's chat template, or PROMPT itself when it ships none."""
    from lessons.l9_server.chat import ChatTemplate

    template = ChatTemplate(model_dir)
    return template.render([{"role": "user", "content": PROMPT.strip()}], {}) if template.available else PROMPT


def run(n: int, seed: int, steps: int, loaded: tuple | None = None, text: str = PROMPT) -> bool:
    """Both parts; True when every constrained output validates and every hand draw is the engine's.
    `loaded` (model, tokenizer, compiler) lets a test pass its session's copies; `text` is the prompt."""
    console = Console(highlight=False, soft_wrap=True)
    conditions = harness.start("cpu", torch.float32)
    model, tokenizer, compiler = loaded or load(default_model_dir())
    grammar = compiler.compile(GrammarSpec("json_schema", SCHEMA))
    prompt = tokenizer.encode(text).ids
    wall_ok, backend = wall(model, tokenizer, grammar, prompt, n, text)
    walk_ok = walk(model, tokenizer, grammar, prompt, seed, steps)
    conditions.backend = backend
    harness.finish(conditions, console)
    return wall_ok and walk_ok


def wall(model, tokenizer, grammar, prompt: list[int], n: int, text: str = PROMPT) -> tuple[bool, str]:
    eos = frozenset(model.config.eos_token_ids)
    stop = StopRule(MAX_NEW, eos, ignore_eos=False)
    # One batch: every request admitted at once (max_running), every prompt prefilled in the first step.
    engine = L13Engine(model, BLOCK, num_blocks=2 * n * -(-(len(prompt) + MAX_NEW) // BLOCK) + 1, max_running=2 * n,
                       graphs=False, max_batched_tokens=2 * n * len(prompt))
    start = time.perf_counter()
    free = [engine.add_request(prompt, stop, ConstrainedSampling(temperature=TEMPERATURE, seed=i)) for i in range(n)]
    held = [engine.add_request(prompt, stop, ConstrainedSampling(temperature=TEMPERATURE, seed=i, grammar=grammar))
            for i in range(n)]
    steps = 0
    while engine.scheduler.has_work():
        engine.step()
        steps += 1
    seconds = time.perf_counter() - start

    print(f"prompt ({len(prompt)} tokens): {quoted(text, 400)}")
    print(f"schema: {json.dumps(SCHEMA, separators=(',', ':'))}")
    print(f"{n} completions without a grammar and {n} with the schema, temperature {TEMPERATURE:g}, seeds 0..{n - 1} "
          f"each, at most {MAX_NEW} new tokens, one L13Engine batch of {2 * n}: {steps} steps in {seconds:.1f} s "
          f"(masks {engine.mask_seconds:.2f} s over {engine.masked_rows} rows)")
    all_valid = True
    for label, seqs in (("without a grammar", free), ("with the schema", held)):
        texts = [tokenizer.decode([t for t in s.output_ids if t not in eos]) for s in seqs]
        parsed, valid = 0, 0
        for text in texts:
            try:
                value = json.loads(text)
            except ValueError:
                continue
            parsed += 1
            try:
                jsonschema.validate(value, SCHEMA)
                valid += 1
            except jsonschema.ValidationError:
                pass
        ended = sum(1 for s in seqs if s.output_ids[-1] in eos)
        brace = sum(1 for t in texts if t.startswith("{"))
        mean = sum(len(s.output_ids) for s in seqs) / n
        print(f"  {label:18} parse {parsed:>4} of {n}   validate {valid:>4} of {n}   start with '{{' {brace:>4}   "
              f"end with EOS {ended:>4}   cut at {MAX_NEW} tokens {n - ended:>4}   mean length {mean:.1f} tokens")
        print(f"  {'':18} seed 0: {quoted(texts[0])}")
        if seqs is held:
            all_valid = valid == n
    return all_valid, harness.backend_name(engine)


def walk(model, tokenizer, grammar, prompt: list[int], seed: int, steps: int) -> bool:
    cfg = model.config
    eos = frozenset(cfg.eos_token_ids)
    # Every step shown samples a token, so the prompt must prefill in one step: a chat-templated prompt can be
    # longer than the default budget, and a step that only prefills a chunk samples nothing.
    engine = L13Engine(model, BLOCK, graphs=False, max_batched_tokens=max(DEFAULT_MAX_BATCHED_TOKENS, len(prompt)))
    sampling = ConstrainedSampling(temperature=TEMPERATURE, seed=seed, grammar=grammar)
    seq = engine.add_request(prompt, StopRule(MAX_NEW, eos, ignore_eos=False), sampling)
    generator = torch.Generator().manual_seed(seed)  # the request's own stream, drawn again by hand
    seen: dict[str, torch.Tensor] = {}
    forward = engine.runner.forward

    def watching_forward(*args, **kwargs):  # keep the logits as the model gave them, before the mask
        logits = forward(*args, **kwargs)
        seen["logits"] = logits.clone()
        return logits

    engine.runner.forward = watching_forward
    bitmask = mask.allocate(1, cfg.vocab_size)
    print(f"one request with the schema, temperature {TEMPERATURE:g}, seed {seed}; bitmask int32 "
          f"{list(bitmask.shape)} = [rows, ceil({cfg.vocab_size} / 32)], {bitmask.numel() * 4:,} B a row")
    ok, shown, step = True, 0, 0
    while engine.scheduler.has_work():
        matcher = matcher_of(seq)  # the engine's own matcher for this output: filling a mask does not move it
        mask.fill(matcher, bitmask, 0)
        allowed = mask.allowed_rows(bitmask, cfg.vocab_size)[0]
        ids = allowed.nonzero().flatten().tolist()
        forced = matcher.compute_ff_bytes().decode("utf-8", "replace")
        engine.step()
        step += 1
        logits = seen["logits"][-1]
        token = seq.output_ids[-1]
        row = logits.clone()[None]
        mask.apply(row, bitmask)  # the mask first, then L4's sampler: temperature and the draw see allowed tokens
        by_hand = sample_row(row[0], sampling, generator)
        ok &= by_hand == token and bool(allowed[token])
        if shown < steps:
            shown += 1
            top = logits.topk(TOP).indices
            words = " ".join(quoted(tokenizer.decode([t]), 20) for t in ids[:SHOWN])
            favourite = int(top[0])
            print(f"step {step}: the matcher allows {len(ids):,} of {cfg.vocab_size:,} tokens: {words}"
                  + (" ..." if len(ids) > SHOWN else "") + (f" (the grammar forces {quoted(forced)} next)" if forced else " (nothing forced)"))
            print(f"  the model's top {TOP} tokens: {int(allowed[top].sum())} allowed; its favourite "
                  f"{favourite} {quoted(tokenizer.decode([favourite]), 20)} (probability "
                  f"{float(torch.softmax(logits, -1)[favourite]):.4f}) is {'allowed' if allowed[favourite] else 'banned'}; "
                  f"the allowed tokens held {float(torch.softmax(logits, -1)[allowed].sum()):.2g} of its probability")
            print(f"  sampled {token} {quoted(tokenizer.decode([token]), 20)}; drawn by hand from the masked row: "
                  f"{by_hand} ({'the same' if by_hand == token else 'DIFFERENT'})")
            print(f"  matcher after: text {quoted(tokenizer.decode(seq.output_ids))}, "
                  f"is_accepting {matcher.is_accepting()}, is_stopped {matcher.is_stopped()}")
        elif matcher.is_accepting() and set(ids) <= eos and token in eos:
            print(f"step {step}: the JSON is complete; the matcher allows {len(ids)} tokens, {ids} (EOS), "
                  f"and the engine sampled {token}")
    text = tokenizer.decode([t for t in seq.output_ids if t not in eos])
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        verdict = "valid"
    except (ValueError, jsonschema.ValidationError) as e:
        verdict, ok = f"NOT VALID ({type(e).__name__})", False
    ended = "its last token EOS" if seq.output_ids[-1] in eos else f"cut at {MAX_NEW} tokens"
    print(f"finished after {len(seq.output_ids)} tokens, {ended}: {quoted(text)}: {verdict}; the matcher is_accepting {matcher_of(seq).is_accepting()}, "
          f"is_stopped {matcher_of(seq).is_stopped()}; every token drawn by hand was the engine's: "
          f"{'yes' if ok else 'NO'}")
    return ok


if __name__ == "__main__":
    main()
