"""L11's worked example on the real engine: one request's verify step, carried through all the metadata.

    python scripts/l11_walkthrough.py [--wrong 2] [--model smollm2]

A 5-token prompt, block size 4, K = 4, graphs off. The replay drafter proposes the engine's own greedy
continuation (computed first, without drafts) and corrupts one output position, --wrong (default 2: the
second draft of the first verify step), so the target rejects it there. The first step prefills the prompt
and samples output token 0; the second is the verify step printed: its slice, the BatchMeta L3's backends
get, the slots the drafts are written to, the logits rows scored, the target's choices against the drafts,
what is kept, and the rollback of num_cached and of the block table. Then the run goes on to the end, and
the output must equal the engine's without drafts. docs/l11_speculative.md shows this output, and the doc's
test reruns the script.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lessons.l3_block_tensor.batch_meta import BatchMeta  # noqa: E402
from lessons.l8_chunked_prefill.runner import scored_rows  # noqa: E402
from lessons.l11_speculative import L11Engine  # noqa: E402
from lessons.l11_speculative.replay import ReplayDrafter  # noqa: E402
from lessons.l11_speculative.slice import VerifySlice  # noqa: E402
from shared.cli import OneLineParser, resolve_model_dir  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.generation import StopRule  # noqa: E402
from shared.model import Qwen3ForCausalLM  # noqa: E402
from shared.pool_trace import record_engines  # noqa: E402
from shared.tiny_qwen3 import default_model_dir  # noqa: E402

S, K, BLOCKS, MAX_NEW = 4, 4, 16, 8
# positions 0..4: block 1 full, block 2 holds position 4. Ids, not text: the walkthrough is about the metadata and
# the target's own choices, so any model's vocabulary serves (on SmolLM2, 10 is a special token; no matter).
PROMPT = [10, 20, 30, 40, 50]


def ints(xs) -> str:
    return "[" + " ".join(str(int(x)) for x in xs) + "]"


def parser() -> OneLineParser:
    p = OneLineParser(prog="l11_walkthrough.py", description=__doc__.splitlines()[0])
    p.add_argument("--wrong", type=int, default=2,
                   help=f"the output position whose draft is corrupted, 1..{K} (default: 2, the second draft; "
                        f"0: none, every draft accepted and the bonus token kept)")
    p.add_argument("--model", help="a checkpoint directory or a named model (smollm2); default: the embedded tiny model")
    p.add_argument("--trace", metavar="FILE", help="write the pool trace (JSON lines) here; "
                                                 "python scripts/pool_viewer.py --trace FILE draws it")
    return p


def engine_for(model: Qwen3ForCausalLM, drafter=None) -> L11Engine:
    return L11Engine(model, S, BLOCKS, backend="torch", graphs=False, drafter=drafter, num_speculative_tokens=K)


def main() -> None:
    p = parser()
    args = p.parse_args()
    try:
        if not 0 <= args.wrong <= K:
            raise CourseError(f"--wrong {args.wrong}: the first verify step drafts output positions 1..{K}")
        with record_engines(L11Engine, args.trace, "l11"):
            run(args.wrong, resolve_model_dir(args.model, default_model_dir))
    except CourseError as e:
        p.error(str(e))


def run(wrong: int, model_dir: Path) -> None:
    model = Qwen3ForCausalLM.from_dir(model_dir, torch.float32, torch.device("cpu"))
    stop = StopRule(MAX_NEW, frozenset(), ignore_eos=True)
    plain = engine_for(model).generate_batch([PROMPT], stop)[0]  # the target alone: what the drafter replays
    drafter = ReplayDrafter({tuple(PROMPT): plain}, model.config.vocab_size, lambda seq, pos: pos == wrong)
    engine = engine_for(model, drafter)
    seq = engine.add_request(PROMPT, stop)
    print(f"prompt {ints(PROMPT)}, block size {S}, K = {K}; the target alone says {ints(plain)}")
    engine.step()  # the prompt step: positions 0..4 written, output token 0 sampled (position 5, not yet in the pool)
    print(f"after step 1: num_tokens {seq.num_tokens}, num_cached {seq.num_cached}, blocks {ints(seq.blocks)}, "
          f"output {ints(seq.output_ids)}")

    seen: dict[str, object] = {}
    forward = engine.runner.forward

    def recording_forward(plan):
        piece = plan[0]
        seen.update(piece=piece, table=list(piece.blocks), cached=piece.num_cached,
                    fed=piece.token_ids(piece.num_cached, piece.num_tokens),
                    meta=BatchMeta.build(plan, S, torch.device("cpu")))
        seen["rows"] = scored_rows(plan, seen["meta"]).tolist()
        logits = forward(plan)
        seen["choices"] = logits.argmax(dim=-1).tolist()
        return logits

    engine.runner.forward = recording_forward
    out_before = len(seq.output_ids)
    engine.step()
    engine.runner.forward = forward
    piece, meta = seen["piece"], seen["meta"]
    assert isinstance(piece, VerifySlice)
    n, end = seq.num_tokens - (len(seq.output_ids) - out_before), piece.num_tokens
    fed = seen["fed"]
    print(f"step 2, the verify slice: num_cached {seen['cached']}, end {end} (n = {n} committed + {len(piece.drafts)} "
          f"drafts); feeds tokens {ints(fed)} at positions {ints(range(seen['cached'], end))}")
    note = f"d{wrong} corrupted: the target says {plain[wrong]}" if wrong else "none corrupted"
    print(f"  drafts d1..d{len(piece.drafts)} {ints(piece.drafts)} ({note}); blocks reserved {ints(seen['table'])}")
    for field in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "positions", "slot_mapping"):
        print(f"  {field:<17}{ints(getattr(meta, field))}")
    slots = meta.slot_mapping.tolist()
    print(f"  drafts' K/V written to slots {ints(slots[1:])} (positions {ints(range(n, end))}); "
          f"logits rows scored {ints(seen['rows'])}")
    print("  row  position   input  target's choice  draft checked  verdict")
    kept = seq.output_ids[out_before:]  # the step's tokens: the accepted drafts, then the target's own
    for j, choice in enumerate(seen["choices"]):
        draft = piece.drafts[j] if j < len(piece.drafts) else None
        if j >= len(kept):
            verdict = "discarded (after a rejection)"
        elif draft is None:
            verdict = "bonus token (every draft accepted)"
        else:
            verdict = "accept" if draft == choice else "reject: the target's token is kept instead"
        print(f"  {j:>3}  {seen['cached'] + j:>8}  {fed[j]:>6}  {choice:>15}  {'-' if draft is None else draft:>13}  "
              f"{verdict}")
    freed = [b for b in seen["table"] if b not in seq.blocks]
    print(f"  kept {ints(kept)} ({len(kept) - 1} draft(s) accepted + 1 of the target's own); "
          f"output now {ints(seq.output_ids)}")
    print(f"  rollback: num_tokens {n} -> {seq.num_tokens}; num_cached {seen['cached']} -> {end} written -> "
          f"{seq.num_cached} kept; blocks {ints(seen['table'])} -> {ints(seq.blocks)}, freed {ints(freed)}")
    garbage = [p for p in range(seq.num_cached, end) if p // S < len(seq.blocks)]  # rejected, in a kept block
    where = (f"position(s) {ints(garbage)} (slot(s) {ints(seq.slots(garbage[0], garbage[-1] + 1))}) of a kept block "
             f"hold rejected drafts' K/V" if garbage else "no rejected K/V is left in a kept block")
    print(f"  {where}; the next step writes position {seq.num_cached} (token {seq.output_ids[-1]}) first")
    cached = sorted(engine.cache.entry)
    print(f"  prefix cache names blocks {ints(cached)} (num_cached {seq.num_cached} // {S} = "
          f"{seq.num_cached // S} full block(s) of verified tokens); registered at the slice end "
          f"({end} // {S} = {end // S}) it would name {ints(seen['table'][:end // S])}")

    while engine.scheduler.has_work():
        engine.step()
    same = "equals" if seq.output_ids == plain else "DIFFERS FROM"
    print(f"after the run: output {ints(seq.output_ids)} {same} the target alone's; {engine.spec.line()}; "
          f"{engine.allocator.num_free} of {engine.usable_blocks} usable blocks free or cached")
    if seq.output_ids != plain:
        sys.exit(1)


if __name__ == "__main__":
    main()
