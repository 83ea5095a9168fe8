"""L9's parts without the HTTP server, in a few seconds: the detokenizer, the stop-string matcher, the request
parser, L9Engine.abort on the model-free fake runner, and the engine thread (EngineLoop) driven from an
asyncio loop in the test.

- Detokenizer: many seeded random id sequences (biased towards tokens that hold half a character), fed one
  at a time and in random groups, give exactly the tokenizer's own decode(skip_special_tokens=True); a
  character split across tokens is held back, then released whole; an unfinished one flushes to U+FFFD.
  The general offset method gives the same text, and on a SentencePiece-style tokenizer the same deltas as
  HF's DecodeStream, where decoding each token alone loses spaces.
- Stop strings: every way of cutting a text into three pieces releases exactly the text before the stop
  string; random texts over a 3-letter alphabet against a one-line oracle; nothing after a stop, ever.
- Protocol: every refusal names its field and status; do-nothing values of unimplemented fields pass.
- Abort: requests aborted waiting, mid-prompt, decoding, and as a parent with unforked siblings; after each,
  every reference count equals the tables holding the block, the aborted never reach a later plan, and the
  survivors' tokens equal those of an engine that never saw the aborted ones (the fake runner's logits are
  a hash of the history only, and sampling is per-request seeded, so tokens depend on content only). Then
  seeded random workloads of submits, aborts and steps, checked after every action, end with no leak.
- EngineLoop: Accepted, Deltas, Finished; a stop string ends its choice and frees its blocks; abort frees
  a running request's blocks; 429 when max_waiting is reached; a pool-size refusal is a Failed 400; stop()
  ends the thread and fails what is in flight. The preemption counter in /metrics equals the engine's count
  after every step of a run that preempts several requests in one step, in several steps.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers.decoders import DecodeStream

from fake_runner import FakeChunkRunner, decode_k, decode_v, fake_model, reference
from lessons.l4_continuous.sampling import SamplingParams
from lessons.l4_continuous.sequence import Status
from lessons.l8_chunked_prefill.engine import L8Engine
from lessons.l9_server.app import ServedModel, create_app
from lessons.l9_server.detokenizer import IncrementalDetokenizer, OffsetDetokenizer, TokenBytes
from lessons.l9_server.engine import L9Engine
from lessons.l9_server.engine_loop import Accepted, Delta, EngineLoop, Failed, Finished, Subscriber
from lessons.l9_server.metrics import ServerMetrics
from lessons.l9_server.protocol import ApiError, parse_chat, parse_completion
from lessons.l9_server.stop_strings import StopStringMatcher
from shared.errors import CourseError
from shared.generation import StopRule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from l9_walkthrough import sentencepiece_style  # noqa: E402  (the toy the walkthrough prints, Llama 2's layout)

IM_END, ENDOFTEXT = 151645, 151643
FIRST_ADDED = 151643  # the BPE ranks end here; the special tokens follow


@pytest.fixture(scope="module")
def token_bytes(tokenizer) -> TokenBytes:
    return TokenBytes(tokenizer)


@pytest.fixture(scope="module")
def fragments(token_bytes) -> list[int]:
    """BPE tokens whose bytes are not UTF-8 on their own: pieces of a character (about 1,400 of them)."""
    out = []
    for i in range(FIRST_ADDED):
        try:
            token_bytes(i).decode()
        except UnicodeDecodeError:
            out.append(i)
    return out


# --- detokenizer ---


def stream(token_bytes: TokenBytes, ids: list[int], sizes) -> tuple[str, bool]:
    """(the joined text pushed in groups of the given sizes, then flushed; whether any bytes were held)."""
    d = IncrementalDetokenizer(token_bytes)
    out, i, held = [], 0, False
    for size in sizes:
        if i >= len(ids):
            break
        out.append(d.push(ids[i:i + size]))
        held |= bool(d.held)
        i += size
    return "".join(out) + d.flush(), held


MULTIBYTE = "éñü東京語漢字한국어🙂🚀🎉∑→€"


@pytest.mark.task("L9.1")
def test_random_ids_stream_to_the_tokenizers_own_decode(tokenizer, token_bytes, fragments):
    """600 seeded sequences, each a run of segments: the encoding of random text full of 2-4 byte characters
    (so characters are split across tokens and completed), a character fragment (so some are never finished,
    or are invalid), or any id at all (BPE tokens, special tokens, ids past the tokenizer's vocabulary). Fed
    one at a time, in random groups of 1-5, and all at once, then flushed, each equals
    decode(skip_special_tokens=True). Many of them held a split character and still decoded without U+FFFD."""
    rng = random.Random(2024)
    completed_splits = 0
    for _ in range(600):
        ids = []
        for _ in range(rng.randint(0, 8)):
            kind = rng.random()
            if kind < 0.6:
                text = "".join(rng.choice(MULTIBYTE + "ab ") for _ in range(rng.randint(1, 6)))
                ids += tokenizer.encode(text).ids
            elif kind < 0.7:
                ids.append(rng.choice(fragments))
            else:
                ids.append(rng.randrange(151936))
        want = tokenizer.decode(ids, skip_special_tokens=True)
        one, held = stream(token_bytes, ids, itertools.repeat(1))
        assert one == want, (f"ids {ids} pushed one at a time give {one!r}, not decode's {want!r}: a token's bytes "
                             "go through one incremental UTF-8 decoder, so a character split across tokens is "
                             "held until its last byte comes, never decoded half on its own")
        grouped = stream(token_bytes, ids, iter(lambda: rng.randint(1, 5), None))[0]
        assert grouped == want, f"ids {ids} pushed in groups of 1-5 give {grouped!r}, not decode's {want!r}"
        whole = stream(token_bytes, ids, [len(ids) or 1])[0]
        assert whole == want, f"ids {ids} pushed all at once give {whole!r}, not decode's {want!r}"
        completed_splits += held and "\ufffd" not in want
    assert completed_splits > 20, completed_splits


def find_split_character(tokenizer, token_bytes) -> tuple[str, list[int], int]:
    """A text "at <char>." whose character byte-level BPE cuts across tokens: (text, ids, k), where ids[k - 1]
    is the first token that holds only part of a character (with "at ", all ASCII, before it)."""
    for ch in "東京語漢字🙂🚀🎉한국ñé":
        text = f"at {ch}."
        ids = tokenizer.encode(text).ids
        for i, t in enumerate(ids):
            try:
                token_bytes(t).decode()
            except UnicodeDecodeError:
                return text, ids, i + 1
    raise AssertionError("no character of the list is split by the tokenizer")


@pytest.mark.task("L9.1")
def test_a_split_character_is_held_then_released_whole(tokenizer, token_bytes):
    """Up to the first half of a split character, push releases exactly the text before it ("at ") and
    `held` is a proper prefix of the character's UTF-8 bytes; each further token releases nothing (holding a
    longer prefix) until the one that completes it, which releases the whole character and holds nothing.
    The joined text is the original."""
    text, ids, k = find_split_character(tokenizer, token_bytes)
    ch, utf8 = text[3], text[3].encode()
    d = IncrementalDetokenizer(token_bytes)
    out = d.push(ids[:k])
    assert out == "at " and d.held and utf8.startswith(d.held) and d.held != utf8, (
        f"push of {text!r}'s first {k} tokens released {out!r} and holds {d.held!r}: want 'at ' released and the "
        f"first bytes of {ch!r} ({utf8!r}) held, since half a character is not text yet")
    for i in range(k, len(ids)):
        before = d.held
        got = d.push([ids[i]])
        if got:
            assert got.startswith(ch) and d.held == b"", (got, d.held)
            out += got
            break
        assert utf8.startswith(d.held) and len(before) < len(d.held) < len(utf8), d.held
    else:
        raise AssertionError(f"{ch!r} was never released")
    out += d.push(ids[i + 1:]) + d.flush()
    assert out == text


@pytest.mark.task("L9.1")
def test_an_unfinished_character_flushes_to_one_replacement_character(tokenizer, token_bytes):
    """Output ending after the first half of a character: flush() gives one U+FFFD (what decode shows for
    the same ids), then nothing is held; a second flush adds nothing."""
    text, ids, k = find_split_character(tokenizer, token_bytes)
    d = IncrementalDetokenizer(token_bytes)
    got = d.push(ids[:k])
    assert d.held, f"push of {text!r}'s first {k} tokens (half of {text[3]!r}) released {got!r} and holds nothing"
    got += d.flush()
    assert got == text[:3] + "\ufffd" == tokenizer.decode(ids[:k], skip_special_tokens=True)
    assert d.held == b"" and d.flush() == ""


@pytest.mark.task("L9.1")
def test_special_tokens_and_padded_ids_add_no_text(tokenizer, token_bytes):
    """<|im_end|> and <|endoftext|> are b'' (held stays empty around them); ids past the tokenizer's
    vocabulary (the embedding is padded to 151,936) too; the text around them is unchanged."""
    assert token_bytes(IM_END) == b"" == token_bytes(ENDOFTEXT) == token_bytes(151900)
    hi, there = tokenizer.encode("Hi").ids, tokenizer.encode(" there").ids
    d = IncrementalDetokenizer(token_bytes)
    assert d.push(hi) == "Hi"
    assert d.push([IM_END]) == "" and d.held == b""
    assert d.push([ENDOFTEXT, 151900]) == ""
    assert d.push(there) + d.flush() == " there"
    assert tokenizer.decode(hi + [IM_END, ENDOFTEXT] + there, skip_special_tokens=True) == "Hi there"



def test_the_offset_method_matches_the_byte_shortcut(tokenizer, token_bytes, fragments):
    """OffsetDetokenizer (the general method: decode a window, release what it added, hold while it ends in
    U+FFFD) on 300 seeded sequences as above, fed in random groups after a prompt of real text: joined and
    flushed, it equals decode(skip_special_tokens=True) of the output, as IncrementalDetokenizer does."""
    rng = random.Random(7)
    for _ in range(300):
        ids = []
        for _ in range(rng.randint(1, 8)):
            kind = rng.random()
            if kind < 0.6:
                ids += tokenizer.encode("".join(rng.choice(MULTIBYTE + "ab ") for _ in range(rng.randint(1, 6)))).ids
            else:
                ids.append(rng.choice(fragments) if kind < 0.8 else rng.randrange(151936))
        prompt = tokenizer.encode("".join(rng.choice(MULTIBYTE + "ab ") for _ in range(rng.randint(0, 9)))).ids
        d, out, i = OffsetDetokenizer(tokenizer, prompt), [], 0
        while i < len(ids):
            size = rng.randint(1, 3)
            out.append(d.push(ids[i:i + size]))
            i += size
        want = tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(out) + d.flush() == want == stream(token_bytes, ids, itertools.repeat(1))[0], (prompt, ids)


def test_sentencepiece_needs_the_window_not_one_token_at_a_time():
    """On a SentencePiece-style tokenizer, each token decoded alone loses its leading space ("▁world" is
    "world") and a byte-fallback piece of 🚀 is U+FFFD: joined, "Helloworld" and four U+FFFD. The offset
    method releases "Hello", " world", " ", nothing three times, "🚀": HF's DecodeStream releases the same.
    The byte shortcut refuses such a tokenizer rather than print wrong text."""
    tok = sentencepiece_style(["▁Hello", "▁world", "▁"])
    ids = tok.encode("Hello world 🚀").ids
    pieces = ["▁Hello", "▁world", "▁", "<0xF0>", "<0x9F>", "<0x9A>", "<0x80>"]
    assert tok.encode("Hello world 🚀").tokens == pieces
    assert "".join(tok.decode([t]) for t in ids) == "Helloworld" + "\ufffd" * 4
    d = OffsetDetokenizer(tok)
    want = ["Hello", " world", " ", "", "", "", "🚀"]
    assert [d.push([t]) for t in ids] == want and d.flush() == ""
    stream_ = DecodeStream(skip_special_tokens=True)
    assert [stream_.step(tok, t) or "" for t in ids] == want
    with pytest.raises(CourseError, match="not byte-level BPE"):
        TokenBytes(tok)
    after = OffsetDetokenizer(tok, tok.encode("Hello").ids)  # a prompt's last tokens keep the first space
    assert after.push(tok.encode("world").ids[:1]) == " world"


# --- stop strings ---


def run_matcher(stops, pieces) -> tuple[str, StopStringMatcher, list[str]]:
    """Push every piece, then flush; (joined release, matcher, held after each push)."""
    m = StopStringMatcher(tuple(stops))
    out, held = [], []
    for p in pieces:
        out.append(m.push(p))
        held.append(m.held)
    out.append(m.flush())
    return "".join(out), m, held


def three_way_splits(text: str):
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize("text, stop", [
    ("Lift-off 🚀 at 東京. END", "at 東"),
    ("Lift-off 🚀 at 東京. END", "END"),  # at the very end
    ("Lift-off 🚀 at 東京. END", "Lift"),  # at the very start: nothing is released
    ("xxababacab", "abac"),  # a held prefix that fails ("abab") must keep its own suffix ("ab")
    ("aaaaab", "aab"),
    ("no stop here", "stop!"),  # a partial match that never completes: flushed as text
])
@pytest.mark.task("L9.2")
def test_a_stop_string_cut_at_every_pair_of_points(text, stop):
    """Every split of the text into 3 pieces (empty ones included) releases exactly text[:first occurrence]
    (the whole text when there is none), sets `stopped` exactly when it occurs, and holds at most
    len(stop) - 1 characters, always a prefix of the stop string."""
    cut = text.find(stop)
    want = text if cut < 0 else text[:cut]
    for pieces in three_way_splits(text):
        got, m, held = run_matcher([stop], pieces)
        assert got == want, (f"stop {stop!r}, text pushed as {pieces}: released {got!r}, want {want!r} (a suffix "
                             "that could begin the stop string is held back, never released before it is decided)")
        assert m.stopped == (cut >= 0) and m.held == ""
        assert all(len(h) <= len(stop) - 1 and stop.startswith(h) for h in held), (pieces, held)


@pytest.mark.task("L9.2")
def test_the_earliest_of_several_stop_strings_wins_in_any_order():
    """Stops "END" and "off": "off" comes first in the text, so the output ends before it, whichever order
    the stops are given in, and however the text is cut."""
    text = "Lift-off at END"
    for stops in (("END", "off"), ("off", "END")):
        for pieces in three_way_splits(text):
            assert run_matcher(stops, pieces)[0] == "Lift-", (stops, pieces)


@pytest.mark.task("L9.2")
def test_nothing_after_a_stop_is_ever_released():
    """Once stopped: push returns "" for any piece, flush returns "", held stays empty."""
    m = StopStringMatcher(("STOP",))
    got = m.push("abc ST")
    assert got == "abc " and m.held == "ST", f"stop 'STOP': push('abc ST') released {got!r} and holds {m.held!r}"
    assert m.push("OP and more") == "" and m.stopped
    for piece in ("x", "STOP", "more text", ""):
        assert m.push(piece) == "" and m.held == ""
    assert m.flush() == ""


@pytest.mark.task("L9.2")
def test_flush_releases_a_held_partial_prefix():
    """Output ending on "EN" with stop "END": "EN" is held back, then flush() releases it as plain text;
    a second flush releases nothing."""
    m = StopStringMatcher(("END", "xyz"))
    got = m.push("the EN")
    assert got == "the " and m.held == "EN", f"stop 'END': push('the EN') released {got!r} and holds {m.held!r}"
    assert m.flush() == "EN" and not m.stopped
    assert m.flush() == ""


@pytest.mark.task("L9.2")
def test_no_stop_strings_release_everything_at_once():
    """No stops (and an empty one, which is ignored): every piece is released as it comes, nothing held."""
    for stops in ((), ("",)):
        m = StopStringMatcher(stops)
        assert [m.push(p) for p in ("ab", "", "c")] == ["ab", "", "c"] and m.held == "" and not m.stopped


def substring_free(stops: list[str]) -> bool:
    """No stop string occurs inside another (then "the earliest occurrence" means the same thing whether
    occurrences are ordered by where they start or by where they end)."""
    return not any(a != b and a in b for a in stops for b in stops)


@pytest.mark.task("L9.2")
def test_random_texts_against_the_oracle():
    """3,000 seeded cases over the alphabet "ab\\n": 1-3 random stop strings (none inside another), a random
    text, cut into random pieces. The joined release equals text[:min(text.find(s) for s found)] (the whole
    text when none is found); `stopped` is set exactly then; the held text never exceeds the longest stop
    minus 1 and is always a suffix of what was pushed."""
    rng = random.Random(9)
    alphabet = "ab\n"
    word = lambda lo, hi: "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    found = 0
    for _ in range(3000):
        stops = list({word(1, 4) for _ in range(rng.randint(1, 3))})
        if not substring_free(stops):
            stops = stops[:1]
        text = word(0, 24)
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(6, len(text) + 1))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        want = text[:min(hits)] if hits else text
        got, m, held = run_matcher(stops, pieces)
        assert got == want, (stops, pieces)
        assert m.stopped == bool(hits)
        longest = max(map(len, stops))
        pushed = ""
        for p, h in zip(pieces, held):
            pushed += p
            assert len(h) <= longest - 1 and pushed.endswith(h), (stops, pieces, held)
        found += bool(hits)
    assert 1000 < found < 2900, found  # both outcomes are well exercised


@pytest.mark.task("L9.2")
def test_overlapping_stop_strings_do_not_depend_on_token_boundaries():
    """Stops "\\n\\nHuman:" and "Human" (the second inside the first). The model's text is the same however
    its tokens cut it, so the client's text must be too. Generation ends at the first token that completes
    any stop string, and "Human" always completes first (the ":" may never be generated): the output is
    "Hi\\n\\n" for every cut. Found by this file: pushed as one piece, the matcher cuts at the earliest
    *start* among all stops complete in the piece ("\\n\\nHuman:", giving "Hi"); cut after "Human" it gives
    "Hi\\n\\n". See the report: cut at the occurrence that ends first."""
    text, stops = "Hi\n\nHuman: x", ("\n\nHuman:", "Human")
    outputs = {}
    for i in range(len(text) + 1):
        outputs.setdefault(run_matcher(stops, [text[:i], text[i:]])[0], []).append(i)
    assert list(outputs) == ["Hi\n\n"], {k: v for k, v in outputs.items()}


# --- protocol ---

BODY = {"model": "m", "prompt": "hi"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refusal(body: dict, chat: bool = False) -> ApiError:
    with pytest.raises(ApiError) as err:
        (parse_chat if chat else parse_completion)(body, 16)
    return err.value


BAD_COMPLETIONS = [
    ({"temperature": -1}, "temperature"), ({"temperature": 3}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "hot"}, "temperature"), ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_p": -0.1}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"),
    ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"), ({"seed": "1"}, "seed"),
    ({"n": 0}, "n"), ({"n": 65}, "n"), ({"n": True}, "n"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": "10"}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 10.0}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"stop": ""}, "stop"), ({"stop": ["a", ""]}, "stop"),
    ({"stop": 5}, "stop"), ({"stop": [5]}, "stop"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids"), ({"stop_token_ids": "1"}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"), ({"stop_token_ids": 7}, "stop_token_ids"),
    ({"stream": "yes"}, "stream"), ({"stream": 1}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
    ({"stream": True, "stream_options": ["include_usage"]}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"ignore_eos": "no"}, "ignore_eos"), ({"return_token_ids": 1}, "return_token_ids"),
    ({"logprobs": 5}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"logprobs": 0}, "logprobs"),  # in the legacy API, 0 still asks for the chosen tokens' log-probabilities ({"top_logprobs": 2}, "top_logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"best_of": 2}, "best_of"), ({"best_of": True}, "best_of"), ({"echo": True}, "echo"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"logit_bias": {"1": 5}}, "logit_bias"), ({"suffix": "x"}, "suffix"),
    ({"temprature": 0.5}, "temprature"),  # a typo is an unknown field
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),  # a chat field on completions
    ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [[1], [2]]}, "prompt"), ({"prompt": [1, True]}, "prompt"), ({"prompt": [""]}, "prompt"),
    ({"prompt": None}, "prompt"), ({"prompt": 5}, "prompt"),
    ({"model": None}, "model"), ({"model": 3}, "model"),
]


@pytest.mark.parametrize("extra, param", BAD_COMPLETIONS, ids=[repr(e)[:40] for e, _ in BAD_COMPLETIONS])
def test_a_bad_completion_field_is_a_400_naming_it(extra, param):
    """Each bad value is refused with status 400, type invalid_request_error, and `param` its field."""
    body = {k: v for k, v in {**BODY, **extra}.items() if v is not None or k != "model"}  # model None: absent
    e = refusal(body)
    assert (e.status, e.param, e.kind) == (400, param, "invalid_request_error"), e.message
    assert e.body()["error"]["param"] == param and e.message


def test_a_batch_of_prompts_is_refused_by_name():
    """Two prompts in one request: 400 on prompt, and the message says batches are not supported."""
    e = refusal({**BODY, "prompt": ["one", "two"]})
    assert e.param == "prompt" and "batches" in e.message


def test_a_missing_model_is_refused():
    """No model field at all: 400 naming model."""
    e = refusal({"prompt": "hi"})
    assert (e.status, e.param) == (400, "model")


@pytest.mark.task("L9.3")
def test_huge_json_integers_are_a_400_not_a_crash():
    """A JSON integer too large for a float (json.loads makes it an int) in a number field must be refused
    like any out-of-range value. Found by this file: number() calls math.isfinite first, which raises
    OverflowError (a 500 from the server)."""
    for field in ("temperature", "top_p"):
        try:
            e = refusal({**BODY, field: 10**400})
        except OverflowError as crash:
            pytest.fail(f"{field}=10**400 raised OverflowError ({crash}) instead of ApiError")
        assert (e.status, e.param) == (400, field)


def test_falsy_non_lists_are_refused_too():
    """stop_token_ids must be a list of ints: 0, "", {} and false are not lists, and are refused like 7 or
    "1" are. Found by this file: `body.get("stop_token_ids") or []` turns every falsy value into []."""
    for value in (0, "", {}, False):
        with pytest.raises(ApiError) as err:
            parse_completion({**BODY, "stop_token_ids": value}, 16)
        assert err.value.param == "stop_token_ids", value


ACCEPTED = [
    {"logprobs": False}, {"logprobs": None}, {"presence_penalty": 0}, {"frequency_penalty": 0},
    {"presence_penalty": None}, {"top_logprobs": 0}, {"best_of": 1}, {"echo": False}, {"tools": []},
    {"logit_bias": {}}, {"user": "u"}, {"stop": []}, {"stop": None}, {"stream_options": None},
    {"stream": True, "stream_options": {}}, {"top_k": -1}, {"seed": 2**64 - 1}, {"seed": 0}, {"n": 64},
    {"temperature": 0}, {"temperature": 2}, {"top_p": 1}, {"stop_token_ids": []}, {"stop_token_ids": None},
]


@pytest.mark.parametrize("extra", ACCEPTED, ids=[repr(e)[:40] for e in ACCEPTED])
def test_do_nothing_and_edge_values_are_accepted(extra):
    """Fields this server does not implement, given the value that asks for nothing, and the edges of each
    range, parse without error."""
    parse_completion({**BODY, **extra}, 16)


@pytest.mark.task("L9.3")
def test_a_float_zero_penalty_is_a_penalty_of_zero():
    """presence_penalty 0.0 (what json.loads gives for "0.0") asks for nothing, like 0, and the lesson says a
    penalty of 0 is accepted. Found by this file: check_fields requires the exact type of the neutral value
    (int 0), so 0.0 is refused."""
    for field in ("presence_penalty", "frequency_penalty"):
        parse_completion({**BODY, field: 0.0}, 16)


@pytest.mark.task("L9.3")
def test_the_defaults_and_what_a_good_completion_parses_to():
    """Defaults: temperature 1.0, top_p 1, top_k 0, n 1, max_tokens = the default given, no stops, no stream.
    And every field given reaches the request: top_k -1 means none (0), stop ids as a frozenset, a batch of
    one prompt and a list of ids are accepted."""
    r = parse_completion(dict(BODY), 37)
    s = r.sampling
    assert (r.prompt, r.max_tokens, r.n, r.stop_strings, r.stream, r.include_usage, r.ignore_eos) == \
        ("hi", 37, 1, (), False, False, False)
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.stop_token_ids) == (1.0, 1.0, 0, None, frozenset())
    r = parse_completion({**BODY, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0.5, "top_p": 0.9,
                          "top_k": -1, "seed": 11, "n": 2, "stop": "END", "stop_token_ids": [4, 4, 9],
                          "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
                          "return_token_ids": True}, 16)
    assert (r.prompt, r.max_tokens, r.n, r.stop_strings, r.stream, r.include_usage, r.ignore_eos,
            r.return_token_ids) == ([5, 6, 7], 3, 2, ("END",), True, True, True, True)
    assert r.sampling.temperature == 0.5 and isinstance(r.sampling.temperature, float)
    assert (r.sampling.top_p, r.sampling.top_k, r.sampling.seed, r.sampling.stop_token_ids) == \
        (0.9, 0, 11, frozenset({4, 9}))
    assert parse_completion({**BODY, "prompt": ["one"]}, 16).prompt == "one"
    assert parse_completion({**BODY, "prompt": [[1, 2]]}, 16).prompt == [1, 2]
    assert parse_completion({**BODY, "stop": ["a", "b", "c", "d"]}, 16).stop_strings == ("a", "b", "c", "d")


BAD_CHATS = [
    ({"messages": []}, "messages"), ({"messages": "hi"}, "messages"), ({"messages": None}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}, "hi"]}, "messages[1].role"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[1]"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": ["x"]}]}, "messages[1].content[0]"),
    ({"max_tokens": 5, "max_completion_tokens": 5}, "max_completion_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"prompt": "hi"}, "prompt"),  # a completions field on chat
    ({"temperature": 9}, "temperature"),
]


@pytest.mark.parametrize("extra, param", BAD_CHATS, ids=[str(i) for i in range(len(BAD_CHATS))])
def test_a_bad_chat_field_is_a_400_naming_it(extra, param):
    """Chat refusals name the field down to the message and the content part (`messages[0].content[1]`)."""
    e = refusal({**CHAT, **extra}, chat=True)
    assert (e.status, e.param) == (400, param), e.message


def test_chat_template_kwargs_must_be_an_object_even_when_falsy():
    """[], 0, "" and false are not objects, and are refused like "x" is. Found by this file:
    `body.get("chat_template_kwargs") or {}` turns every falsy value into {}."""
    for value in ([], 0, "", False):
        with pytest.raises(ApiError) as err:
            parse_chat({**CHAT, "chat_template_kwargs": value}, 16)
        assert err.value.param == "chat_template_kwargs", value


def test_a_good_chat_parses_to_messages_kwargs_and_a_request():
    """Text parts are joined into one string; an empty name asks for nothing; max_completion_tokens sets
    max_tokens; chat_template_kwargs passes through; the prompt is left for the template."""
    messages, kwargs, r = parse_chat({**CHAT, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "name": "",
         "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "you"}]},
    ], "max_completion_tokens": 9, "chat_template_kwargs": {"enable_thinking": False}}, 16)
    assert messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello, you"}]
    assert kwargs == {"enable_thinking": False} and r.max_tokens == 9 and r.prompt == ""
    _, kwargs, r = parse_chat({**CHAT, "max_tokens": 4}, 16)
    assert kwargs == {} and r.max_tokens == 4 and r.sampling.temperature == 1.0 and r.n == 1
    assert parse_chat(dict(CHAT), 21)[2].max_tokens == 21


# --- L9Engine.abort on the fake runner ---


class FakeL9(L9Engine):
    runner_class = FakeChunkRunner


def fake_l9(block_size: int, num_blocks: int, **kwargs) -> FakeL9:
    return FakeL9(fake_model(), block_size, num_blocks, graphs=False, **kwargs)


def pool_token(pool, block: int, offset: int) -> int:
    seen = {decode_k(float(k[block, offset, 0, 0]), layer) for layer, k in enumerate(pool.k)}
    seen |= {decode_v(float(v[block, offset, 0, 0]), layer) for layer, v in enumerate(pool.v)}
    assert len(seen) == 1, f"block {block} offset {offset}: layers disagree {seen}"
    return int(seen.pop())


class Watch:
    """Records every plan, refusing one that holds an aborted sequence; checks the pool around each abort."""

    def __init__(self, engine: FakeL9):
        self.engine, self.aborted, self.plans = engine, [], 0
        schedule = engine.scheduler.schedule

        def watched():
            plan = schedule()
            gone = [p.seq.seq_id for p in plan if any(p.seq is a for a in self.aborted)]
            assert not gone, f"step {engine.clock}: aborted {gone} planned again"
            self.plans += 1
            return plan

        engine.scheduler.schedule = watched

    def abort(self, seqs) -> None:
        """Abort, and check the exact number of blocks it gave back: those only these sequences held."""
        e, m = self.engine, self.engine.allocator
        held = [b for s in seqs if s.status is not Status.FINISHED for b in s.blocks]
        counts = {b: held.count(b) for b in held}
        freed = sum(1 for b, c in counts.items() if m.ref[b] == c)
        free_before = m.num_free
        e.abort(list(seqs))
        self.aborted += list(seqs)
        assert m.num_free == free_before + freed, "abort returned the wrong number of blocks"
        self.check()

    def step(self) -> None:
        self.engine.step()
        self.check()

    def check(self) -> None:
        """Every reference count equals the tables holding the block (plus L7's dummy block's one); every
        unheld block is free or cached, exactly once; running histories are intact; the aborted are gone."""
        e, sched, m, S = self.engine, self.engine.scheduler, self.engine.allocator, self.engine.block_size
        holders = [0] * m.num_blocks
        holders[e.dummy_block] += 1
        for seq in sched.running:
            assert seq.status is Status.RUNNING and len(set(seq.blocks)) == len(seq.blocks)
            for b in seq.blocks:
                holders[b] += 1
            tokens = seq.all_tokens()
            for p in range(seq.num_cached):
                assert pool_token(m.pool, seq.blocks[p // S], p % S) == tokens[p], f"{seq.seq_id} lost position {p}"
        for seq in sched.waiting:
            assert seq.status is Status.WAITING and seq.blocks == [] and seq.num_cached == 0
        assert m.ref == holders, "a reference count differs from the number of tables holding the block"
        free, lru = list(m._free), list(m._lru)
        assert len(set(free)) == len(free) and not set(free) & set(lru)
        assert set(free) | set(lru) == {b for b in range(m.num_blocks) if m.ref[b] == 0}
        for seq in self.aborted:
            assert seq.status is Status.FINISHED and seq.blocks == [] and "forks" not in seq.extra
            assert not any(seq is s for s in sched.running) and not any(seq is s for s in sched.waiting)
            assert seq.seq_id not in e.timing and seq.seq_id not in e.prompt_slices


def step_until(watch: Watch, cond, limit: int = 60) -> None:
    for _ in range(limit):
        if cond():
            return
        watch.step()
    raise AssertionError("the state to abort in was never reached")


def is_decoding(seq) -> bool:
    return seq.status is Status.RUNNING and bool(seq.output_ids) and seq.num_tokens - seq.num_cached == 1


@pytest.mark.task("L9.5")
def test_abort_in_every_state_keeps_the_pool_exact_and_the_survivors_tokens():
    """S = 4, budget 6. Aborted: a 21-token prompt after 2 of its slices (its 3 full blocks are cached, and
    a survivor sharing that prefix hits them later), a request still waiting, a parent mid-prompt with two
    unforked siblings (all three), a greedy request while decoding, and one forked sibling while decoding
    (as a stop string does). After each abort and each step the pool is exact and no plan names the aborted.
    The survivors then finish with the tokens an engine that never saw the aborted ones gives."""
    rng = random.Random(1)
    prefix = [rng.randrange(64) for _ in range(12)]
    e = fake_l9(4, 48, max_batched_tokens=6, max_running=6)
    w = Watch(e)
    mid = e.add_parallel(prefix + [rng.randrange(64) for _ in range(9)], StopRule(4))[0]
    dec = e.add_parallel([5, 6, 7], StopRule(12))[0]
    group = e.add_parallel([rng.randrange(64) for _ in range(7)], StopRule(8), SamplingParams(1.0, seed=5), 3)
    keep_prompt, keep_stop = prefix + [rng.randrange(64) for _ in range(5)], StopRule(6)
    keep = e.add_parallel(keep_prompt, keep_stop)[0]
    g2_prompt, g2_stop, g2_sampling = [rng.randrange(64) for _ in range(5)], StopRule(7), SamplingParams(0.9, seed=9)
    g2 = e.add_parallel(g2_prompt, g2_stop, g2_sampling, 3)

    step_until(w, lambda: mid.num_cached >= 12)
    assert mid.status is Status.RUNNING and mid.num_cached < mid.num_tokens and mid.extra["registered"] == 3
    cached = list(mid.blocks[:3])
    w.abort([mid])
    assert all(e.allocator.cache.is_cached(b) and e.allocator.ref[b] == 0 for b in cached)

    waiting = e.add_parallel([9, 9, 9, 9], StopRule(3))[0]
    w.step()
    assert waiting.status is Status.WAITING and any(waiting is s for s in e.scheduler.waiting)
    w.abort([waiting])

    step_until(w, lambda: group[0].status is Status.RUNNING)
    assert 0 < group[0].num_cached < group[0].num_tokens and len(group[0].extra["forks"]) == 2
    assert group[1].status is Status.WAITING and not group[1].blocks
    w.abort(group)

    step_until(w, lambda: len(dec.output_ids) >= 2 and is_decoding(dec))
    w.abort([dec])

    step_until(w, lambda: is_decoding(g2[1]) and len(g2[1].output_ids) >= 2)
    w.abort([g2[1]])
    assert "forks" not in g2[0].extra and (is_decoding(g2[0]) or g2[0].status is Status.FINISHED)

    while e.scheduler.has_work():
        w.step()
    assert e.stats.cached_tokens >= 12, "the survivor sharing the aborted prompt's prefix did not hit its blocks"
    for seq in (mid, waiting, dec, *group, g2[1]):
        assert seq.status is Status.FINISHED and seq.blocks == []
    assert len(dec.output_ids) < 12 and group[0].output_ids == [] and waiting.output_ids == []
    survivors = [keep, g2[0], g2[2]]
    assert all(s.status is Status.FINISHED for s in survivors)
    assert set(e.timing) == {s.seq_id for s in survivors}
    m = e.allocator
    assert m.num_free == e.usable_blocks and m.ref[e.dummy_block] == 1 and sum(m.ref) == 1

    clean = fake_l9(4, 48, max_batched_tokens=6, max_running=6)
    c_keep = clean.add_parallel(keep_prompt, keep_stop)[0]
    c_g2 = clean.add_parallel(g2_prompt, g2_stop, g2_sampling, 3)
    while clean.scheduler.has_work():
        clean.step()
    assert keep.output_ids == c_keep.output_ids == reference(keep_prompt, keep_stop.max_new_tokens)
    assert [g2[0].output_ids, g2[2].output_ids] == [c_g2[0].output_ids, c_g2[2].output_ids]
    assert len({tuple(s.output_ids) for s in c_g2}) > 1  # the seeds really sample different tokens


def abort_state(seqs) -> str:
    parent = seqs[0]
    if parent.extra.get("forks"):
        return "unforked parent"
    live = [s for s in seqs if s.status is not Status.FINISHED]
    if all(s.status is Status.WAITING for s in live):
        return "waiting"
    if any(s.status is Status.RUNNING and not s.output_ids for s in live):
        return "mid-prompt"
    return "decoding"


def random_abort_run(seed: int) -> dict[str, int]:
    """Submits, aborts and steps drawn at random, the pool checked after every one; then run dry. Returns
    how many aborts hit each state."""
    rng = random.Random(seed)
    S, num_blocks = rng.randint(1, 6), rng.randint(6, 16)
    kwargs = dict(max_batched_tokens=rng.randint(1, 24), max_running=rng.randint(1, 5),
                  max_slice_tokens=rng.choice([None, rng.randint(1, 8)]))
    e = fake_l9(S, num_blocks, **kwargs)
    w = Watch(e)
    cap = num_blocks * S
    prefixes = [[rng.randrange(64) for _ in range(rng.randint(1, 3 * S))] for _ in range(2)]
    groups: list[tuple[list[int], StopRule, SamplingParams, list]] = []
    states: dict[str, int] = {}
    for _ in range(120):
        r = rng.random()
        if r < 0.25:
            prompt = (rng.choice(prefixes) + [rng.randrange(64) for _ in range(rng.randint(0, 3 * S))])[:cap - 1]
            stop = StopRule(rng.randint(1, max(1, min(10, cap - len(prompt)))),
                            frozenset({rng.randrange(64)}), ignore_eos=rng.random() < 0.5)
            n = rng.choice([1, 1, 2, 3])
            sampled = n > 1 or rng.random() < 0.3
            sampling = SamplingParams(1.0, seed=rng.randrange(1000)) if sampled else SamplingParams()
            groups.append((prompt, stop, sampling, e.add_parallel(prompt, stop, sampling, n)))
        elif r < 0.45:
            live = [g for g in groups if any(s.status is not Status.FINISHED for s in g[3])]
            if not live:
                continue
            seqs = rng.choice(live)[3]
            if seqs[0].extra.get("forks") or rng.random() < 0.5:
                chosen = list(seqs)  # a parent with siblings still to fork goes only with them
            else:
                chosen = [s for s in seqs if s.status is not Status.FINISHED]
                chosen = rng.sample(chosen, rng.randint(1, len(chosen)))
            state = abort_state(seqs)
            states[state] = states.get(state, 0) + 1
            w.abort(chosen)
        else:
            w.step()
    for _ in range(2000):
        if not e.scheduler.has_work():
            break
        w.step()
    else:
        raise AssertionError(f"seed {seed}: the engine did not finish")
    aborted = {id(s) for s in w.aborted}
    kept = [s for g in groups for s in g[3] if id(s) not in aborted]
    assert all(s.status is Status.FINISHED and s.blocks == [] for g in groups for s in g[3])
    assert set(e.timing) == {s.seq_id for s in kept}, "timing holds an aborted request, or lost a finished one"
    m = e.allocator
    assert m.num_free == e.usable_blocks == num_blocks, f"seed {seed}: {e.usable_blocks - m.num_free} blocks leaked"
    assert sum(m.ref) == 1 == m.ref[e.dummy_block]

    clean = fake_l9(S, num_blocks, **kwargs)  # the groups that kept a survivor, alone: the same tokens
    pairs = []
    for prompt, stop, sampling, seqs in groups:
        if any(id(s) not in aborted for s in seqs):
            pairs.append((seqs, clean.add_parallel(prompt, stop, sampling, len(seqs))))
    while clean.scheduler.has_work():
        clean.step()
    for seqs, twins in pairs:
        for s, t in zip(seqs, twins):
            if id(s) not in aborted:
                assert s.output_ids == t.output_ids, f"seed {seed}: request {s.seq_id}"
    return states


@pytest.mark.parametrize("seeds", [range(0, 10), range(10, 20), range(20, 30)])
def test_random_submits_aborts_and_steps_leak_nothing(seeds):
    """30 seeded workloads (block sizes 1-6, 6-16 blocks, budgets 1-24, preemption likely), every action
    checked (Watch). At the end every block is free or cached, timing holds only the unaborted, and every
    survivor's tokens equal those of a clean engine given only the groups that kept a survivor. Across the
    seeds, aborts hit every state: waiting, mid-prompt, decoding, and a parent with unforked siblings."""
    totals: dict[str, int] = {}
    for seed in seeds:
        for state, k in random_abort_run(seed).items():
            totals[state] = totals.get(state, 0) + k
    assert set(totals) == {"waiting", "mid-prompt", "decoding", "unforked parent"}, totals


def test_l9_engine_changes_only_the_methods_its_doc_names():
    """docs/l9_server.md says L9Engine adds abort, forget and trim_histories, overrides step, and changes nothing
    else of L8's engine: a fifth method (or attribute) here must be named there too."""
    own = {name for name in vars(L9Engine) if not (name.startswith("__") and name.endswith("__"))}
    assert own == {"abort", "forget", "step", "trim_histories"}, own
    assert hasattr(L8Engine, "step") and not hasattr(L8Engine, "abort") and not hasattr(L8Engine, "forget")


@pytest.mark.task("L9.5")
def test_forget_drops_only_that_requests_records():
    """forget(id) removes the id from timing and prompt_slices and nothing else; an unknown id is a no-op."""
    e = fake_l9(4, 16, max_batched_tokens=4)
    a = e.add_parallel(list(range(9)), StopRule(2))[0]
    b = e.add_parallel(list(range(20, 26)), StopRule(2))[0]
    while e.scheduler.has_work():
        e.step()
    assert set(e.timing) == {a.seq_id, b.seq_id} and set(e.prompt_slices) == {a.seq_id, b.seq_id}
    e.forget(a.seq_id)
    e.forget(12345)
    assert set(e.timing) == {b.seq_id} and set(e.prompt_slices) == {b.seq_id}


# --- EngineLoop, without HTTP ---

TIMEOUT = 10.0


def text_of(token_bytes: TokenBytes, ids: list[int]) -> str:
    return b"".join(token_bytes(t) for t in ids).decode("utf-8", errors="replace")


def completion(prompt: list[int], **fields):
    return parse_completion({"model": "m", "prompt": prompt, **fields}, 16)


async def events_until_end(sub: Subscriber) -> list:
    out = []
    while True:
        event = await asyncio.wait_for(sub.events.get(), TIMEOUT)
        out.append(event)
        if isinstance(event, (Finished, Failed)):
            return out


def make_loop(token_bytes, max_waiting: int = 8, eos: frozenset[int] = frozenset(), **kwargs) -> EngineLoop:
    engine = fake_l9(4, kwargs.pop("num_blocks", 300), max_batched_tokens=kwargs.pop("budget", 8), **kwargs)
    return EngineLoop(engine, token_bytes, ServerMetrics(), eos, max_waiting)


def record_sequences(engine) -> list:
    """Every sequence the engine thread creates, in order (the test reads them once the thread has stopped,
    or when the engine thread is known to be done with them)."""
    created, add = [], engine.add_parallel

    def recorded(*args, **kwargs):
        seqs = add(*args, **kwargs)
        created.extend(seqs)
        return seqs

    engine.add_parallel = recorded
    return created


def run_async(coro_fn, loop: EngineLoop):
    """Run the test coroutine; the engine thread is stopped whatever happens."""
    try:
        return asyncio.run(asyncio.wait_for(coro_fn(), 3 * TIMEOUT))
    finally:
        loop.stop(TIMEOUT)
        assert not loop.thread.is_alive(), "the engine thread did not end"


def check_idle_pool(engine) -> None:
    m = engine.allocator
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert m.num_free == engine.usable_blocks and sum(m.ref) == 1 == m.ref[engine.dummy_block]


@pytest.mark.task("L9.8")
def test_accepted_then_deltas_then_finished(token_bytes):
    """A greedy request and a sampled n = 2 one: Accepted(prompt tokens) first, then Deltas whose tokens are
    the reference's (the fake runner's argmax) and whose texts join to those tokens' text, each choice's last
    Delta with finish "length", then Finished with the tokens generated. Afterwards the engine holds
    nothing and timing has forgotten both requests."""
    loop = make_loop(token_bytes)

    async def main():
        loop.start()
        aio = asyncio.get_running_loop()
        greedy, sampled = Subscriber(aio), Subscriber(aio)
        loop.submit([1, 2, 3], completion([1, 2, 3], max_tokens=6, temperature=0), greedy)
        loop.submit([4, 5], completion([4, 5], max_tokens=4, temperature=1.0, seed=3, n=2), sampled)
        return await events_until_end(greedy), await events_until_end(sampled)

    greedy, sampled = run_async(main, loop)
    want = reference([1, 2, 3], 6)
    assert greedy[0] == Accepted(3) and greedy[-1] == Finished(3, 6)
    deltas = greedy[1:-1]
    assert all(isinstance(d, Delta) and d.index == 0 for d in deltas) and len(deltas) == 6
    assert [t for d in deltas for t in d.token_ids] == want
    assert "".join(d.text for d in deltas) == text_of(token_bytes, want)
    assert [d.finish_reason for d in deltas] == [None] * 5 + ["length"]
    assert sampled[0] == Accepted(2) and sampled[-1] == Finished(2, 8)
    for i in (0, 1):
        mine = [d for d in sampled[1:-1] if d.index == i]
        assert sum(len(d.token_ids) for d in mine) == 4 and mine[-1].finish_reason == "length"
        assert [d.finish_reason for d in mine[:-1]] == [None] * (len(mine) - 1)
    check_idle_pool(loop.engine)
    assert loop.engine.timing == {} and loop.engine.prompt_slices == {}
    assert loop.metrics.registry.get_sample_value("paged_requests_finished_total", {"reason": "length"}) == 3


def test_an_eos_token_finishes_with_stop(token_bytes):
    """The reference's 3rd token declared EOS (for the first prompt [k, 8] where it is new): the choice ends
    after 3 tokens with finish "stop"."""
    want = next(w for w in (reference([k, 8], 10) for k in range(64)) if w[2] not in w[:2])
    prompt = next([k, 8] for k in range(64) if reference([k, 8], 10) == want)
    eos = want[2]
    loop = make_loop(token_bytes, eos=frozenset({eos}))

    async def main():
        loop.start()
        sub = Subscriber(asyncio.get_running_loop())
        loop.submit(prompt, completion(prompt, max_tokens=10, temperature=0), sub)
        return await events_until_end(sub)

    events = run_async(main, loop)
    assert events[-1] == Finished(2, 3) and events[-2].finish_reason == "stop"
    assert [t for d in events[1:-1] for t in d.token_ids] == want[:3]


def test_a_stop_string_ends_the_choice_and_frees_its_blocks(token_bytes):
    """The stop string is two characters of the reference's text starting in its 4th token: the joined
    text ends just before it, the finish is "stop", completion_tokens counts up to the token that completed
    it (fewer than max_tokens), and the sequence was aborted in the engine: FINISHED, no blocks, the pool
    idle. The matcher never released any part of the stop string."""
    prompt, max_tokens = [11, 12, 13], 40
    want = reference(prompt, max_tokens)
    pieces = [text_of(token_bytes, [t]) for t in want]
    full = "".join(pieces)
    start = len("".join(pieces[:3]))
    stop = full[start:start + 2]
    cut = full.find(stop)
    ends = [len("".join(pieces[:i + 1])) for i in range(len(pieces))]
    used = next(i + 1 for i, end in enumerate(ends) if end >= cut + len(stop))
    assert used < max_tokens
    loop = make_loop(token_bytes)
    created = record_sequences(loop.engine)

    async def main():
        loop.start()
        sub = Subscriber(asyncio.get_running_loop())
        loop.submit(prompt, completion(prompt, max_tokens=max_tokens, temperature=0, stop=stop), sub)
        return await events_until_end(sub)

    events = run_async(main, loop)
    [seq] = created
    deltas = events[1:-1]
    assert "".join(d.text for d in deltas) == full[:cut]
    assert deltas[-1].finish_reason == "stop" and events[-1] == Finished(3, used)
    assert [t for d in deltas for t in d.token_ids] == want[:used]
    assert seq.status is Status.FINISHED and seq.output_ids == want[:used] and seq.blocks == []
    assert seq.seq_id not in loop.engine.timing
    check_idle_pool(loop.engine)
    assert loop.metrics.registry.get_sample_value("paged_requests_finished_total", {"reason": "stop"}) == 1


@pytest.mark.task("L9.8")
def test_abort_frees_a_running_requests_blocks(token_bytes):
    """A long request aborted after its second Delta. A second request submitted after the abort finishes
    (the inbox is handled in order, so the abort came first). Then: no Finished came for the aborted one,
    only Deltas without a finish; the tokens they carried are exactly the sequence's output (everything it
    generated was sent, nothing after the abort); the sequence is FINISHED with no blocks and far from its
    max_tokens; the pool is idle, timing forgot it, and the abort was counted."""
    loop = make_loop(token_bytes)
    created = record_sequences(loop.engine)

    async def main():
        loop.start()
        aio = asyncio.get_running_loop()
        sub = Subscriber(aio)
        rid = loop.submit([1, 2, 3, 4, 5, 6], completion([1, 2, 3, 4, 5, 6], max_tokens=1000, temperature=0), sub)
        assert await asyncio.wait_for(sub.events.get(), TIMEOUT) == Accepted(6)
        got = [await asyncio.wait_for(sub.events.get(), TIMEOUT) for _ in range(2)]
        loop.abort(rid)
        after = Subscriber(aio)
        loop.submit([9], completion([9], max_tokens=2, temperature=0), after)
        tail = await events_until_end(after)
        await asyncio.sleep(0.05)  # let every event already scheduled by the engine thread arrive
        while not sub.events.empty():
            got.append(sub.events.get_nowait())
        return got, tail

    got, tail = run_async(main, loop)
    seq = created[0]
    assert [s.prompt_ids for s in created] == [[1, 2, 3, 4, 5, 6], [9]]
    assert tail[-1] == Finished(1, 2)
    assert all(isinstance(d, Delta) and d.finish_reason is None for d in got), got
    assert [t for d in got for t in d.token_ids] == seq.output_ids
    assert seq.status is Status.FINISHED and seq.blocks == [] and 2 <= len(seq.output_ids) < 1000
    assert seq.seq_id not in loop.engine.timing and loop.jobs == {}
    check_idle_pool(loop.engine)
    assert loop.metrics.registry.get_sample_value("paged_requests_finished_total", {"reason": "abort"}) == 1


def test_finishes_are_counted_per_choice_whether_they_end_or_are_aborted(token_bytes):
    """paged_requests_finished_total counts choices: an n = 2 request that runs to max_tokens adds 2 under
    "length", and an n = 2 request aborted mid-decode adds 2 under "abort" (before: 1, one per request, while
    stop and length counted one per choice, so the reasons could not be compared or summed)."""
    loop = make_loop(token_bytes)

    async def main():
        loop.start()
        aio = asyncio.get_running_loop()
        done, doomed = Subscriber(aio), Subscriber(aio)
        loop.submit([4, 5], completion([4, 5], max_tokens=4, temperature=1.0, seed=3, n=2), done)
        doomed_id = loop.submit([6, 7], completion([6, 7], max_tokens=1000, temperature=1.0, seed=4, n=2), doomed)
        ends = await events_until_end(done)
        got = 0
        while got < 2:  # both choices decode: neither has a finish of its own when the client leaves
            got += isinstance(await asyncio.wait_for(doomed.events.get(), TIMEOUT), Delta)
        loop.abort(doomed_id)
        after = Subscriber(aio)
        loop.submit([9], completion([9], max_tokens=1, temperature=0), after)  # handled after the abort
        await events_until_end(after)
        return ends

    ends = run_async(main, loop)
    assert ends[-1] == Finished(2, 8)
    count = loop.metrics.registry.get_sample_value
    assert count("paged_requests_finished_total", {"reason": "length"}) == 2 + 1
    assert count("paged_requests_finished_total", {"reason": "abort"}) == 2
    check_idle_pool(loop.engine)


def test_the_preemption_counter_counts_each_preemption_once_at_every_update(tokenizer, token_bytes):
    """Eight greedy requests of 3 + 12 tokens in a 17-block pool of 4-token blocks: they preempt each other, several
    in one step, in more than one step, and the preempted wait several steps to be readmitted. The engine thread's
    pass is run by hand (drain, step, _emit, metrics.update), so after every update paged_preemptions_total must
    equal the preemptions so far: the engine's own count, and the calls to the scheduler's preempt. Adding the
    cumulative count at each update, or counting a preempted request again each step it waits, breaks that at
    the next update. At the end the app's GET /metrics shows the same number. Each output still equals the fake
    runner's reference (recompute is exact)."""
    loop = make_loop(token_bytes, num_blocks=17, budget=32)
    engine = loop.engine
    preempted: list[tuple[int, int]] = []  # (step, seq_id): each call of the scheduler's preempt
    preempt = engine.scheduler.preempt

    def spied_preempt(seq) -> None:
        preempted.append((steps, seq.seq_id))
        preempt(seq)

    engine.scheduler.preempt = spied_preempt
    count = loop.metrics.registry.get_sample_value
    prompts = [[1 + k, 2, 3] for k in range(8)]
    created = record_sequences(engine)
    loop.metrics.update(engine)  # as the thread starts: a fresh pool, nothing counted
    for p in prompts:
        loop.submit(p, completion(p, max_tokens=12, temperature=0), SimpleNamespace())
    steps, waited = 0, 0  # waited: updates at which a preempted sequence was still waiting to be readmitted
    while loop._drain(block=False) and engine.scheduler.has_work():
        engine.step()
        steps += 1
        loop._emit(time.perf_counter())
        loop.metrics.update(engine)
        waited += any(s.output_ids for s in engine.scheduler.waiting)
        assert engine.stats.preemptions == len(preempted), f"step {steps}: the engine's count is not the calls'"
        assert count("paged_preemptions_total") == len(preempted), (
            f"step {steps}: /metrics counts {count('paged_preemptions_total')}, the engine preempted {len(preempted)}")
        assert steps < 500, "the engine never finished"
    per_step = collections.Counter(step for step, _ in preempted)
    assert len(preempted) >= 4 and len(per_step) >= 2 and max(per_step.values()) >= 2, (
        f"the workload must preempt several times, in several steps, once several in one step: {preempted}")
    assert waited >= 3, f"a preempted sequence must wait across several updates (it did at {waited})"
    assert [s.output_ids for s in created] == [reference(p, 12) for p in prompts]

    async def scrape() -> str:
        app = create_app(ServedModel("m", tokenizer, None, 4096, fake_model().config.vocab_size), loop)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
            return (await http.get("/metrics")).text

    [family] = [f for f in text_string_to_metric_families(asyncio.run(scrape())) if f.name == "paged_preemptions"]
    total = next(s.value for s in family.samples if s.name == "paged_preemptions_total")
    assert total == engine.stats.preemptions == len(preempted)


@pytest.mark.task("L9.8")
def test_max_waiting_refuses_with_429_then_takes_more_once_drained(token_bytes):
    """max_waiting 2, engine thread not started yet: two submissions are queued, the third is a 429
    (rate_limit_error, nothing queued); once started, both finish, nothing is waiting, and a new one is
    accepted."""
    loop = make_loop(token_bytes, max_waiting=2)

    async def main():
        aio = asyncio.get_running_loop()
        subs = [Subscriber(aio), Subscriber(aio)]
        for s in subs:
            loop.submit([1, 2], completion([1, 2], max_tokens=2, temperature=0), s)
        assert loop.num_waiting == 2
        with pytest.raises(ApiError) as err:
            loop.submit([1, 2], completion([1, 2], max_tokens=2, temperature=0), Subscriber(aio))
        assert (err.value.status, err.value.kind) == (429, "rate_limit_error")
        assert loop.num_waiting == 2 and loop.inbox.qsize() == 2
        loop.start()
        done = [await events_until_end(s) for s in subs]
        third = Subscriber(aio)
        loop.submit([5], completion([5], max_tokens=1, temperature=0), third)
        return done, await events_until_end(third)

    done, third = run_async(main, loop)
    assert [d[-1] for d in done] == [Finished(2, 2), Finished(2, 2)] and third[-1] == Finished(1, 1)
    assert loop.num_waiting == 0


@pytest.mark.task("L9.8")
def test_a_request_the_pool_cannot_hold_is_a_failed_400(token_bytes):
    """8 blocks of 4 tokens: a 30-token prompt with 10 new tokens can never fit. The first event is Failed
    (400, param max_tokens), the waiting count goes back to 0, and the next request still runs."""
    loop = make_loop(token_bytes, num_blocks=8)

    async def main():
        loop.start()
        aio = asyncio.get_running_loop()
        big, small = Subscriber(aio), Subscriber(aio)
        loop.submit(list(range(30)), completion(list(range(30)), max_tokens=10, temperature=0), big)
        first = await asyncio.wait_for(big.events.get(), TIMEOUT)
        loop.submit([1], completion([1], max_tokens=2, temperature=0), small)
        return first, await events_until_end(small)

    first, small = run_async(main, loop)
    assert isinstance(first, Failed) and (first.error.status, first.error.param) == (400, "max_tokens")
    assert small[-1] == Finished(1, 2) and loop.num_waiting == 0


@pytest.mark.task("L9.8")
def test_stop_ends_the_thread_and_fails_what_is_in_flight(token_bytes):
    """stop() while a long request runs: the thread ends, the request's subscriber gets Failed (503, the
    server is shutting down), and a later submit is refused with 503."""
    loop = make_loop(token_bytes)

    async def main():
        loop.start()
        aio = asyncio.get_running_loop()
        sub = Subscriber(aio)
        loop.submit([2, 7], completion([2, 7], max_tokens=1000, temperature=0), sub)
        assert await asyncio.wait_for(sub.events.get(), TIMEOUT) == Accepted(2)
        loop.stop(TIMEOUT)
        assert not loop.thread.is_alive()
        events = []
        while True:
            event = await asyncio.wait_for(sub.events.get(), TIMEOUT)
            events.append(event)
            if not isinstance(event, Delta):
                break
        with pytest.raises(ApiError) as err:
            loop.submit([1], completion([1], max_tokens=1, temperature=0), Subscriber(aio))
        return events, err.value

    events, refused = run_async(main, loop)
    assert isinstance(events[-1], Failed) and events[-1].error.status == 503
    assert "shutting down" in events[-1].error.message
    assert refused.status == 503 and not loop.thread.is_alive() and loop.jobs == {}
