"""L4's build-track tests (scripts/course.py check L4) where no existing test fits: the kept table tensor, a
request's worst case, and the scheduler driven by hand on the fake runner (tests/fake_runner.py), before the
engine's step exists. The sampler's tests are in test_l4_sampler.py, the engine's in test_l4_scheduler.py and
test_l4_parity.py."""
import pytest
import torch

from fake_runner import FakeRunner, reference
from lessons.l2_token_flat.block_allocator import BlockAllocator
from lessons.l4_continuous.sampling import SamplingParams, pick, sample_row
from lessons.l4_continuous.scheduler import Scheduler
from lessons.l4_continuous.sequence import Sequence, Status
from lessons.l4_continuous.table_tensor import TableTensor
from shared.errors import PoolExhausted
from shared.generation import StopRule


class CountingList(list):
    """A block table that counts the entries read through indexing and slicing."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read = 0

    def __getitem__(self, i):
        out = super().__getitem__(i)
        self.read += len(out) if isinstance(i, slice) else 1
        return out


@pytest.mark.task("L4.1")
def test_the_table_tensor_is_the_block_table_as_int32():
    table, blocks = TableTensor(), []
    for step, block in enumerate([7, 3, 11, 0, 5, 9, 2, 14, 1, 6] * 4):  # 40 appends: past the first capacity
        blocks.append(block)
        for n in {1, len(blocks) // 2, len(blocks)} - {0}:
            got = table.first(blocks, n)
            assert got.dtype == torch.int32, f"first() returned {got.dtype}, want int32 (BatchMeta's kv_indices)"
            assert got.tolist() == blocks[:n], (
                f"after {step + 1} appends, first(blocks, {n}) is {got.tolist()}, want {blocks[:n]}")
    replaced = [100 + b for b in blocks]  # a new list (admission, preemption, retirement assign one): copied whole
    assert table.first(replaced, 20).tolist() == replaced[:20], (
        "a new block table list must be copied afresh, not mixed with the old")


@pytest.mark.task("L4.1")
def test_a_step_copies_only_the_entries_appended_since_the_last():
    table, blocks = TableTensor(), CountingList()
    for i in range(300):
        blocks.append(i % 97)
        assert table.first(blocks, len(blocks)).tolist()[-1] == i % 97, f"entry {i} is wrong after its append"
    assert blocks.read <= 4 * 300, (
        f"300 calls, one append before each, read {blocks.read} entries of the table: a kept tensor reads about "
        "one new entry per call, converting the whole table every call reads about 45,000")


@pytest.mark.task("L4.2")
@pytest.mark.parametrize("prompt,max_new,s,want_fed,want_blocks",
                         [(6, 5, 4, 10, 3), (3, 6, 4, 8, 2), (9, 4, 4, 12, 3), (2, 2, 4, 3, 1), (1, 1, 1, 1, 1),
                          (5, 8, 16, 12, 1)])
def test_max_blocks_counts_every_token_ever_fed(prompt, max_new, s, want_fed, want_blocks):
    seq = Sequence(list(range(prompt)), s, stop=StopRule(max_new))
    assert seq.max_tokens_fed == want_fed, (f"prompt {prompt} + max_new {max_new}: {want_fed} tokens are ever fed (the "
                                            f"last token is sampled, never fed), got {seq.max_tokens_fed}")
    assert seq.max_blocks == want_blocks, (
        f"{want_fed} tokens in blocks of {s} need {want_blocks} blocks, got {seq.max_blocks}")


@pytest.mark.task("L4.2")
def test_a_request_finishes_on_its_stop_rule_or_a_stop_token_id():
    def finished(outputs, stop, stop_ids=frozenset()):
        seq = Sequence([1, 2], 4, stop=stop, sampling=SamplingParams(stop_token_ids=stop_ids))
        seq.output_ids = list(outputs)
        return seq.is_finished()

    assert not finished([5], StopRule(3)), "1 of 3 new tokens, no stop token: not finished"
    assert finished([5, 6, 8], StopRule(3)), "3 of max_new_tokens 3: finished"
    assert finished([5, 7], StopRule(3, frozenset({7}))), "an EOS id ends the request (and is kept)"
    assert not finished([5, 7], StopRule(3, frozenset({7}), ignore_eos=True)), "ignore_eos: EOS does not stop it"
    assert finished([5, 9], StopRule(3, ignore_eos=True), frozenset({9})), "a stop_token_id ends it, even with ignore_eos"


def seq(seq_id: int, prompt: int, max_new: int, s: int = 4) -> Sequence:
    return Sequence(list(range(1, prompt + 1)), s, seq_id=seq_id, stop=StopRule(max_new))


def ids(seqs) -> list[int]:
    return [s.seq_id for s in seqs]


@pytest.mark.task("L4.3")
def test_admission_is_fifo_on_a_promise():
    # docs/l4_continuous.md's worked example: N = 8 blocks of S = 4. A (6 prompt, 5 new -> 3 blocks),
    # B (3, 6 -> 2) arrive first; C (9, 4 -> 3), D (2, 2 -> 1) later.
    sched = Scheduler(BlockAllocator(8), 4, max_running=64)
    a, b, c, d = seq(0, 6, 5), seq(1, 3, 6), seq(2, 9, 4), seq(3, 2, 2)
    sched.add(a)
    sched.add(b)
    sched.admit()
    assert ids(sched.running) == [0, 1], f"A and B (promises 3 + 2 <= 8) should run, running is {ids(sched.running)}"
    for s, blocks in ((a, 2), (b, 1)):
        assert len(s.blocks) == blocks, (
            f"request {s.seq_id} is admitted with its prompt's {blocks} block(s), holds {s.blocks}")
        assert s.status is Status.RUNNING and s.admitted_at == sched.step_no, (
            f"request {s.seq_id}: status RUNNING, admitted_at the step")
    sched.add(c)
    sched.add(d)
    sched.admit()
    assert ids(sched.running) == [0, 1, 2] and ids(sched.waiting) == [3], (
        f"C's promise fits (3 + 2 + 3 = 8), then D's does not (8 + 1 > 8) although blocks are free: running "
        f"{ids(sched.running)}, waiting {ids(sched.waiting)}; want [0, 1, 2] and [3]")
    assert d.blocks == [] and d.status is Status.WAITING, "a request left waiting holds no blocks"
    assert sched.allocator.num_free == 8 - 2 - 1 - 3, "admission allocates the prompt's blocks only, not the promise"


@pytest.mark.task("L4.3")
def test_the_head_of_the_line_blocks_younger_requests():
    sched = Scheduler(BlockAllocator(8), 4, max_running=64)
    sched.add(seq(0, 20, 5))  # 24 tokens fed: 6 blocks
    sched.add(seq(1, 9, 4))  # 3 blocks: 6 + 3 > 8
    sched.add(seq(2, 1, 1))  # 1 block: would fit, but arrived after the head
    sched.admit()
    assert ids(sched.running) == [0] and ids(sched.waiting) == [1, 2], (
        f"FIFO: request 2 must not overtake request 1, which waits; running {ids(sched.running)}, "
        f"waiting {ids(sched.waiting)}")


@pytest.mark.task("L4.3")
def test_max_running_caps_admission():
    sched = Scheduler(BlockAllocator(100), 4, max_running=2)
    for i in range(5):
        sched.add(seq(i, 1, 5))
    sched.admit()
    assert ids(sched.running) == [0, 1] and ids(sched.waiting) == [2, 3, 4], (
        f"max_running 2: running {ids(sched.running)}, waiting {ids(sched.waiting)}")


@pytest.mark.task("L4.4")
def test_steps_by_hand_follow_the_doc_example():
    """The doc's table: blocks held per request in each step's batch, and who finishes in it."""
    runner = FakeRunner(4, 8)
    sched = Scheduler(runner.allocator, 4, max_running=64)
    a, b, c, d = seq(0, 6, 5), seq(1, 3, 6), seq(2, 9, 4), seq(3, 2, 2)
    arrivals = {1: [a, b], 2: [c, d]}
    held, done = [], []
    for step in range(1, 8):
        for s in arrivals.get(step, []):
            sched.add(s)
        try:
            batch = sched.schedule()
        except PoolExhausted:
            pytest.fail(f"step {step}: schedule() found the pool empty ({runner.allocator.num_free} of 8 free) with "
                        f"{done} finished so far: a finished request's blocks go back to the allocator at once")
        logits = runner.forward(batch)
        held.append({"ABCD"[s.seq_id]: len(s.blocks) for s in batch})
        finished = sched.postprocess(batch, logits.argmax(dim=-1).tolist())
        done.append("".join("ABCD"[s.seq_id] for s in finished))
        for s in finished:
            assert s.status is Status.FINISHED and s.blocks == [], (
                f"step {step}: request {'ABCD'[s.seq_id]} finished but holds {s.blocks}")
            assert s not in sched.running, f"step {step}: finished request {'ABCD'[s.seq_id]} is still running"
    want_held = [{"A": 2, "B": 1}, {"A": 2, "B": 1, "C": 3}, {"A": 2, "B": 2, "C": 3}, {"A": 3, "B": 2, "C": 3},
                 {"A": 3, "B": 2, "C": 3}, {"B": 2, "D": 1}, {"D": 1}]
    for step, (got, want) in enumerate(zip(held, want_held), start=1):
        assert got == want, f"step {step}: the batch holds {got} blocks per request, the doc's table says {want}"
    assert done == ["", "", "", "", "AC", "B", "D"], f"requests finished per step: {done}; want A, C at 5, B at 6, D at 7"
    for s, (prompt, max_new) in zip((a, b, c, d), ((6, 5), (3, 6), (9, 4), (2, 2))):
        assert s.output_ids == reference(list(range(1, prompt + 1)), max_new), f"request {'ABCD'[s.seq_id]}'s tokens"
    assert runner.allocator.num_free == 8 and not sched.has_work(), (
        "after the last step the pool is whole and the queues empty")


@pytest.mark.task("L4.6")
def test_pick_walks_the_cdf_in_token_id_order():
    probs, token_ids = torch.tensor([0.2, 0.5, 0.3]), torch.tensor([3, 5, 9])  # CDF 0.2, 0.7, 1.0
    for u, want in ((0.0, 3), (0.19, 3), (0.2, 5), (0.69, 5), (0.71, 9), (0.999, 9)):
        got = pick(probs, token_ids, torch.tensor([u]))
        assert got == want, f"u = {u}: the first kept token whose cumulative mass exceeds u is {want}, got {got}"
    with pytest.raises(ValueError):
        sample_row(torch.randn(10), SamplingParams(temperature=1.0), None)  # a sampled row needs its own generator
