"""L4 on the real (tiny) model: greedy parity with staggered arrivals, backpressure, a rejection mid-run,
stop token ids, and seeded sampling that is identical alone and in a crowd."""
import pytest

from conftest import assert_same_tokens
from lessons.l3_block_tensor import L3Engine
from lessons.l4_continuous import Arrival, L4Engine, SamplingParams
from lessons.l4_continuous.sequence import Status
from shared.errors import CourseError
from shared.generation import StopRule

NEW = 10


@pytest.fixture(scope="module")
def stop(tiny_model) -> StopRule:
    return StopRule(NEW, frozenset(tiny_model.config.eos_token_ids), ignore_eos=True)


@pytest.mark.task("L4.7")
@pytest.mark.parametrize("block_size,stagger,max_running", [(16, 3, 64), (7, 1, 2), (1, 0, 3)])
def test_staggered_arrivals_match_hf_alone_and_l3(tiny_model, hf, prompt_ids, stop, block_size, stagger, max_running):
    engine = L4Engine(tiny_model, block_size, max_running=max_running, backend="torch")
    got = engine.generate_batch(prompt_ids, stop, stagger=stagger)
    assert len(got) == len(prompt_ids), f"{len(prompt_ids)} requests in, {len(got)} outputs back"
    for i, p in enumerate(prompt_ids):
        assert_same_tokens(got[i], hf.generate(p, stop).tokens, f"request {i}, arriving at step {stagger * i}")
    assert got == L3Engine(tiny_model, block_size, backend="torch").generate_batch(prompt_ids, stop)
    assert engine.allocator.num_free == engine.allocator.num_blocks, (
        f"{engine.allocator.num_blocks - engine.allocator.num_free} blocks were never freed")
    assert engine.stats.peak_running <= max_running


def test_backpressure_in_a_small_pool_keeps_parity(tiny_model, hf, prompt_ids, stop):
    long_need = -(-(len(prompt_ids[-1]) + NEW - 1) // 8)
    engine = L4Engine(tiny_model, 8, num_blocks=long_need + 1, backend="torch")  # the long prompt runs alone
    got = engine.generate_batch(prompt_ids[::-1], stop)
    assert got == [hf.generate(p, stop).tokens for p in prompt_ids[::-1]]
    assert engine.stats.peak_running < len(prompt_ids)


def test_a_request_rejected_mid_run_leaves_the_others_intact(tiny_model, hf, prompt_ids, stop):
    engine = L4Engine(tiny_model, 4, num_blocks=12, backend="torch")
    vocab = tiny_model.config.vocab_size
    a = engine.add_request(prompt_ids[0], stop)
    engine.step()
    engine.step()
    free, waiting = engine.allocator.num_free, list(engine.scheduler.waiting)
    bad = [
        lambda: engine.add_request(prompt_ids[-1], stop),  # larger than the whole pool
        lambda: engine.add_request([], stop),  # empty prompt
        lambda: engine.add_request([1] * 4090, StopRule(10)),  # beyond the model's 4096 positions
        lambda: engine.add_request(prompt_ids[1], StopRule(0)),  # max tokens < 1 (StopRule itself refuses)
        lambda: engine.add_request([vocab, *prompt_ids[1]], stop),  # would fail every later forward
        lambda: engine.add_request([-1, *prompt_ids[1]], stop),
        lambda: engine.add_request(prompt_ids[1], stop, SamplingParams(stop_token_ids=frozenset({vocab}))),
    ]
    for call in bad:
        with pytest.raises(CourseError):
            call()
        assert engine.allocator.num_free == free and list(engine.scheduler.waiting) == waiting
    b = engine.add_request(prompt_ids[1], stop)
    while engine.scheduler.has_work():
        engine.step()
    assert a.output_ids == hf.generate(prompt_ids[0], stop).tokens
    assert b.output_ids == hf.generate(prompt_ids[1], stop).tokens
    assert [a.seq_id, b.seq_id] == [0, 1]  # rejected requests did not even take an id


@pytest.mark.task("L4.7")
def test_stop_token_ids_and_eos_stop_early_and_keep_the_token(tiny_model, hf, prompt_ids, stop):
    free_run = hf.generate(prompt_ids[0], stop).tokens
    target = free_run[3]
    cut = free_run[: free_run.index(target) + 1]
    engine = L4Engine(tiny_model, backend="torch")
    by_stop_id = engine.run([Arrival(prompt_ids[0], stop, SamplingParams(stop_token_ids=frozenset({target})))])[0]
    by_eos = engine.run([Arrival(prompt_ids[0], StopRule(NEW, frozenset({target})))])[0]
    assert by_stop_id == cut and by_eos == cut


@pytest.mark.task("L4.7")
def test_seeded_sampling_is_the_same_alone_and_in_a_crowd(tiny_model, prompt_ids, stop):
    params = [SamplingParams(0.8, 0, 0.95, seed=11), SamplingParams(1.2, 40, 1.0, seed=12), SamplingParams(1.0, seed=13)]
    prompts = prompt_ids[:3]
    alone = [L4Engine(tiny_model, backend="torch").run([Arrival(p, stop, s)])[0] for p, s in zip(prompts, params)]
    crowd = [Arrival(p, stop, s, step=2 * i) for i, (p, s) in enumerate(zip(prompts, params))]
    crowd += [Arrival(p, stop, SamplingParams(0.7), step=i) for i, p in enumerate(prompt_ids)]  # unseeded companions
    together = L4Engine(tiny_model, 4, max_running=5, backend="torch").run(crowd)
    for i, (got, want) in enumerate(zip(together, alone)):
        assert got == want, (f"seeded request {i} (seed {params[i].seed}) sampled {got} among 6 others, {want} alone: "
                             "each sampled row must draw from its own request's generator (Sequence.generator)")
    greedy = [L4Engine(tiny_model, backend="torch").run([Arrival(p, stop)])[0] for p in prompts]
    assert alone != greedy, "sampled requests gave the greedy tokens: sampling fell back to argmax"


def test_the_benchmarks_hf_row_gives_each_request_its_own_max_new_tokens(tiny_dir):
    """HF's generate_batch takes one max_new_tokens for every request (docs/l4_continuous.md's pitfall): the
    benchmark drives its manager and hands each add_request its own."""
    import sys
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    scripts = Path(__file__).resolve().parents[1] / "scripts"
    sys.path[:0] = [p for p in (str(scripts), str(scripts / "benchmark")) if p not in sys.path]
    from bench_systems import Job, hf_continuous

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)  # not hf's: the manager rewires it
    jobs = [Job(list(range(100 + 10 * i, 105 + 10 * i)), n) for i, n in enumerate((5, 9, 3, 7))]
    result = hf_continuous(model, jobs, 16, 64, 4, lambda done: None)
    assert result.error is None, f"HF's continuous batching failed: {result.error}"
    assert result.output_tokens == 24, (
        f"requests asking for 5, 9, 3 and 7 tokens came back with {result.output_tokens} in all, not 24: each "
        "add_request needs its own max_new_tokens")


@pytest.mark.task("L4.7")
def test_finished_requests_are_retired_in_the_same_step(tiny_model, prompt_ids):
    engine = L4Engine(tiny_model, 4, backend="torch")
    short = engine.add_request(prompt_ids[1], StopRule(1))
    other = engine.add_request(prompt_ids[0], StopRule(5))
    engine.step()
    assert short.status is Status.FINISHED and short.blocks == [], "a request finished in a step is retired in that step"
    assert engine.scheduler.running == [other]
