"""L15's pieces on their own: a block's bytes, the messages (refused before anything is read or allocated), the
fingerprint, the prefix walk, leases, P's page server, and D's load with every failure it must survive. After each
failure both pools are checked idle: every block free or cached, nothing held, P's leases gone."""
from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
import torch

from lessons.l4_continuous.sampling import SamplingParams
from lessons.l10_tensor_parallel.wire import Malformed
from lessons.l14_batch_invariant import L14Engine
from lessons.l15_disaggregated import L15Engine
from lessons.l15_disaggregated.connector import (
    Leases,
    NoRoom,
    TransferFailed,
    cached_prefix,
    transferable,
)
from lessons.l15_disaggregated.fingerprint import fingerprint
from lessons.l15_disaggregated.pair import run_disaggregated
from lessons.l15_disaggregated.transfer import (
    HEADER,
    MAGIC,
    PageLayout,
    block_payload,
    check_layout,
    layout_ints,
    receive,
    send,
    write_block,
)
from shared.errors import CourseError
from shared.generation import StopRule
from test_l3_cpp_backend import needs_kernel

S = 4  # block size: prompts of a dozen tokens fill a few blocks
STOP = StopRule(6)


def engines(model, *, invariant: bool = False, **options) -> tuple[L15Engine, L15Engine]:
    common = dict(block_size=S, batch_invariant=invariant) | options
    consumer = {k: v for k, v in common.items() if k != "connector_args"}
    return (L15Engine(model, kv_role="kv_producer", **common),
            L15Engine(model, kv_role="kv_consumer", **consumer))


def idle_problems(engine: L15Engine) -> list[str]:
    """An engine with nothing running: every block free or cached, none held (L7's dummy block aside), no lease."""
    m, problems = engine.allocator, []
    held = [b for b in range(m.num_blocks) if m.ref[b] and b != engine.dummy_block]
    if held:
        problems.append(f"blocks {held[:8]} still held")
    if set(m._free) & set(m._lru) or len(m._free) + len(m._lru) != m.num_blocks - 1:
        problems.append(f"free {len(m._free)} + cached {len(m._lru)} != {m.num_blocks - 1} blocks")
    if any(engine.cache.is_cached(b) for b in m._free):
        problems.append("a free block is still in the prefix cache")
    if engine.producer is not None and len(engine.producer.leases):
        problems.append(f"{len(engine.producer.leases)} leases left")
    return problems


def leased(p: L15Engine, prompt: list[int]) -> dict:
    """P prefills `prompt` (one token) and leases its blocks: L15.4's calls only, not L15.7's flow."""
    p.generate_batch([prompt], StopRule(1))
    return p.producer.request_finished(prompt)


def decoded(d: L15Engine, prompt: list[int], params: dict):
    """D loads, then admits and runs the request to its end: L15.6's calls only. (tokens, LoadResult)"""
    loaded = d.consumer.load(prompt, params)
    seq = d.add_request(prompt, STOP)
    while d.scheduler.has_work():
        d.step()
    return seq.output_ids, loaded


def settled(p: L15Engine, timeout_s: float = 5.0) -> None:
    """P steps until its page server has taken D's release (it arrives on the server's thread) and the lease's
    blocks are freed; at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    p.step()
    while len(p.producer.leases) and time.monotonic() < deadline:
        time.sleep(0.01)
        p.step()


@pytest.fixture
def pair(tiny_model):
    made = []

    def make(**options):
        p, d = engines(tiny_model, **options)
        made.append(p)
        return p, d

    yield make
    for p in made:
        p.close()


@pytest.mark.task("L15.1")
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_a_block_moves_every_layer_k_and_v_bit_for_bit(tiny_model, kv_dtype):
    a = L14Engine(tiny_model, S, 8, kv_dtype=kv_dtype)
    b = L14Engine(tiny_model, S, 8, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(15)
    for t in a.runner.pool.k + a.runner.pool.v:
        t.copy_(torch.randint(-100, 100, t.shape, generator=g).to(t.dtype))
    write_block(b.runner.pool, 5, block_payload(a.runner.pool, 3))
    for layer, (x, y) in enumerate(zip(a.runner.pool.k + a.runner.pool.v, b.runner.pool.k + b.runner.pool.v)):
        assert torch.equal(x[3].view(torch.uint8), y[5].view(torch.uint8)), f"pool tensor {layer}: block 3 != 5"
        assert not y[4].any(), "write_block wrote outside its block"
    layout = PageLayout.of(a.runner.pool, 0)
    assert len(block_payload(a.runner.pool, 3)) == layout.block_bytes


@pytest.mark.task("L15.2")
def test_the_fingerprint_tells_apart_mode_pool_dtype_block_size_and_weights(tiny_model, other_checkpoints):
    from shared.model import Qwen3ForCausalLM

    base = fingerprint(L14Engine(tiny_model, S, 8))
    assert base == fingerprint(L14Engine(tiny_model, S, 8)), "the same engine twice must give the same fingerprint"
    others = {"mode": L14Engine(tiny_model, S, 8, batch_invariant=True), "int8 pool": L14Engine(tiny_model, S, 8,
              kv_dtype="int8"), "block size": L14Engine(tiny_model, 8, 8)}
    other = next(iter(other_checkpoints.values()))
    others["weights"] = L14Engine(Qwen3ForCausalLM.from_dir(other, torch.float32, torch.device("cpu")), S, 8)
    for what, engine in others.items():
        assert fingerprint(engine) != base, f"another {what} gave the same fingerprint: D would file P's pages"


def header(kind: int, length: int, count: int = 0, magic: int = MAGIC) -> bytes:
    return HEADER.pack(magic, kind, length, count)


@pytest.mark.task("L15.2")
@pytest.mark.parametrize("raw,expect,message", [
    (header(0, 16, magic=0x1234), ("pull",), "bad magic"),
    (header(9, 16), ("pull",), "kind 9"),
    (header(2, 100), ("pull",), "kind 2"),  # a block where a pull belongs
    (header(0, 1 << 40), ("pull",), "1099511627776 bytes"),  # 1 TiB announced: refused, nothing allocated
    (header(3, 4096), ("refused",), "4096 bytes"),  # a reason longer than MAX_TEXT
])
def test_a_header_is_refused_before_its_payload_is_read(raw, expect, message):
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(2)
        a.sendall(raw)  # no payload follows: a receive that tried to read it would time out, not raise Malformed
        try:
            with pytest.raises(Malformed, match=message):
                receive(b, expect, 16)
        except TimeoutError:
            pytest.fail(f"receive waited for the payload of a header it must refuse ({message}): check the magic, "
                        "the kind and the length before reading a byte of the payload")


@pytest.mark.task("L15.2")
def test_a_layout_differing_in_any_field_or_announcing_other_counts_is_refused(tiny_model):
    mine = PageLayout.of(L14Engine(tiny_model, S, 8).runner.pool, 7)
    payload = struct.pack("<6q", *layout_ints(mine))
    assert check_layout(payload, 3, mine, 3) == mine
    for i in range(6):
        values = layout_ints(mine)
        values[i] += 1
        with pytest.raises(Malformed, match="not the same model"):
            check_layout(struct.pack("<6q", *values), 3, mine, 3)
    with pytest.raises(Malformed, match="announces 4 blocks, 3"):
        check_layout(payload, 4, mine, 3)
    with pytest.raises(Malformed, match="layout"):
        check_layout(payload[:40], 3, mine, 3)


@pytest.mark.task("L15.3")
def test_cached_prefix_walks_the_chain_and_stops_at_the_first_miss(tiny_model):
    engine = L14Engine(tiny_model, S, 64)
    prompt = list(range(10, 24))  # 14 tokens: 3 full blocks, 3 transferable
    engine.generate_batch([prompt], StopRule(1))
    blocks, keys = cached_prefix(engine, prompt, transferable(len(prompt), S))
    assert len(blocks) == 3 and len(keys) == 3, f"{blocks}: want the prompt's 3 full blocks"
    assert transferable(12, S) == 2, "a prompt of exactly 3 blocks leaves its last token, and so its last block, to D"
    changed = prompt[:5] + [99] + prompt[6:]  # block 1 differs: block 2's key differs too (the chain)
    assert cached_prefix(engine, changed, 3)[0] == blocks[:1]


@pytest.mark.task("L15.4")
def test_a_lease_is_read_until_released_or_expired_and_freed_only_when_nobody_reads():
    now = [0.0]
    leases = Leases(30.0, clock=lambda: now[0])
    a, b = leases.grant([1, 2]), leases.grant([3])
    assert a != b and leases.start_read(a) == [1, 2]
    assert leases.release(a) and leases.reap() == [], "a lease being read is not freed under the reader"
    leases.end_read(a)
    assert leases.reap() == [[1, 2]] and leases.start_read(a) is None
    now[0] = 30.0
    assert leases.start_read(b) is None, "an expired lease serves nothing"
    assert leases.reap() == [[3]] and len(leases) == 0
    assert not leases.release(12345), "an unknown lease is no lease"


@pytest.mark.task("L15.4")
def test_p_leases_a_finished_prompts_blocks_and_frees_them_once_released(pair, prompt_ids):
    p, _ = pair()
    before = p.allocator.num_free
    params = [leased(p, ids) for ids in prompt_ids[:2]]
    held = sum(len(x["remote_block_ids"]) for x in params)
    assert held and p.allocator.num_free == before - held, "the leased blocks are held, out of num_free"
    assert all(x["remote_block_ids"] == cached_prefix(p, ids, transferable(len(ids), S))[0]
               for x, ids in zip(params, prompt_ids)), "the lease names the prompt's cached full blocks"
    for x in params:
        p.producer.leases.release(x["remote_request_id"])
    p.step()  # P's engine thread frees between steps
    assert idle_problems(p) == []


@pytest.mark.task("L15.5")
def test_the_page_server_refuses_an_unknown_lease_in_one_message(pair):
    p, _ = pair()
    with socket.create_connection(p.producer.server.address, timeout=5) as conn:
        send(conn, "pull", struct.pack("<2q", 424242, 0), 2)
        kind, reason, _ = receive(conn, ("refused",), 0)
    assert kind == "refused" and b"no such lease" in reason


@pytest.mark.task("L15.6")
def test_d_pulls_only_the_blocks_its_cache_lacks(pair, prompt_ids, hf):
    p, d = pair()
    prompt = prompt_ids[0] + prompt_ids[1] + prompt_ids[0]  # 14 tokens: 3 blocks travel
    d.generate_batch([prompt[:2 * S + 1]], StopRule(1))  # D's cache holds the first 2 blocks
    tokens, loaded = decoded(d, prompt, leased(p, prompt))
    want = transferable(len(prompt), S)
    assert (loaded.hits, loaded.pulled) == (2, want - 2), loaded
    assert loaded.bytes == (want - 2) * d.consumer.layout.block_bytes
    assert tokens == hf.generate(prompt, STOP).tokens
    p.step()
    assert idle_problems(p) == [] and idle_problems(d) == []
    _, again = decoded(d, prompt, leased(p, prompt))  # D holds all 3 now: it pulls nothing, and still releases
    assert (again.hits, again.pulled) == (want, 0)
    p.step()
    assert idle_problems(p) == [] and idle_problems(d) == []


@pytest.mark.task("L15.6")
def test_no_room_on_d_is_backpressure_with_nothing_changed(pair, prompt_ids):
    p, d = pair(num_blocks=6)  # 6 usable (L7's dummy block is a seventh)
    prompt = prompt_ids[0] * 3  # 15 tokens: 3 blocks travel
    params = leased(p, prompt)
    d.add_request(list(range(40, 60)), StopRule(2))  # 20 tokens: 5 of D's 6 blocks held, 6 after its first token
    d.step()
    free, held = d.allocator.num_free, list(d.allocator.ref)
    with pytest.raises(NoRoom, match="free blocks, the pull needs 3"):
        d.consumer.load(prompt, params)
    assert (d.allocator.num_free, d.allocator.ref) == (free, held) and len(d.scheduler.waiting) == 0
    while d.scheduler.has_work():
        d.step()
    assert d.consumer.load(prompt, params).pulled == 3  # room again: the same params still pull (the lease holds)


@pytest.mark.task("L15.6")
def test_blocks_in_flight_enter_ds_cache_only_once_their_pages_have_landed(pair, prompt_ids):
    """start takes the blocks, pull fills them (on any thread), finish files them: a request admitted between start
    and finish (the server's engine thread goes on stepping) must not hit a block whose pages are not there yet."""
    p, d = pair()
    prompt = prompt_ids[0] + prompt_ids[1] + prompt_ids[0]  # 14 tokens: 3 blocks travel
    want = transferable(len(prompt), S)
    pending = d.consumer.start(prompt, leased(p, prompt))
    assert cached_prefix(d, prompt, want)[0] == [], (
        "a block taken for the pull is in D's prefix cache before its pages came: a request admitted now would "
        "attend to whatever the block held before")
    d.consumer.pull(pending)
    assert not pending.error and cached_prefix(d, prompt, want)[0] == [], (
        "the pull filed its blocks itself: filing is finish's, on the engine thread that owns the cache")
    loaded = d.consumer.finish(pending)
    assert loaded.pulled == want and cached_prefix(d, prompt, want)[0] == pending.fresh, (
        f"after finish D's cache must hold the {want} pulled blocks in the prompt's chain: {loaded}")
    settled(p)
    assert idle_problems(p) == [] and idle_problems(d) == []


@pytest.mark.task("L15.6")
def test_d_holds_its_own_hits_before_it_allocates_so_a_full_pool_evicts_none(pair, prompt_ids, hf):
    """D's pool has no free block, only cached ones, its own two hits the least recently used: the block the pull
    needs must be another cached block's. Allocating before taking the hits would evict a hit, break the prompt's
    chain in D's cache and pull pages the request's admission can no longer reach."""
    p, d = pair(num_blocks=6)  # 6 usable (L7's dummy block is a seventh)
    prompt = prompt_ids[0] + prompt_ids[1] + prompt_ids[0]  # 14 tokens: 3 blocks travel
    want = transferable(len(prompt), S)
    d.generate_batch([prompt[:2 * S + 1]], StopRule(1))  # the prompt's first 2 blocks cached: the oldest in the LRU
    d.generate_batch([list(range(60, 60 + S + 1))], StopRule(1))  # one more cached block, newer
    d.add_request(list(range(40, 40 + 3 * S - 1)), StopRule(2))  # 11 tokens: holds the 3 free blocks
    d.step()
    assert d.allocator.num_free == 3 and not d.allocator._free, "the setup: no free block, 3 cached ones"
    loaded = d.consumer.load(prompt, leased(p, prompt))
    assert (loaded.hits, loaded.pulled) == (2, want - 2), loaded
    assert len(cached_prefix(d, prompt, want)[0]) == want, (
        "D evicted a block it had just hit to make room for the pull: its cache no longer holds the prompt's "
        "chain, and the admission recomputes what was pulled (share the hits before allocating)")
    tokens = d.add_request(prompt, STOP)
    while d.scheduler.has_work():
        d.step()
    assert tokens.output_ids == hf.generate(prompt, STOP).tokens
    settled(p)
    assert idle_problems(p) == [] and idle_problems(d) == []


def refusing_server(send_blocks: int, layout: PageLayout | None) -> tuple[tuple[str, int], threading.Thread]:
    """A stand-in P that answers one pull with `layout` and `send_blocks` blocks of zeros, then hangs up: a prefill
    engine dying mid-transfer (or, with another layout, a different engine)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        with listener:
            conn, _ = listener.accept()
            with conn:
                receive(conn, ("pull",), 16)
                if layout is None:
                    return
                send(conn, "layout", struct.pack("<6q", *layout_ints(layout)), 99)
                for _ in range(send_blocks):
                    send(conn, "block", bytes(layout.block_bytes))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener.getsockname()[:2], thread


@pytest.mark.task("L15.6")
@pytest.mark.parametrize("how", ["p gone", "hangs up mid-transfer", "other engine", "lease expired"])
def test_a_failed_pull_recomputes_or_fails_and_leaks_nothing(tiny_model, prompt_ids, hf, how):
    prompt = prompt_ids[0] * 2
    now = [0.0]
    p, d = engines(tiny_model, connector_args={"lease_s": 30.0, "clock": lambda: now[0]})
    strict = L15Engine(tiny_model, S, kv_role="kv_consumer", connector_args={"policy": "fail"})
    try:
        params = dict(leased(p, prompt))
        if how == "p gone":
            p.close()
        elif how == "lease expired":
            now[0] = 30.0
        else:  # a stand-in P: it hangs up after one block, or it is another engine (the fingerprint differs)
            theirs = d.consumer.layout
            if how == "other engine":
                theirs = PageLayout(*layout_ints(theirs)[:-1], theirs.fingerprint ^ 1)
            (params["remote_host"], params["remote_port"]), _ = refusing_server(1, theirs)
        tokens, loaded = decoded(d, prompt, params)
        assert loaded.pulled == 0 and loaded.failed, loaded
        assert tokens == hf.generate(prompt, STOP).tokens, "policy recompute: the same tokens as HF"
        assert idle_problems(d) == []
        if how in ("p gone", "lease expired"):
            with pytest.raises(TransferFailed, match="failed"):
                strict.consumer.load(prompt, params)
            assert idle_problems(strict) == [] and not strict.scheduler.has_work()
        if how != "p gone":
            now[0] = 30.0  # nobody released: the lease runs out, and P's next step frees its blocks
            p.step()
            assert idle_problems(p) == [], "the lease ended: P freed the blocks"
    finally:
        p.close()


@pytest.mark.task("L15.6")
@pytest.mark.parametrize("params,message", [
    (None, "do_remote_prefill"),
    ({"do_remote_prefill": True, "remote_block_ids": "1,2"}, "list of block ids"),
    ({"do_remote_prefill": True, "remote_block_ids": [-1]}, "list of block ids"),
    ({"do_remote_prefill": True, "remote_block_ids": [1] * 9}, "at most 3"),
    ({"do_remote_prefill": True, "remote_block_ids": [1], "remote_request_id": "7"}, "remote_request_id"),
    ({"do_remote_prefill": True, "remote_block_ids": [1], "remote_request_id": 7, "remote_host": "h",
      "remote_port": True}, "remote_port"),
    ({"do_remote_prefill": True, "remote_block_ids": [1], "remote_request_id": 1 << 63, "remote_host": "h",
      "remote_port": 80}, "no lease P gives"),
    ({"do_remote_prefill": True, "remote_block_ids": [1], "remote_request_id": 7, "remote_host": "h",
      "remote_port": 70000}, "not a TCP port"),
])
def test_kv_transfer_params_are_checked_field_by_field_before_a_block_is_taken(tiny_model, params, message):
    d = L15Engine(tiny_model, S, 8, kv_role="kv_consumer")
    free = d.allocator.num_free
    with pytest.raises(CourseError, match=message):
        d.consumer.start(list(range(10, 23)), params)  # 13 tokens: at most 3 full blocks travel
    assert d.allocator.num_free == free, "D took blocks for a pull whose kv_transfer_params it then refused"


def test_an_unknown_role_and_a_lease_asked_of_a_colocated_engine_are_refused(tiny_model):
    """The engine's setup and request_finished, which no task stubs: outside the build track's tasks."""
    with pytest.raises(CourseError, match="unknown kv_role 'kv_prefill'"):
        L15Engine(tiny_model, S, kv_role="kv_prefill")
    with pytest.raises(CourseError, match="prefill engine's"):
        L15Engine(tiny_model, S).request_finished(None)


@pytest.mark.task("L15.7")
def test_add_remote_is_refused_where_it_does_not_belong_or_cannot_fit(tiny_model):
    with pytest.raises(CourseError, match="decode engine's"):
        L15Engine(tiny_model, S).add_remote([1, 2], STOP, {})
    d = L15Engine(tiny_model, S, 6, kv_role="kv_consumer")
    with pytest.raises(CourseError, match="needs 9 blocks of 4 tokens; the whole pool has 6"):
        d.add_remote(list(range(30)), STOP, {})  # never fits: refused before any pull
    with pytest.raises(CourseError, match="outside the vocabulary"):
        d.add_remote([10 ** 9], STOP, {})
    assert d.allocator.num_free == 6


@pytest.mark.task("L15.7")
def test_greedy_tokens_through_p_and_d_equal_hfs(pair, prompt_ids, hf):
    p, d = pair()
    run = run_disaggregated(p, d, prompt_ids, STOP)
    assert run.tokens == [hf.generate(ids, STOP).tokens for ids in prompt_ids]
    assert all(x.pulled == transferable(len(ids), S) for x, ids in zip(run.loads, prompt_ids))
    assert idle_problems(p) == [] and idle_problems(d) == []


@needs_kernel
@pytest.mark.task("L15.7")
@pytest.mark.parametrize("case", ["cold", "warm", "int8", "seeded n=2"])
def test_in_l14s_mode_d_continues_bitwise_where_a_colocated_engine_would(pair, tiny_model, prompt_ids, case):
    from lessons.l14_batch_invariant.record import first_difference, run_recorded

    options = {"kv_dtype": "int8"} if case == "int8" else {}
    recorded = {}
    if case == "seeded n=2":
        recorded = {"n": lambda i: 2, "sampling": lambda i: SamplingParams(temperature=0.8, seed=40 + 2 * i)}
    p, d = pair(invariant=True, **options)
    preamble = list(range(30, 30 + 2 * S))
    prompts = [preamble + ids for ids in prompt_ids]
    if case == "warm":
        d.generate_batch([preamble + [0]], StopRule(1))
    run = run_disaggregated(p, d, prompts, STOP, **recorded)
    alone = [run_recorded(L14Engine(tiny_model, S, batch_invariant=True, **options), [ids], STOP,
                          **{k: (lambda _, i=i, f=f: f(i)) for k, f in recorded.items()})
             for i, ids in enumerate(prompts)]
    want = [x for r in alone for x in r.logits]
    assert len(run.logits) == len(want)
    for i, (a, b) in enumerate(zip(run.logits, want)):
        assert first_difference(a, b) is None, f"{case}, output {i}: {first_difference(a, b)}"
    assert run.tokens == [t for r in alone for t in r.tokens]
    if case == "warm":
        assert all(x.hits == 2 for x in run.loads), "D's cache held the preamble: it pulls only the rest"
    assert idle_problems(p) == [] and idle_problems(d) == []
