"""L6's fair sharing as exact schedules on the fake runner (tests/fake_runner.py), every step through
test_l6_scheduler.Ledger (statistics against what the runner was fed) and check_shared_pool:
  - n > 1 siblings count against max_running: those without a slot at the fork queue in their arrival
    place, holding nothing, and are admitted like any request, hitting what their parent cached;
  - three and four requests with one prompt, submitted together: each after the first waits for the
    blocks in flight and hits them.
"""
import pytest

from fake_runner import FakeRunner, fake_model, reference
from lessons.l4_continuous.engine import Arrival
from lessons.l4_continuous.sampling import SamplingParams
from lessons.l4_continuous.sequence import Status
from lessons.l6_prefix_sharing import L6Engine
from shared.generation import StopRule
from test_l6_scheduler import Ledger, check_shared_pool, solo


def run_to_end(e: L6Engine, ledger: Ledger) -> list[int]:
    """Steps until done; returns how many ran after each step."""
    running = []
    for _ in range(1_000):
        if not e.scheduler.has_work():
            ledger.check_totals()
            return running
        ledger.step()
        check_shared_pool(e)
        running.append(len(e.scheduler.running))
    raise AssertionError("the engine did not finish: a hang")


def test_siblings_without_a_slot_queue_and_hit_their_parents_blocks():
    """S = 2, max_running 2. A = 5 tokens with n = 4 samples of 6 tokens; B = 3 tokens, 4 new; both at
    clock 0. Step 1: A and B prefill; A forks, and with A and B running no slot is free: its 3 siblings
    queue. B finishes in step 4 (4 tokens): sibling 1 is admitted in step 5 with A's 2 full prompt blocks
    as hits (4 cached, 1 computed) and samples its first token itself. A and sibling 1 finish in steps 6
    and 10: siblings 2 and 3 follow in steps 7 and 11, each with the same 2 hits. (Before: all four
    samples and B ran at once, 5 running.)"""
    e = L6Engine(fake_model(), 2, 32, max_running=2, runner=FakeRunner(2, 32))
    ledger = Ledger(e)
    a = Arrival([1, 2, 3, 4, 5], StopRule(6), SamplingParams(1.0, seed=9))
    group = e.add_parallel(a.prompt_ids, a.stop, a.sampling, n=4)
    b = e.add_request([7, 8, 9], StopRule(4))
    ledger.step()
    assert [s.status for s in group] == [Status.RUNNING] + [Status.WAITING] * 3
    assert list(e.scheduler.waiting) == group[1:] and all(s.blocks == [] for s in group[1:])
    running = run_to_end(e, ledger)
    assert max(running) == 2
    assert [s.admitted_at for s in group] == [1, 5, 7, 11] and b.admitted_at == 1
    assert (e.stats.prompt_tokens, e.stats.cached_tokens, e.stats.prefill_tokens) == (5 * 4 + 3, 4 * 3, 5 + 3 + 3)
    assert [s.output_ids for s in group] == [solo(a, 9 + i) for i in range(4)]
    assert b.output_ids == reference([7, 8, 9], 4)


@pytest.mark.parametrize("copies", [3, 4])
def test_several_requests_with_one_prompt_compute_it_once(copies):
    """S = 4: `copies` requests with the same 22-token prompt, submitted together. Step 1 admits the first
    alone: its forward fills all 5 full blocks, so every later one finds its first block in flight and
    waits. Step 2 admits them all, each with (22 - 1) // 4 = 5 hits: 20 cached, 2 computed."""
    e = L6Engine(fake_model(), 4, 64, max_running=copies, runner=FakeRunner(4, 64))
    ledger = Ledger(e)
    prompt = list(range(5, 27))
    seqs = [e.add_request(prompt, StopRule(3)) for _ in range(copies)]
    run_to_end(e, ledger)
    assert [s.admitted_at for s in seqs] == [1] + [2] * (copies - 1)
    assert (e.stats.prompt_tokens, e.stats.cached_tokens, e.stats.prefill_tokens) == (
        22 * copies, 20 * (copies - 1), 22 + 2 * (copies - 1))
    # The prompt's 5 full blocks and a 6th (2 prompt tokens and 2 greedy ones, the same in every copy), each
    # cached once: one copy of the prefix was computed.
    assert len(e.cache) == 6
    assert all(s.output_ids == reference(prompt, 3) for s in seqs)
