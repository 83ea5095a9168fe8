"""The benchmark's workload and the systems it runs through: HF generate (alone / padded static batches),
HF's own continuous batching (generate_batch's manager), and the course's L3, L4, L5 and L6 engines.

Every system gets the same requests (prompt token IDs, exact output length, greedy, EOS ignored) and
reports the same record, so one table can compare them. Only output tokens a request asked for count:
a padded static batch that runs a short request to its batch's longest length gets no credit for it.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from harness import backend_name

from lessons.l3_block_tensor import L3Engine
from lessons.l4_continuous import L4Engine
from lessons.l4_continuous.stats import EngineStats
from lessons.l5_preemption import L5Engine
from lessons.l6_prefix_sharing import L6Engine
from shared.generation import StopRule
from shared.tiny_qwen3 import cache_root

Progress = Callable[[int], None]  # called with the number of requests just finished


@dataclass(frozen=True)
class Job:
    prompt_ids: list[int]
    new_tokens: int


@dataclass
class Result:
    system: str
    seconds: float = 0.0
    output_tokens: int = 0
    util_mean: float | None = None  # KV tokens held / slots reserved, mean over steps
    util_peak: float | None = None  # the same ratio at the step that reserved the most
    peak_running: int | None = None
    preemptions: int | None = None
    prefill_tokens: int | None = None  # tokens computed outside decode (prefills and re-prefills)
    cached_tokens: int | None = None  # L6: prompt tokens served from the prefix cache
    error: str | None = None
    timeline: list[dict[int, int]] | None = None  # L4 / L5 with --plot: per step, seq_id -> blocks held
    backend: str | None = None  # the attention backend the course's engine really used (harness.backend_name)
    notes: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds and not self.error else 0.0


def make_workload(n: int, prompt_len: tuple[int, int], new_tokens: tuple[int, int], vocab: int, seed: int) -> list[Job]:
    rng, tokens = random.Random(seed), random.Random(seed + 1)  # lengths must not depend on the vocab
    top = min(vocab, 151643)  # ordinary tokens only: no special ids in the prompts
    lengths = [(rng.randint(*prompt_len), rng.randint(*new_tokens)) for _ in range(n)]
    return [Job([tokens.randrange(top) for _ in range(p)], o) for p, o in lengths]


def make_shared_prefix_workload(n: int, prefix_len: int, unique_len: tuple[int, int], new_tokens: tuple[int, int],
                                vocab: int, seed: int) -> list[Job]:
    """n requests that start with one system prompt of prefix_len tokens, then unique_len tokens of their own."""
    rng, tokens = random.Random(seed), random.Random(seed + 1)
    top = min(vocab, 151643)
    system = [tokens.randrange(top) for _ in range(prefix_len)]
    lengths = [(rng.randint(*unique_len), rng.randint(*new_tokens)) for _ in range(n)]
    return [Job(system + [tokens.randrange(top) for _ in range(u)], o) for u, o in lengths]


def count_prefill(runner) -> list[int]:
    """Wrap a paged runner's forward to count prefill tokens the same way for every lesson: a request fed
    right where its last forward left it is decoding; every other token fed is prefill work."""
    forward, last, total = runner.forward, {}, [0]

    def counted(requests):
        for r in requests:
            if last.get(id(r)) != r.num_cached:
                total[0] += r.num_tokens - r.num_cached
        logits = forward(requests)
        for r in requests:
            last[id(r)] = r.num_cached
        return logits

    runner.forward = counted
    return total


def stop_for(job: Job) -> StopRule:
    return StopRule(job.new_tokens, frozenset(), ignore_eos=True)


def hf_single(hf_model, jobs: list[Job], progress: Progress) -> Result:
    r = Result(f"HF generate, one at a time ({len(jobs)} requests)", peak_running=1)
    t0 = time.perf_counter()
    for job in jobs:
        ids = torch.tensor([job.prompt_ids], device=hf_model.device)
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=job.new_tokens,
                                min_new_tokens=job.new_tokens, eos_token_id=None, pad_token_id=0)
        r.output_tokens += out.shape[1] - ids.shape[1]
        progress(1)
    r.seconds = time.perf_counter() - t0
    return r


def hf_static(hf_model, jobs: list[Job], batch: int, progress: Progress) -> Result:
    """Left-padded static batches in arrival order; each batch runs to its longest request."""
    r = Result(f"HF generate, static batches of {batch}", peak_running=batch)
    t0 = time.perf_counter()
    for i in range(0, len(jobs), batch):
        group = jobs[i:i + batch]
        width = max(len(j.prompt_ids) for j in group)
        ids = torch.tensor([[0] * (width - len(j.prompt_ids)) + j.prompt_ids for j in group], device=hf_model.device)
        mask = torch.tensor([[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids) for j in group], device=hf_model.device)
        longest = max(j.new_tokens for j in group)
        hf_model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=longest, min_new_tokens=longest,
                          eos_token_id=None, pad_token_id=0)
        r.output_tokens += sum(j.new_tokens for j in group)  # the padding steps earn nothing
        progress(len(group))
    r.seconds = time.perf_counter() - t0
    return r


def hf_continuous(hf_model, jobs: list[Job], block_size: int, num_blocks: int, max_running: int,
                  progress: Progress) -> Result:
    """transformers' continuous batching: generate_batch's manager, fed each request's own max_new_tokens.

    Its cache is sized like ours (same page size and pool); its CPU defaults (sized from host RAM) ran
    3x slower on this workload.
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    r = Result("HF generate_batch (continuous)")
    cfg = GenerationConfig(do_sample=False, max_new_tokens=max(j.new_tokens for j in jobs), eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=block_size, num_blocks=num_blocks, max_batch_tokens=2048,
                                  max_requests_per_batch=max_running, allow_block_sharing=False)
    try:
        with hf_model.continuous_batching_context_manager(generation_config=cfg, continuous_batching_config=cb,
                                                          block=True, timeout=30, warmup=False) as m:
            t0 = time.perf_counter()  # the manager sizes its cache in its own thread: that is inside the time
            ids = [m.add_request(j.prompt_ids, max_new_tokens=j.new_tokens) for j in jobs]
            done: dict[str, object] = {}
            while len(done) < len(ids):
                res = m.get_result(timeout=1)
                if res is not None and res.is_finished():
                    done[res.request_id] = res
                    progress(1)
                elif res is None and not m.is_running():
                    raise RuntimeError("the generation thread stopped")
            r.seconds = time.perf_counter() - t0
        r.output_tokens = sum(len(done[i].generated_tokens) for i in ids)
        r.notes.append(f"ContinuousBatchingConfig(page_size={block_size}, num_blocks={num_blocks}, max_batch_tokens=2048)")
    except Exception as e:  # report, don't drop: a failing baseline is a result too
        r.error = f"{type(e).__name__}: {e}"
    return r


def instrument(runner, stats: EngineStats, block_size: int) -> None:
    """Count L3's KV utilization the way L4's engine does, by wrapping its runner's forward."""
    forward = runner.forward

    def counted(requests):
        logits = forward(requests)
        used = runner.allocator.num_blocks - runner.allocator.num_free
        stats.record(requests, used, block_size)
        return logits

    runner.forward = counted


def l3_static(model, jobs: list[Job], batch: int, block_size: int, backend: str, progress: Progress) -> Result:
    """L3 is a static batch engine with one stop rule per batch: each batch runs to its longest request."""
    r = Result(f"L3 static batches of {batch}", peak_running=batch)
    longest_request = max(len(j.prompt_ids) + j.new_tokens for j in jobs)
    engine = L3Engine(model, block_size, -(-batch * longest_request // block_size), backend)
    stats = EngineStats(record_timeline=False)
    instrument(engine.runner, stats, block_size)
    t0 = time.perf_counter()
    for i in range(0, len(jobs), batch):
        group = jobs[i:i + batch]
        engine.generate_batch([j.prompt_ids for j in group], StopRule(max(j.new_tokens for j in group), ignore_eos=True))
        r.output_tokens += sum(j.new_tokens for j in group)
        progress(len(group))
    r.seconds = time.perf_counter() - t0
    r.util_mean, r.util_peak = stats.utilization_mean, stats.utilization_at_peak
    r.backend = backend_name(engine)
    return r


def paged(engine: L4Engine, name: str, jobs: list[Job], progress: Progress, timeline: bool = False) -> Result:
    """L4 / L5: every request submitted at once (an offline batch); the scheduler decides who runs.
    `timeline` keeps who held how many blocks at every step (a dict per step: off unless a plot needs it)."""
    engine.stats.record_timeline = timeline
    prefill = count_prefill(engine.runner)
    t0 = time.perf_counter()
    for j in jobs:
        engine.add_request(j.prompt_ids, stop_for(j))
    produced = 0
    while engine.scheduler.has_work():
        finished = engine.step()
        produced += sum(len(s.output_ids) for s in finished)
        if finished:
            progress(len(finished))
    s = engine.stats
    return Result(name, time.perf_counter() - t0, produced, s.utilization_mean, s.utilization_at_peak,
                  s.peak_running, s.preemptions, prefill[0], getattr(s, "cached_tokens", None),
                  timeline=s.timeline if timeline else None, backend=backend_name(engine))


def l4(model, jobs, block_size, num_blocks, max_running, backend, progress, timeline=False) -> Result:
    engine = L4Engine(model, block_size, num_blocks, max_running, backend)
    return paged(engine, "L4 continuous", jobs, progress, timeline)


def l5(model, jobs, block_size, num_blocks, max_running, backend, progress, policy="recompute", timeline=False) -> Result:
    engine = L5Engine(model, block_size, num_blocks, max_running, backend, policy=policy)
    return paged(engine, f"L5 preemption ({policy})", jobs, progress, timeline)


def l6(model, jobs, block_size, num_blocks, max_running, backend, progress) -> Result:
    engine = L6Engine(model, block_size, num_blocks, max_running, backend)
    r = paged(engine, "L6 prefix sharing", jobs, progress)
    r.notes.append(engine.stats.prefix_line())
    if r.util_mean and r.util_mean > 1:
        r.notes.append("KV util above 100%: every request counts the shared tokens it holds, so logical KV exceeds "
                       "the physical slots")
    return r


# A shape where the matmuls, not Python and the vocab projection, dominate a step (random weights).
BENCH_SHAPE = dict(vocab_size=32768, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                   rope_theta=1e6, tie_word_embeddings=True)


def bench_shape_dir() -> Path:
    """Built once by transformers itself (its own seeded init) into the course cache."""
    out = cache_root() / "bench-shape-v1"
    if not (out / "config.json").is_file():
        from transformers import Qwen3Config, Qwen3ForCausalLM as HfQwen3

        torch.manual_seed(0)
        HfQwen3(Qwen3Config(**BENCH_SHAPE)).save_pretrained(str(out))
    return out
