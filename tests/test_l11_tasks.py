"""L11's build-track tests for the verify slice, the draft room and the rollback (scripts/course.py check L11), each
on its own: a hand-made request and pool, no engine step. The n-gram drafter's, the verify rules', the engine's
and the draft model's task tests are in test_l11_drafters.py, test_l11_verify.py, test_l11_replay.py and
test_l11_pinned.py."""
import pytest

from lessons.l6_prefix_sharing.block_manager import RefBlockManager
from lessons.l6_prefix_sharing.prefix_cache import PrefixCache
from lessons.l6_prefix_sharing.sequence import SharedSequence
from lessons.l6_prefix_sharing.stats import PrefixStats
from lessons.l8_chunked_prefill.slice import Slice
from lessons.l9_server.engine import L9Engine
from lessons.l11_speculative.scheduler import SpecScheduler
from lessons.l11_speculative.slice import VerifySlice
from shared.generation import StopRule

K = 4
BLOCK = 4
PROMPT = [10, 20, 30, 40, 50]


def decoding(output: list[int], manager: RefBlockManager, max_new: int = 16) -> SharedSequence:
    """A running request between steps: PROMPT + `output`, every token but the last in the pool."""
    seq = SharedSequence(list(PROMPT), BLOCK, output_ids=list(output), stop=StopRule(max_new, ignore_eos=True))
    seq.reserve(seq.num_tokens, manager)
    seq.num_cached = seq.num_tokens - 1
    return seq


def pool(num_blocks: int) -> tuple[RefBlockManager, SpecScheduler]:
    stats = PrefixStats()
    manager = RefBlockManager(num_blocks, PrefixCache(), stats)
    return manager, SpecScheduler(manager, BLOCK, 8, stats, num_speculative_tokens=K)


@pytest.mark.task("L11.4")
def test_a_verify_slice_feeds_the_last_token_then_the_drafts():
    manager, _ = pool(8)
    seq = decoding([60], manager)  # n = 6 tokens, positions 0 .. 4 in the pool
    piece = Slice.of(seq, 1, decode=True)
    drafts = [71, 72, 73, 74]
    view = VerifySlice.of_decode(piece, drafts)
    assert (view.num_cached, view.num_tokens) == (5, 10), (
        f"the verify slice should feed positions 5 .. 9 (num_cached 5, end n + k = 10), got num_cached "
        f"{view.num_cached}, end {view.num_tokens}")
    assert view.decode and view.seq is seq and view.samples, "a verify slice is a decode of `seq` that samples"
    assert view.blocks is seq.blocks, "the verify slice reads the request's own block table, not a copy"
    assert view.drafts == drafts, f"the slice's drafts should be {drafts}, got {view.drafts}"
    fed = view.token_ids(view.num_cached, view.num_tokens)
    assert fed == [60, 71, 72, 73, 74], f"positions 5 .. 9 should feed token 60 then the drafts, got {fed}"
    for start, end, want in ((0, 3, [10, 20, 30]), (4, 7, [50, 60, 71]), (7, 9, [72, 73]), (6, 10, drafts)):
        got = view.token_ids(start, end)
        assert got == want, f"token_ids({start}, {end}) should be {want} (prompt, output, then drafts), got {got}"
    drafts.append(99)
    assert view.drafts == [71, 72, 73, 74], "of_decode must keep a copy of the drafts it was given"
    assert seq.output_ids == [60] and seq.num_tokens == 6, "a draft never enters the request's own token lists"
    assert VerifySlice.of_decode(piece, []).num_tokens == 6, "with no drafts the verify slice is the plain decode"


@pytest.mark.task("L11.4")
def test_l8s_runner_scores_every_row_of_a_verify_slice_as_the_target_would(tiny_model):
    """The target's own greedy continuation as drafts: row j of the verify forward is the target's choice for
    position n + j, so the k + 1 rows' argmax is the next k + 1 tokens of the output."""
    stop = StopRule(8, ignore_eos=True)
    want = L9Engine(tiny_model, BLOCK, backend="torch").generate_batch([PROMPT], stop)[0]
    engine = L9Engine(tiny_model, BLOCK, backend="torch")
    seq = engine.add_request(PROMPT, stop)
    engine.step()  # the prompt: output [want[0]]; positions 0 .. 4 in the pool
    seq.reserve(seq.num_tokens + K, engine.allocator)
    view = VerifySlice.of_decode(Slice.of(seq, 1, decode=True), want[1:1 + K])
    logits = engine.runner.forward([view])
    assert tuple(logits.shape) == (K + 1, tiny_model.config.vocab_size), (
        f"a verify slice with {K} drafts should get {K + 1} rows of logits, got {tuple(logits.shape)}")
    got = logits.argmax(dim=-1).tolist()
    assert got == want[1:K + 2], f"rows 0 .. {K} should choose the target's next tokens {want[1:K + 2]}, got {got}"


@pytest.mark.task("L11.5")
def test_draft_room_takes_what_budget_max_tokens_and_free_blocks_leave():
    manager, scheduler = pool(8)
    seq = decoding([60], manager)  # n = 6 in blocks [0 1]
    scheduler.budget = 100
    k = scheduler.draft_room(Slice.of(seq, 1, decode=True))
    assert k == K, f"budget, max_tokens and blocks to spare: the decode may carry K = {K} drafts, got {k}"
    assert len(seq.blocks) == 3, f"positions 0 .. 9 need 3 blocks of {BLOCK} reserved, the table has {len(seq.blocks)}"
    assert scheduler.budget == 100 - K, f"{K} drafts cost {K} tokens of the budget: 100 -> {100 - K}, got {scheduler.budget}"

    manager, scheduler = pool(8)
    seq = decoding([60], manager)
    scheduler.budget = 2
    k = scheduler.draft_room(Slice.of(seq, 1, decode=True))
    assert (k, scheduler.budget, len(seq.blocks)) == (2, 0, 2), (
        f"2 tokens of budget left: 2 drafts, budget 0, the table still 2 blocks (positions up to 7); got {k} "
        f"drafts, budget {scheduler.budget}, {len(seq.blocks)} blocks")

    manager, scheduler = pool(8)
    seq = decoding([60], manager, max_new=3)
    scheduler.budget = 100
    k = scheduler.draft_room(Slice.of(seq, 1, decode=True))
    assert k == 1, f"max_tokens 3 with 1 output: 3 - 1 - 1 = 1 draft (the target's own token follows), got {k}"

    manager, scheduler = pool(8)
    seq = decoding([60], manager)
    scheduler.budget = 0
    k = scheduler.draft_room(Slice.of(seq, 1, decode=True))
    assert (k, len(seq.blocks), manager.num_free) == (0, 2, 6), (
        f"no budget left: no drafts and nothing reserved; got {k} drafts, {len(seq.blocks)} blocks, "
        f"{manager.num_free} free")


@pytest.mark.task("L11.5")
def test_draft_room_never_evicts_a_cached_prefix_block():
    """A 4-block pool whose only free blocks are cached prefix blocks nobody holds: the drafts get only the room
    left in the request's own 2 blocks (2 * 4 - 6 = 2 positions), and the cache keeps both entries."""
    manager, scheduler = pool(4)
    other = SharedSequence([1, 2, 3, 4, 5, 6, 7, 8], BLOCK)
    other.reserve(8, manager)
    for i, block in enumerate(other.blocks):
        parent = manager.cache.ident(other.blocks[i - 1]) if i else None
        manager.cache.register(block, 1000 + i, parent, tuple(other.prompt_ids[BLOCK * i:BLOCK * (i + 1)]))
    manager.free(other.blocks)  # cached, unheld: on the LRU
    seq = decoding([60], manager)
    assert manager.num_free == manager.num_cached_unheld == 2
    entries = dict(manager.cache.entry)
    scheduler.budget = 100
    k = scheduler.draft_room(Slice.of(seq, 1, decode=True))
    assert k == 2, (f"the only free blocks are cached prefixes: room for 2 drafts in the request's own blocks "
                    f"(2 * {BLOCK} - 6), got {k}")
    assert manager.cache.entry == entries and manager.stats.evictions == 0, (
        f"a draft evicted a cached prefix block: entries {entries} -> {manager.cache.entry}")
    assert len(seq.blocks) == 2, f"no block should join the table, it has {len(seq.blocks)}"


@pytest.mark.task("L11.6")
def test_roll_back_keeps_the_committed_history_and_frees_blocks_past_it():
    manager, scheduler = pool(8)
    seq = decoding([60], manager)  # n = 6
    seq.reserve(10, manager)  # room for 4 drafts: blocks [0 1 2]
    seq.num_cached = 10  # the verify forward wrote positions 5 .. 9
    table = seq.blocks
    seq.output_ids += [61, 62]  # kept: 1 draft + the target's own token; the last is fed next step
    scheduler.roll_back(seq, seq.num_tokens)  # end = 8
    assert seq.num_cached == 7, f"end 8: positions 0 .. 6 hold committed tokens, num_cached 7, got {seq.num_cached}"
    assert seq.blocks == [0, 1], f"positions 0 .. 7 need blocks [0 1]; the table is {seq.blocks}"
    assert manager.ref[2] == 0 and manager.num_free == 6, (
        f"block 2 held only rejected drafts and must go back to the pool (ref {manager.ref[2]}, "
        f"{manager.num_free} free, want 6)")
    assert table == [0, 1, 2] and seq.blocks is not table, "cut the table into a new list, never in place"

    manager, scheduler = pool(8)
    seq = decoding([60], manager)
    seq.reserve(10, manager)
    seq.num_cached = 10
    seq.output_ids += [61, 62, 63]  # end 9: block 2 holds position 8, a committed token
    scheduler.roll_back(seq, seq.num_tokens)
    assert (seq.num_cached, seq.blocks, manager.num_free) == (8, [0, 1, 2], 5), (
        f"end 9: num_cached 8, blocks [0 1 2] kept, 5 free; got num_cached {seq.num_cached}, blocks "
        f"{seq.blocks}, {manager.num_free} free")

    manager, scheduler = pool(8)
    seq = decoding([60], manager)
    seq.reserve(16, manager)  # 4 blocks
    seq.num_cached = 16
    scheduler.roll_back(seq, 6)  # every draft rejected
    assert (seq.num_cached, seq.blocks, manager.num_free) == (5, [0, 1], 6), (
        f"end 6: num_cached 5, blocks [0 1], blocks 2 and 3 freed (6 free); got num_cached {seq.num_cached}, "
        f"blocks {seq.blocks}, {manager.num_free} free")
