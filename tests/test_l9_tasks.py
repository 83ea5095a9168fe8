"""L9's build-track tests for the response objects and the engine thread's output pass, in process (scripts/course.py
check L9); the detokenizer's, the stop strings', the request checks', abort's and the inbox's are in test_l9_units.py,
the event buffer's cut in test_l9_streams.py.

- The request checks over test_l9_units.py's tables of bad and do-nothing fields, in one test that names the first
  field handled wrongly.
- ResponseShape and sse: OpenAI's objects field by field (chat and completions, whole and chunked, with and
  without usage and token ids) and the SSE framing, without a server.
- EventBuffer without an engine: an unread buffer stays bounded, merging Deltas, and reads back exactly.
- EngineLoop._emit driven by hand on the fake runner (no thread, no event loop): jobs admitted as _admit would,
  the engine stepped, then _emit; the events it leaves in the outbox are read back per request.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from types import SimpleNamespace

import pytest

from fake_runner import FakeChunkRunner, fake_model, reference
from lessons.l4_continuous.sequence import Status
from lessons.l9_server.detokenizer import IncrementalDetokenizer, TokenBytes
from lessons.l9_server.engine import L9Engine
from lessons.l9_server.engine_loop import Accepted, Choice, Delta, EngineLoop, EventBuffer, Finished, Job
from lessons.l9_server.metrics import ServerMetrics
from lessons.l9_server.protocol import ApiError, parse_chat, parse_completion
from lessons.l9_server.responses import ResponseShape, sse
from lessons.l9_server.stop_strings import StopStringMatcher
from shared.generation import StopRule
from test_l9_units import ACCEPTED, BAD_CHATS, BAD_COMPLETIONS, BODY, CHAT


# --- L9.3: the request checks ---


def refused(parse, what: str, param: str) -> None:
    try:
        parse()
    except ApiError as e:
        assert (e.status, e.param, e.kind) == (400, param, "invalid_request_error"), (
            f"{what}: refused with status {e.status}, param {e.param!r}, type {e.kind!r}; want 400, param {param!r}, "
            f"type 'invalid_request_error'")
        assert e.message, f"{what}: refused without a message"
        return
    pytest.fail(f"{what} was accepted: it must be refused with a 400 naming {param!r}")


@pytest.mark.task("L9.3")
def test_each_bad_field_is_a_400_naming_it_and_each_do_nothing_value_is_accepted():
    """Every case of test_l9_units.py's BAD_COMPLETIONS, BAD_CHATS and ACCEPTED tables, stopping at the first
    one handled wrongly."""
    for extra, param in BAD_COMPLETIONS:
        body = {k: v for k, v in {**BODY, **extra}.items() if v is not None or k != "model"}  # model None: absent
        refused(lambda: parse_completion(body, 16), f"completions with {extra!r}", param)
    for extra, param in BAD_CHATS:
        refused(lambda: parse_chat({**CHAT, **extra}, 16), f"chat with {extra!r}", param)
    for extra in ACCEPTED:
        try:
            parse_completion({**BODY, **extra}, 16)
        except ApiError as e:
            pytest.fail(f"completions with {extra!r} was refused ({e.status}, param {e.param!r}: {e.message}); it "
                        "asks for nothing (or is a range's edge) and must be accepted")


# --- L9.4: the response objects and the SSE framing ---


@pytest.mark.task("L9.4")
def test_sse_frames_each_event_as_data_then_a_blank_line():
    assert sse("[DONE]") == "data: [DONE]\n\n", "the stream's end is the line `data: [DONE]` and a blank line"
    got = sse({"text": "東 🚀", "n": 1})
    assert got.startswith("data: ") and got.endswith("\n\n") and got.count("\n") == 2, (
        f"one event is `data: <json>` then a blank line, got {got!r}")
    assert json.loads(got[len("data: "):]) == {"text": "東 🚀", "n": 1}, f"the event's JSON does not read back: {got!r}"
    assert "東 🚀" in got, f"non-ASCII text goes out as itself (ensure_ascii=False), not as \\u escapes: {got!r}"


@pytest.mark.task("L9.4")
def test_chat_chunks_give_the_role_first_then_content_then_the_finish_then_usage():
    shape = ResponseShape(chat=True, model="m", return_token_ids=False, prompt_tokens=7)
    envelope = {"id": shape.id, "object": "chat.completion.chunk", "created": shape.created, "model": "m"}
    first = shape.chunk(0, None, [], None, include_usage=True, first=True)
    want = {**envelope, "usage": None, "choices": [
        {"index": 0, "logprobs": None, "finish_reason": None, "delta": {"role": "assistant", "content": ""}}]}
    assert first == want, f"a choice's first chat chunk gives the role (and usage: null with include_usage): {first}"
    middle = shape.chunk(1, "Hi", [5], None, include_usage=False)
    want = {**envelope, "choices": [{"index": 1, "logprobs": None, "finish_reason": None, "delta": {"content": "Hi"}}]}
    assert middle == want, f"a later chunk carries only its content, and no usage key without include_usage: {middle}"
    last = shape.chunk(1, "", [6], "stop", include_usage=True)
    want = {**envelope, "usage": None,
            "choices": [{"index": 1, "logprobs": None, "finish_reason": "stop", "delta": {}}]}
    assert last == want, f"a last chunk with no new text: an empty delta and its finish_reason: {last}"
    tail = shape.usage_chunk(7, 3)
    want = {**envelope, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}
    assert tail == want, f"the usage chunk has no choices and the request's usage: {tail}"
    running = shape.chunk(0, "x", [1, 2], None, include_usage=False, generated=4)
    assert running.get("usage") == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}, (
        f"continuous_usage_stats: a chunk given `generated` carries the usage so far: {running}")


@pytest.mark.task("L9.4")
def test_completion_chunks_and_whole_responses():
    shape = ResponseShape(chat=False, model="m", return_token_ids=True, prompt_tokens=2)
    envelope = {"id": shape.id, "created": shape.created, "model": "m"}
    chunk = shape.chunk(0, None, [9], None, include_usage=False)
    want = {**envelope, "object": "text_completion",
            "choices": [{"index": 0, "logprobs": None, "finish_reason": None, "text": "", "token_ids": [9]}]}
    assert chunk == want, f"a completion chunk: text (\"\" when none yet) and, asked for, its token ids: {chunk}"
    whole = shape.whole(["a", "bc"], [[1], [2, 3]], ["length", "stop"], [4, 5], 3)
    want = {**envelope, "object": "text_completion", "prompt_token_ids": [4, 5],
            "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5},
            "choices": [{"index": 0, "logprobs": None, "finish_reason": "length", "text": "a", "token_ids": [1]},
                        {"index": 1, "logprobs": None, "finish_reason": "stop", "text": "bc", "token_ids": [2, 3]}]}
    assert whole == want, f"a whole completion (n = 2, return_token_ids): {whole}"
    chat = ResponseShape(chat=True, model="m", return_token_ids=False)
    whole = chat.whole(["Hello"], [[8, 9]], ["length"], [1, 2, 3], 2)
    want = {"id": chat.id, "object": "chat.completion", "created": chat.created, "model": "m",
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            "choices": [{"index": 0, "logprobs": None, "finish_reason": "length",
                         "message": {"role": "assistant", "content": "Hello"}}]}
    assert whole == want, f"a whole chat completion: the text as the assistant's message, no token ids: {whole}"


# --- L9.6: the event buffer ---


@pytest.mark.task("L9.6")
def test_an_unread_buffer_merges_deltas_and_reads_them_back_exactly():
    """600 Deltas of 3 choices pushed with no reader (the last of each choice with finish "length"): at most
    MERGE_AFTER + 3 Deltas + Accepted + Finished wait. Read back: Accepted first, per choice the same text and
    tokens in order with the finish on its last Delta only, Finished last, then nothing (QueueEmpty). A reader
    waiting in get() gets the next event pushed."""
    rng = random.Random(9)
    sent = [(i % 3, "".join(rng.choice("ab東🙂 ") for _ in range(rng.randint(0, 3))),
             [rng.randrange(1000) for _ in range(rng.randint(1, 3))]) for i in range(600)]
    total = sum(len(ids) for _, _, ids in sent)

    async def main():
        buffer = EventBuffer()
        buffer.push(Accepted(5))
        for k, (index, text, ids) in enumerate(sent):
            buffer.push(Delta(index, text, list(ids), "length" if k >= len(sent) - 3 else None))
        buffer.push(Finished(5, total))
        held = buffer.qsize()
        got = [await asyncio.wait_for(buffer.get(), 5) for _ in range(held)]
        assert buffer.finished, "the reader took Finished: `finished` is set"
        with pytest.raises(asyncio.QueueEmpty):
            buffer.get_nowait()
        waiting = EventBuffer()
        reader = asyncio.create_task(waiting.get())
        await asyncio.sleep(0.01)
        waiting.push(Delta(0, "x", [1]))
        late = await asyncio.wait_for(reader, 5)
        return held, got, late

    held, got, late = asyncio.run(main())
    assert held <= EventBuffer.MERGE_AFTER + 3 + 2, (
        f"{held} events wait unread; once {EventBuffer.MERGE_AFTER} wait, a Delta joins its choice's last one")
    assert got[0] == Accepted(5), f"the first event out is the first in: Accepted(5), got {got[0]}"
    assert got[-1] == Finished(5, total), f"the last event out is Finished, got {got[-1]}"
    for index in range(3):
        mine = [d for d in got[1:-1] if d.index == index]
        assert "".join(d.text for d in mine) == "".join(t for i, t, _ in sent if i == index), (
            f"choice {index}: its merged Deltas' text is not the text sent, in order")
        assert [t for d in mine for t in d.token_ids] == [t for i, _, ids in sent if i == index for t in ids], (
            f"choice {index}: its merged Deltas' tokens are not the tokens sent, in order")
        assert [d.finish_reason for d in mine] == [None] * (len(mine) - 1) + ["length"], (
            f"choice {index}: the finish reason belongs on its last Delta only")
    assert late == Delta(0, "x", [1]), f"a reader waiting in get() gets the Delta pushed next, got {late}"


# --- L9.7: one step's output, EngineLoop._emit driven by hand ---


class FakeL9(L9Engine):
    runner_class = FakeChunkRunner


def make_loop(tokenizer, eos: frozenset[int] = frozenset()) -> EngineLoop:
    engine = FakeL9(fake_model(), 4, 300, graphs=False, max_batched_tokens=8)
    return EngineLoop(engine, TokenBytes(tokenizer), ServerMetrics(), eos, max_waiting=8)


def admit(loop: EngineLoop, request_id: int, prompt: list[int], **fields) -> SimpleNamespace:
    """What _admit does, by hand: the request's sequences, a Choice each, the job under its id. Returns the
    stand-in subscriber its events are addressed to."""
    req = parse_completion({"model": "m", "prompt": prompt, **fields}, 16)
    seqs = loop.engine.add_parallel(prompt, StopRule(req.max_tokens, loop.eos_ids, req.ignore_eos), req.sampling,
                                    req.n)
    subscriber = SimpleNamespace(request=request_id)
    job = Job(req, prompt, subscriber, time.perf_counter())
    job.choices = [Choice(s, IncrementalDetokenizer(loop.token_bytes), StopStringMatcher(req.stop_strings))
                   for s in seqs]
    loop.jobs[request_id] = job
    return subscriber


def run(loop: EngineLoop, steps_per_emit: int = 1) -> None:
    """Step the engine until it is done, calling _emit after every `steps_per_emit` steps (2: each choice
    brings two tokens to an _emit, as L11's accepted drafts do)."""
    for _ in range(500):
        if not loop.engine.scheduler.has_work():
            return
        for _ in range(steps_per_emit):
            if loop.engine.scheduler.has_work():
                loop.engine.step()
        loop._emit(time.perf_counter())
    raise AssertionError("the engine never finished")


def events_of(loop: EngineLoop, subscriber) -> list:
    return [event for sub, event in loop.outbox.pending if sub is subscriber]


def text_of(loop: EngineLoop, ids: list[int]) -> str:
    return b"".join(loop.token_bytes(t) for t in ids).decode("utf-8", errors="replace")


@pytest.mark.task("L9.7")
def test_emit_sends_each_steps_tokens_as_deltas_then_finished_and_ends_the_request(tokenizer):
    loop = make_loop(tokenizer)
    greedy = admit(loop, 0, [1, 2, 3], max_tokens=6, temperature=0)
    sampled = admit(loop, 1, [4, 5], max_tokens=4, temperature=1.0, seed=3, n=2)
    seqs = [c.seq for job in loop.jobs.values() for c in job.choices]
    run(loop)
    want = reference([1, 2, 3], 6)
    events = events_of(loop, greedy)
    assert events and isinstance(events[-1], Finished), f"request 0's last event is Finished, got {events[-1:]}"
    assert events[-1] == Finished(3, 6), f"request 0: Finished(prompt tokens 3, completion tokens 6), got {events[-1]}"
    deltas = events[:-1]
    assert all(isinstance(d, Delta) and d.index == 0 for d in deltas), f"request 0: Deltas of choice 0, got {deltas}"
    assert [d.token_ids for d in deltas] == [[t] for t in want], "request 0: one Delta a step, with that step's token"
    assert "".join(d.text for d in deltas) == text_of(loop, want), "request 0: the Deltas' texts join to its text"
    assert [d.finish_reason for d in deltas] == [None] * 5 + ["length"], (
        "request 0: finish_reason only on the last Delta, \"length\" at max_tokens")
    events = events_of(loop, sampled)
    assert events[-1] == Finished(2, 8), f"request 1 (n = 2): Finished(2, 4 + 4), got {events[-1]}"
    for i in (0, 1):
        mine = [d for d in events[:-1] if d.index == i]
        assert sum(len(d.token_ids) for d in mine) == 4, f"request 1, choice {i}: 4 tokens in its Deltas"
        assert [d.finish_reason for d in mine] == [None] * 3 + ["length"], f"request 1, choice {i}: finish reasons"
    assert loop.jobs == {}, f"requests {sorted(loop.jobs)} finished but are still in loop.jobs (_end forgets them)"
    assert loop.engine.timing == {}, "a finished request's timing is forgotten (engine.forget)"
    assert all(s.status is Status.FINISHED for s in seqs)
    count = loop.metrics.registry.get_sample_value("paged_requests_finished_total", {"reason": "length"})
    assert count == 3, f"three choices finished with \"length\"; the metric counts {count}"


@pytest.mark.task("L9.7")
def test_emit_finishes_an_eos_token_with_stop(tokenizer):
    want = next(w for w in (reference([k, 8], 10) for k in range(64)) if w[2] not in w[:2])
    prompt = next([k, 8] for k in range(64) if reference([k, 8], 10) == want)
    loop = make_loop(tokenizer, eos=frozenset({want[2]}))
    sub = admit(loop, 0, prompt, max_tokens=10, temperature=0)
    run(loop)
    events = events_of(loop, sub)
    assert events[-1] == Finished(2, 3), f"the 3rd token is EOS: the request ends after 3 tokens, got {events[-1]}"
    assert events[-2].finish_reason == "stop", f"an EOS finishes with \"stop\", got {events[-2].finish_reason!r}"


def eos_last(max_tokens: int) -> tuple[list[int], list[int]]:
    """A prompt whose greedy output's max_tokens-th token appears nowhere before it, and that output: make that
    token the EOS id and the output reaches it exactly at max_tokens."""
    prompt = next([k, 8] for k in range(64) if (w := reference([k, 8], max_tokens))[-1] not in w[:-1])
    return prompt, reference(prompt, max_tokens)


@pytest.mark.task("L9.7")
@pytest.mark.parametrize("ignore_eos,reason", [(True, "length"), (False, "stop")])
def test_emit_finishes_an_ignored_eos_at_max_tokens_with_length(tokenizer, ignore_eos, reason):
    """The 6th token of 6 is EOS: with ignore_eos that EOS is just a token, so the output ends because max_tokens
    ran out ("length"); without it the same token is a stop ("stop"), which shows the EOS really is sampled there."""
    prompt, want = eos_last(6)
    loop = make_loop(tokenizer, eos=frozenset({want[-1]}))
    sub = admit(loop, 0, prompt, max_tokens=6, temperature=0, ignore_eos=ignore_eos)
    run(loop)
    events = events_of(loop, sub)
    assert events[-1] == Finished(2, 6), f"ignore_eos={ignore_eos}: six tokens, the last EOS; got {events[-1]}"
    assert [t for d in events[:-1] for t in d.token_ids] == want
    assert events[-2].finish_reason == reason, (
        f"ignore_eos={ignore_eos}, the max_tokens-th token EOS: finish {reason!r}, got {events[-2].finish_reason!r}")
    for r in ("length", "stop"):
        count = loop.metrics.registry.get_sample_value("paged_requests_finished_total", {"reason": r}) or 0.0
        assert count == (r == reason), f"finishes counted under {r!r}: {count}"


@pytest.mark.task("L9.7")
@pytest.mark.parametrize("steps_per_emit", [1, 2])
def test_emit_ends_a_choice_at_its_stop_string_and_frees_its_blocks(tokenizer, steps_per_emit):
    """The stop string is two characters of the greedy text, completed by an odd-numbered token: with two
    tokens per _emit it completes at the first of the pair, so the Delta's tokens and the usage stop there."""
    prompt, max_tokens = [11, 12, 13], 40
    loop = make_loop(tokenizer)
    want = reference(prompt, max_tokens)
    pieces = [text_of(loop, [t]) for t in want]
    full = "".join(pieces)
    for start in range(3, 20):
        stop = full[start:start + 2]
        cut = full.find(stop)
        used = next(i + 1 for i in range(len(pieces)) if len("".join(pieces[:i + 1])) >= cut + len(stop))
        if used % 2 and used > 3:
            break
    sub = admit(loop, 0, prompt, max_tokens=max_tokens, temperature=0, stop=stop)
    [choice] = loop.jobs[0].choices
    run(loop, steps_per_emit)
    events = events_of(loop, sub)
    deltas = events[:-1]
    what = f"stop string {stop!r} (completed by token {used}), {steps_per_emit} token(s) per _emit"
    assert "".join(d.text for d in deltas) == full[:cut], f"{what}: the text ends just before the stop string"
    assert [t for d in deltas for t in d.token_ids] == want[:used], f"{what}: the Deltas' tokens end at token {used}"
    assert deltas[-1].finish_reason == "stop", f"{what}: finish_reason \"stop\""
    assert events[-1] == Finished(3, used), f"{what}: completion_tokens counts up to token {used}, got {events[-1]}"
    seq = choice.seq
    assert seq.status is Status.FINISHED and seq.blocks == [], (
        f"{what}: the sequence is aborted in the engine at once (FINISHED, its blocks given back)")
    assert len(seq.output_ids) <= used + 1, f"{what}: the sequence decoded on past its stop string"
    allocator = loop.engine.allocator
    assert allocator.num_free == loop.engine.usable_blocks, "blocks are still held after the request ended"
