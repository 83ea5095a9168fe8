"""The pages on the wire: how the decode engine pulls a prompt's K/V blocks from the prefill engine.

One TCP connection per pull, on loopback unless told otherwise. Every message is a header of four little-endian
int64s, [MAGIC, kind, length, count], then `length` bytes:

  D -> P  pull     count int64s: the lease, the first of its blocks D lacks
  P -> D  layout   LAYOUT int64s: the pages' shape and dtype, and the engine's fingerprint; count = blocks to come
  P -> D  block    one block, every layer's K then V rows as they lie in the pool (int8 rows carry their scale)
  P -> D  refused  UTF-8, why (no such lease, it expired); the connection ends
  D -> P  release  1 int64: the lease; P frees its blocks, and answers with the same message once it is marked

Nothing is unpickled: a header is four integers, a payload integers or raw page bytes. And nothing is allocated
on the say-so of a header: D checks the layout against its own pool (the same layers, block size, heads, row
width, dtype and fingerprint) before it takes a block, and each block's length against that layout before it
reads the bytes; P checks a pull's length against the one message it can be. A long prompt never needs one big
buffer: it moves a block at a time.
"""
from __future__ import annotations

import socket
import struct
from dataclasses import astuple, dataclass

import torch

from lessons.l3_block_tensor.kv_pool import BlockKvPool
from lessons.l10_tensor_parallel.wire import Malformed

MAGIC = 0x4C3135  # "L15"
KINDS = ("pull", "layout", "block", "refused", "release")
HEADER = struct.Struct("<4q")  # magic, kind, payload bytes, count
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.int8: 4}
MAX_TEXT = 1024  # a refusal's reason
MAX_BLOCKS = 1 << 20  # no pool is that large; a layout announcing more is refused before anything is read


@dataclass(frozen=True)
class PageLayout:
    """What one block is on both sides: both pools must agree exactly, or D would read pages it cannot use."""

    num_layers: int
    block_size: int
    kv_heads: int
    row: int  # elements per head row: head_dim, or head_dim + 4 for int8 rows with their scale
    dtype: int  # DTYPE_CODES
    fingerprint: int  # the engine's: model, weights' dtype, mode (fingerprint.py); K/V from another are not ours

    @classmethod
    def of(cls, pool: BlockKvPool, fingerprint: int) -> "PageLayout":
        k = pool.k[0]
        if k.dtype not in DTYPE_CODES or any(t.dtype != k.dtype for t in pool.k + pool.v):
            raise Malformed(f"pages of {k.dtype} do not travel: fp32, bf16, fp16 or int8 rows do")
        _, block_size, kv_heads, row = k.shape
        return cls(len(pool.k), block_size, kv_heads, row, DTYPE_CODES[k.dtype], fingerprint)

    @property
    def block_bytes(self) -> int:
        itemsize = next(d for d, c in DTYPE_CODES.items() if c == self.dtype).itemsize
        return 2 * self.num_layers * self.block_size * self.kv_heads * self.row * itemsize


# Task L15.1: a block's bytes: every layer's K then V rows, read from and written into the pool as they lie
def block_payload(pool: BlockKvPool, block: int) -> bytes:
    """One block's pages, layer by layer, K then V: the bytes as they lie (int8 rows with their scales)."""
    rows = [t[block].contiguous().view(torch.uint8).reshape(-1) for layer in zip(pool.k, pool.v) for t in layer]
    return torch.cat(rows).cpu().numpy().tobytes()  # a GPU's pages cross to the host first


# Task L15.1: a block's bytes: every layer's K then V rows, read from and written into the pool as they lie
def write_block(pool: BlockKvPool, block: int, payload: bytes) -> None:
    """The inverse of block_payload, into `block` of this pool (whose layout the sender's matched)."""
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    at = 0
    for layer in zip(pool.k, pool.v):
        for t in layer:
            n = t[block].numel() * t.element_size()
            t[block].copy_(flat[at:at + n].view(t.dtype).view(t[block].shape))
            at += n


def send(sock: socket.socket, kind: str, payload: bytes = b"", count: int = 0) -> None:
    sock.sendall(HEADER.pack(MAGIC, KINDS.index(kind), len(payload), count) + payload)


def send_ints(sock: socket.socket, kind: str, values: list[int], count: int | None = None) -> None:
    send(sock, kind, struct.pack(f"<{len(values)}q", *values), len(values) if count is None else count)


# Task L15.2: typed headers and the layout: refused before anything is read or allocated, another engine's pages too
def receive(sock: socket.socket, expect: tuple[str, ...], most: int) -> tuple[str, bytes, int]:
    """The next message, one of `expect`, its payload at most `most` bytes (checked before it is read)."""
    magic, kind, length, count = HEADER.unpack(read_exact(sock, HEADER.size))
    if magic != MAGIC:
        raise Malformed(f"bad magic {magic:#x}: not a page-transfer message")
    if not 0 <= kind < len(KINDS) or KINDS[kind] not in expect:
        raise Malformed(f"message kind {kind}, expected {' or '.join(expect)}")
    name = KINDS[kind]
    limit = MAX_TEXT if name == "refused" else most
    if not 0 <= length <= limit:
        raise Malformed(f"a {name} message of {length} bytes, more than the {limit} it can hold")
    return name, read_exact(sock, length), count


def read_exact(sock: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left:
        part = sock.recv(min(left, 1 << 20))
        if not part:
            raise ConnectionError(f"the connection closed {n - left} bytes into a {n}-byte read")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def ints(payload: bytes, n: int, what: str) -> list[int]:
    if len(payload) != 8 * n:
        raise Malformed(f"{what}: {len(payload)} bytes, not {n} int64s")
    return list(struct.unpack(f"<{n}q", payload))


def layout_ints(layout: PageLayout) -> list[int]:
    return list(astuple(layout))


# Task L15.2: typed headers and the layout: refused before anything is read or allocated, another engine's pages too
def check_layout(payload: bytes, count: int, mine: PageLayout, wanted: int) -> PageLayout:
    """The sender's layout, refused unless it is exactly ours and announces the blocks we asked for."""
    theirs = PageLayout(*ints(payload, len(astuple(mine)), "layout"))
    if theirs != mine:
        raise Malformed(f"the prefill engine's pages are {theirs}, this engine's {mine}: not the same model, "
                        f"dtype, KV layout or mode")
    if count != wanted or not 0 <= count <= MAX_BLOCKS:
        raise Malformed(f"the prefill engine announces {count} blocks, {wanted} were asked for")
    return theirs
