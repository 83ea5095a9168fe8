"""Rank 0's messages to the followers, as int64 tensors in a fixed schema. Nothing on the wire is unpickled.

A message is a kind and its arguments (the call rank 0 is about to make). On the wire it is two tensors:
  header   HEADER_LEN int64s: [MAGIC, kind's index in KINDS, payload length]
  payload  the arguments as fields, each its length then its values (strings as UTF-8 bytes); sent only
           when not empty
Each kind has one schema (`pack` writes it, `unpack` checks it field by field), so a follower turns
whatever arrives into integers, strings and SentSlices, or into one line naming what is wrong: a message
can never make a follower run code, as a pickle can. Nor make it allocate more than the message could hold:
a follower sizes the payload from the header, so the length is checked first against `Limits`, what the
messages before told it (its pool; the engine's token budget, sent once as "limits").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lessons.l2_token_flat.request import Request
from lessons.l4_continuous.table_tensor import TableTensor
from lessons.l8_chunked_prefill.slice import Slice
from shared.cli import DTYPES

KINDS = ("stop", "load", "build_runner", "capture", "run_step", "limits")
MAGIC = 0x4C3130  # "L10": a header that does not start with it was not written by pack
HEADER_LEN = 3
MAX_TEXT = 4096  # bytes in one string: PATH_MAX, so any model directory the follower could open
MAX_NAMES = 8  # build_runner's strings: the backend and the runner's recipe (L12's is three names)
SLICE_NUMBERS = 8  # seq_id, block_size, num_cached, decode, samples, table_from, table_len, last_block


class Malformed(ValueError):
    """A message that does not follow its kind's schema."""


@dataclass(frozen=True)
class Limits:
    """What a follower knows, from the messages before, of how long the next one can be. 0: not known yet, so
    nothing that depends on it fits (no step before the runner is built and the engine's limits are sent)."""

    num_blocks: int = 0  # the runner's pool, dummy block included (build_runner)
    max_running: int = 0  # the engine's (limits): the largest batch a graph is captured for
    max_step_tokens: int = 0  # the engine's token budget (limits): the most tokens one step feeds

    def most(self, kind: str) -> int:
        """The longest payload, in int64s, a message of this kind can have (each field: its length, its values)."""
        if kind == "stop":
            return 0
        if kind == "load":  # (model_dir, dtype)
            return 2 * (1 + MAX_TEXT)
        if kind == "build_runner":  # (block_size, num_blocks), then the backend and the recipe
            return 3 + MAX_NAMES * (1 + MAX_TEXT)
        if kind == "limits":
            return 3
        if kind == "capture":  # sizes, distinct and each 1 .. max_running (L7's check_capture_sizes); dummy_block
            return 1 + self.max_running + 2
        # run_step. Copies: a block of the pool taken for each. Slices: each feeds at least one token, so at most
        # max_step_tokens of them; each sends its numbers, a table of distinct blocks of the pool, its tokens.
        n, s = self.num_blocks, self.max_step_tokens
        return 1 + 2 * n + s * (1 + SLICE_NUMBERS + 1 + n + 1) + s


@dataclass(eq=False)
class SentSlice(Request):
    """A slice as the followers get it. `prompt_ids` holds only the tokens it feeds (num_cached ..
    num_tokens-1): the ones before are in every rank's pool already. As unpacked, `blocks` holds its block
    table from entry `table_from` on, what the followers lacked; tables.py joins it to the follower's copy."""

    seq_id: int = 0  # the request's: a follower keeps its copy of the table under it
    decode: bool = False
    samples: bool = False
    table_from: int = 0  # as sent: entries before it were sent in an earlier step (0: the whole table)
    last_block: int = -1  # rank 0's last table entry: the follower's joined copy must end with it
    table: TableTensor | None = None  # the follower's kept int32 copy of `blocks` (tables.py)

    # Task L10.5: a step as int64 tensors: pack, unpack checked field by field; a slice sends only its new tokens
    @classmethod
    def of(cls, s: Slice) -> "SentSlice":
        return cls(s.token_ids(s.num_cached, s.num_tokens), s.block_size, blocks=s.blocks, num_cached=s.num_cached,
                   seq_id=s.seq_id, decode=s.decode, samples=s.samples, last_block=s.blocks[-1])

    @property
    def num_tokens(self) -> int:
        return self.num_cached + len(self.prompt_ids)

    # Task L10.5: a step as int64 tensors: pack, unpack checked field by field; a slice sends only its new tokens
    def token_ids(self, start: int, end: int) -> list[int]:
        if start < self.num_cached:
            raise ValueError(f"tokens from {start}: only {self.num_cached} .. {self.num_tokens - 1} were sent")
        return self.prompt_ids[start - self.num_cached:end - self.num_cached]

    def block_table_tensor(self, n: int) -> torch.Tensor:
        return super().block_table_tensor(n) if self.table is None else self.table.first(self.blocks, n)


# Task L10.5: a step as int64 tensors: pack, unpack checked field by field; a slice sends only its new tokens
def pack(kind: str, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of the call `kind(*args)`."""
    fields: list[list[int]]
    if kind == "stop":
        fields = []
    elif kind == "load":  # (model_dir, dtype name)
        fields = [_text(args[0]), _text(args[1])]
    elif kind == "build_runner":  # (block_size, num_blocks, backend, *recipe): the runner's class, as names
        fields = [[args[0], args[1]], _text(args[2]), *(_text(name) for name in args[3:])]
    elif kind == "capture":  # (sizes, dummy_block)
        fields = [list(args[0]), [args[1]]]
    elif kind == "limits":  # (max_running, max_step_tokens): the engine's, what bounds the messages after it
        fields = [[args[0], args[1]]]
    elif kind == "run_step":  # (slices, copies[, starts]): per slice, its numbers, its table from starts[i] on,
        slices, copies, *rest = args  # and the tokens it feeds; no start given: every table whole
        starts = rest[0] if rest else [0] * len(slices)
        fields = [[v for pair in copies for v in pair]]
        for s, start in zip(slices, starts, strict=True):
            # The tokens before num_cached are in every rank's pool already, and the table entries before
            # `start` in every follower's copy (tables.py): a decode's message does not grow with its history.
            fields += [[s.seq_id, s.block_size, s.num_cached, int(s.decode), int(s.samples), start, len(s.blocks),
                        s.blocks[-1]], s.blocks[start:], s.token_ids(s.num_cached, s.num_tokens)]
    else:
        raise ValueError(f"no schema for message kind {kind!r}")
    payload = [v for f in fields for v in (len(f), *f)]
    return torch.tensor([MAGIC, KINDS.index(kind), len(payload)]), torch.tensor(payload, dtype=torch.int64)


def payload_len(header: torch.Tensor, limits: Limits | None = None) -> int:
    """How many int64s follow this header. Raises Malformed for a header pack did not write, or, given limits
    (a follower, before it sizes the payload), one longer than its kind's message can be. No limits: unpack,
    whose payload has arrived already and must be exactly that long."""
    if header.dtype != torch.int64 or header.shape != (HEADER_LEN,):
        raise Malformed(f"a header must be {HEADER_LEN} int64s, got {header.dtype} {tuple(header.shape)}")
    magic, kind, length = header.tolist()
    if magic != MAGIC:
        raise Malformed(f"bad magic {magic:#x}")
    if not 0 <= kind < len(KINDS):
        raise Malformed(f"unknown kind {kind}")
    most = (1 << 63) - 1 if limits is None else limits.most(KINDS[kind])
    if not 0 <= length <= most:
        raise Malformed(f"payload length {length} outside 0..{most}"
                        + (f" (the most a {KINDS[kind]} message holds under {limits})" if limits is not None else ""))
    return length


# Task L10.5: a step as int64 tensors: pack, unpack checked field by field; a slice sends only its new tokens
def unpack(header: torch.Tensor, payload: torch.Tensor) -> tuple:
    """(kind, *args), as pack was given them (slices as SentSlices). Raises Malformed naming what is wrong."""
    length = payload_len(header)
    if payload.dtype != torch.int64 or payload.shape != (length,):
        raise Malformed(f"the header says {length} int64s, the payload is {payload.dtype} {tuple(payload.shape)}")
    kind = KINDS[int(header[1])]
    fields = _fields(payload.tolist())
    if kind == "stop":
        _count(kind, fields, 0)
        return (kind,)
    if kind == "load":
        _count(kind, fields, 2)
        model_dir, dtype = _str(fields[0]), _str(fields[1])
        if dtype not in DTYPES:
            raise Malformed(f"load: dtype {dtype[:32]!r} is none of {', '.join(DTYPES)}")
        return kind, model_dir, dtype
    if kind == "build_runner":
        if len(fields) < 3:
            raise Malformed(f"{kind}: {len(fields)} fields, not 3 or more")
        block_size, num_blocks = _ints(fields[0], 2, "block_size, num_blocks", least=1)
        return kind, block_size, num_blocks, *(_str(f) for f in fields[1:])
    if kind == "capture":
        _count(kind, fields, 2)
        return kind, _ints(fields[0], None, "sizes", least=1), _ints(fields[1], 1, "dummy_block")[0]
    if kind == "limits":
        _count(kind, fields, 1)
        return kind, *_ints(fields[0], 2, "max_running, max_step_tokens", least=1)
    if len(fields) < 4 or (len(fields) - 1) % 3:
        raise Malformed(f"run_step: {len(fields)} fields, not 1 + 3 per slice (no slice: no step to run)")
    flat = _ints(fields[0], None, "copies")
    if len(flat) % 2:
        raise Malformed(f"run_step: {len(flat)} copy ids, not (src, dst) pairs")
    copies = list(zip(flat[::2], flat[1::2]))
    slices = []
    for numbers, blocks, tokens in zip(fields[1::3], fields[2::3], fields[3::3]):
        seq_id, block_size, num_cached, decode, samples, table_from, table_len, last_block = _ints(
            numbers, 8, "a slice's numbers")
        if block_size < 1 or decode > 1 or samples > 1 or not tokens:
            raise Malformed(f"run_step: a slice's numbers {numbers} (block size >= 1, flags 0 or 1, tokens >= 1)")
        blocks, tokens = _ints(blocks, None, "a block table"), _ints(tokens, None, "a slice's tokens")
        if table_from + len(blocks) != table_len:
            raise Malformed(f"run_step: a table of {table_len} entries sent from entry {table_from} as {len(blocks)}")
        if table_len * block_size < num_cached + len(tokens):
            raise Malformed(f"run_step: {table_len} block(s) of {block_size} hold fewer than "
                            f"{num_cached + len(tokens)} tokens")
        slices.append(SentSlice(tokens, block_size, blocks=blocks, num_cached=num_cached, seq_id=seq_id,
                                decode=bool(decode), samples=bool(samples), table_from=table_from,
                                last_block=last_block))
    return kind, slices, copies


def _text(s: str) -> list[int]:
    return list(s.encode())


def _fields(payload: list[int]) -> list[list[int]]:
    fields, at = [], 0
    while at < len(payload):
        n = payload[at]
        if not 0 <= n <= len(payload) - at - 1:
            raise Malformed(f"a field of length {n} at offset {at} overruns the payload ({len(payload)})")
        fields.append(payload[at + 1:at + 1 + n])
        at += 1 + n
    return fields


def _count(kind: str, fields: list, want: int) -> None:
    if len(fields) != want:
        raise Malformed(f"{kind}: {len(fields)} fields, not {want}")


def _ints(values: list[int], count: int | None, what: str, least: int = 0) -> list[int]:
    if count is not None and len(values) != count:
        raise Malformed(f"{what}: {len(values)} values, not {count}")
    if any(v < least for v in values):
        raise Malformed(f"{what}: {values[:8]} has a value below {least}")
    return values


def _str(values: list[int]) -> str:
    if any(not 0 <= v < 256 for v in values):
        raise Malformed("a string's bytes outside 0..255")
    try:
        return bytes(values).decode()
    except UnicodeDecodeError as e:
        raise Malformed(f"a string that is not UTF-8 ({e.reason})") from None
