"""L12's engine on the real tiny model: the default pool is L11's engine exactly, and int8 pages move their
scales wherever a block goes.

- kv_dtype "auto": greedy tokens equal HF's and L11's on a staggered workload (exact parity, as every lesson).
- int8 cannot promise HF's tokens (tests/test_l12_quality.py measures how far it moves the logits), but it
  quantizes per token and KV head, so a token's int8 row is the same whichever step writes it. So an int8 run
  gives the SAME tokens with and without each path that moves, shares or rewrites blocks: prefix hits (on
  blocks a prompt wrote, and on blocks decodes wrote), chunked prefill, speculation (a draft model; replayed
  drafts, some wrong, so rows reject and roll back), copy-on-write after a fork, swap out and in (at L5's
  level: L6+ refuse swap), and two tensor-parallel ranks. The reference is always an int8 run: each prompt
  alone, in one prefill, without drafts. Each workload is checked to differ from fp32's tokens somewhere, so
  the pages it read were int8 ones (a run that silently fell back to a full-precision pool would fail).
  "A token's row is the same whichever step writes it" needs its fp32 K and V to be the same whichever batch
  computes them, and torch's matmuls round a 3-row batch differently from one row on some CPUs (MKL's AVX2
  GEMM: an AVX2 laptop, or torch capped to AVX2). A 1-ulp difference then flips an int8 code, and a forked
  child's sampled token 14 differed from its seed's alone. So these runs use L14's batch-invariant twin of
  the model (the same weights; every row's matmul in one fixed order): the claim then holds on every CPU, and
  what is tested is the int8 paths, not the vendor GEMM's luck. The two-rank test cannot (its all-reduce adds
  partial sums in another order by design) and compares the ranks on torch's own matmuls.
- Pool accounting: sized in bytes (int8 fits > 1.8x the bf16 blocks, > 3.5x the fp32 ones), pool tensors
  int8 [N, S, Hkv, D + 4], no block leaked after runs with aborts, bad kv-dtype / kv-bytes / backend refused in
  one line.
"""
from __future__ import annotations

import pytest
import torch

from lessons.l2_token_flat.engine import DEFAULT_POOL_TOKENS, blocks_for
from lessons.l2_token_flat.request import Request
from lessons.l3_block_tensor.runner import PagedRunner
from lessons.l4_continuous.engine import Arrival
from lessons.l4_continuous.sampling import SamplingParams
from lessons.l4_continuous.sequence import Status
from lessons.l5_preemption import L5Engine
from lessons.l5_preemption.host_pool import HostKvPool
from lessons.l8_chunked_prefill.slice import Slice
from lessons.l10_tensor_parallel import follower
from lessons.l10_tensor_parallel.layout import TpLayout
from lessons.l10_tensor_parallel.runner import TpRunner
from lessons.l11_speculative import L11Engine
from lessons.l11_speculative.draft_model import DraftModelDrafter
from lessons.l11_speculative.replay import ReplayDrafter, every_nth_wrong, wrong_with_rate
from lessons.l12_kv_quant import L12Engine, L12TpEngine
from lessons.l12_kv_quant.engine import blocks_in, default_kv_bytes
from lessons.l12_kv_quant.kv_pool import Int8KvPool, block_bytes
from lessons.l12_kv_quant.quantize import SCALE_BYTES
from lessons.l12_kv_quant.runner import quantized
from lessons.l3_block_tensor.backends.cpp_backend import KernelUnavailable
from lessons.l14_batch_invariant.model import invariant_model
from shared.errors import CourseError
from shared.model import Qwen3ForCausalLM
from shared.generation import StopRule
from test_l6_fork import block_digest
from test_l11_parity import assert_mixed_acceptance, assert_no_leak, stop_for, tp_model  # noqa: F401 (a fixture)

CPU = torch.device("cpu")
NEW = 16  # long enough that int8's tokens leave fp32's on some prompt (the embedded model's near-ties)
BIG_BUDGET = 512  # more than any prompt here: every prompt in one prefill


def l12(model, block_size: int = 16, num_blocks: int | None = None, kv_dtype: str = "int8", **kwargs) -> L12Engine:
    kwargs.setdefault("max_batched_tokens", BIG_BUDGET)
    return L12Engine(model, block_size, num_blocks, backend=kwargs.pop("backend", "auto"), kv_dtype=kv_dtype,
                     **kwargs)


class Int8Alone:
    """Each prompt's int8 greedy tokens, run alone in a fresh engine: one prefill, no drafts, nothing shared.
    Memoised: several tests compare against the same runs."""

    def __init__(self, model):
        self.model, self._memo = model, {}

    def tokens(self, prompt: list[int], stop: StopRule, block_size: int = 16) -> list[int]:
        key = (tuple(prompt), stop, block_size)
        if key not in self._memo:
            self._memo[key] = l12(self.model, block_size).generate_batch([prompt], stop)[0]
        return self._memo[key]


@pytest.fixture(scope="module")
def invariant(tiny_model) -> Qwen3ForCausalLM:
    """The tiny model with L14's fixed-order matmuls and RMSNorms (the module's docstring: why)."""
    try:
        return invariant_model(tiny_model)
    except KernelUnavailable as e:  # the int8 pages are read by the same C++ build system's kernel anyway
        pytest.skip(f"L14's ops did not build: {e}")


@pytest.fixture(scope="module")
def alone(invariant) -> Int8Alone:
    return Int8Alone(invariant)


def assert_int8_differs_from_fp32(hf, prompts: list[list[int]], want: list[list[int]], stop: StopRule) -> None:
    """The workload reads int8 pages: somewhere its tokens are not what full-precision KV gives."""
    assert want != [hf.generate(p, stop).tokens for p in prompts], "int8 equals fp32 here: the test proves nothing"


def assert_int8_pool(engine_or_runner, num_kv_heads: int, head_dim: int) -> None:
    pool = engine_or_runner.runner.pool if hasattr(engine_or_runner, "runner") else engine_or_runner.pool
    assert isinstance(pool, Int8KvPool)
    for rows in pool.k + pool.v:
        assert rows.dtype == torch.int8
        assert rows.shape == (pool.num_blocks, pool.block_size, num_kv_heads, head_dim + SCALE_BYTES)


# --- kv_dtype "auto": L11's engine, exact parity --------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_auto_is_l11_exactly_and_equals_hf(tiny_model, hf, prompt_ids, backend):
    """The default pool is the model's dtype: the same runner class as L11's, the same pool size, and every
    greedy token HF's and L11's (staggered arrivals, the long prompt sliced by a budget of 24, the long prompt
    again later: a prefix hit)."""
    stop = stop_for(tiny_model, NEW)
    prompts = [prompt_ids[3], *prompt_ids[:3], prompt_ids[3]]
    want = [hf.generate(p, stop).tokens for p in prompts]
    engine = l12(tiny_model, kv_dtype="auto", backend=backend, max_batched_tokens=24)
    l11 = L11Engine(tiny_model, 16, None, backend=backend, max_batched_tokens=24)
    assert type(engine.runner) is type(l11.runner)
    assert engine.usable_blocks == l11.usable_blocks == blocks_for(DEFAULT_POOL_TOKENS, 16)
    assert engine.runner.pool.k[0].dtype == torch.float32
    assert engine.generate_batch(prompts, stop, stagger=2) == want
    assert l11.generate_batch(prompts, stop, stagger=2) == want
    assert engine.step_tokens == l11.step_tokens
    assert engine.stats.cached_tokens > 0 and max(engine.prompt_slices.values()) > 1
    assert_no_leak(engine)


# --- int8: the same tokens whichever path wrote or moved a block ------------------------------------------------


def test_int8_prefix_hits_give_the_tokens_of_each_prompt_alone(tiny_model, invariant, hf, prompt_ids, alone):
    """Blocks of 4. Request 1 (40 prompt tokens) decodes 16 tokens; request 2 arrives after it and is its prompt
    plus its first 14 outputs: it hits blocks its prompt wrote and blocks only decodes wrote. Request 3 shares the
    long prompt's first 4 blocks only. Each equals its prompt's int8 tokens alone: a hit reads the rows (and
    scales) the earlier request left, which are the rows its own prefill would have written."""
    block_size = 4
    stop = stop_for(tiny_model, NEW)
    first = prompt_ids[3][:40]
    out = alone.tokens(first, stop, block_size)
    second = first + out[:14]
    third = prompt_ids[3][:16] + prompt_ids[0]
    prompts = [first, second, third]
    want = [alone.tokens(p, stop, block_size) for p in prompts]
    assert_int8_differs_from_fp32(hf, prompts, want, stop)
    engine = l12(invariant, block_size)
    got = engine.run([Arrival(first, stop, step=0), Arrival(second, stop, step=1000), Arrival(third, stop, step=2000)])
    assert got == want
    hits = block_size * ((len(second) - 1) // block_size) + 16
    assert engine.stats.cached_tokens == hits, "every full block of the second prompt, 4 blocks of the third"
    assert_no_leak(engine)


@pytest.mark.task("L12.5")
def test_int8_chunked_prefill_gives_the_tokens_of_one_prefill(tiny_model, invariant, hf, prompt_ids, alone):
    """A budget of 8: the 101-token prompt is fed in slices beside the others' decodes; each slice writes its
    rows, later slices attend over them. The same tokens as each prompt prefilled in one forward."""
    stop = stop_for(tiny_model, NEW)
    prompts = [prompt_ids[3], *prompt_ids[:3]]
    want = [alone.tokens(p, stop) for p in prompts]
    assert_int8_differs_from_fp32(hf, prompts, want, stop)
    engine = l12(invariant, max_batched_tokens=8)
    assert engine.generate_batch(prompts, stop, stagger=1) == want
    assert max(engine.prompt_slices.values()) > 10 and max(engine.step_tokens) <= 8
    assert_no_leak(engine)


@pytest.mark.parametrize("drafter_name,k,block_size", [("replay", 4, 4), ("replay", 8, 16), ("draft-model", 4, 4)])
def test_int8_speculation_gives_the_tokens_without_drafts(tiny_model, invariant, hf, prompt_ids, alone, drafter_name,
                                                          k, block_size):
    """Drafts are query rows whose K/V are written into the pool before the verify rule runs; a rejected
    draft's rows are rolled back (the slots are rewritten by the next step). The replay drafter proposes the
    int8 run's own continuation, wrong at some positions (rows keep some drafts, reject at others); the draft
    model is the fp32 tiny model, whose guesses int8 rejects where its tokens leave fp32's."""
    stop = stop_for(tiny_model, NEW)
    prompts = [prompt_ids[3], *prompt_ids[:3]]
    want = [alone.tokens(p, stop) for p in prompts]
    assert_int8_differs_from_fp32(hf, prompts, want, stop)
    if drafter_name == "replay":
        corrupt = every_nth_wrong(3) if k == 4 else wrong_with_rate(0.3, 7)
        drafter = ReplayDrafter({tuple(p): w for p, w in zip(prompts, want)}, tiny_model.config.vocab_size, corrupt)
    else:
        drafter = DraftModelDrafter(tiny_model, "auto")
    engine = l12(invariant, block_size, drafter=drafter, num_speculative_tokens=k)
    assert engine.generate_batch(prompts, stop, stagger=1) == want
    assert_mixed_acceptance(engine)  # the draft model too: int8 rejects some of fp32's guesses
    assert_no_leak(engine)


SEED, N = 11, 3


def test_int8_copy_on_write_copies_codes_and_scales(tiny_model):
    """A 5-token prompt forked 3 ways in blocks of 4: the last block is shared and partly filled. The first
    child to write copies it: the copy is byte for byte the original (codes and scales), and writing the
    copy leaves the other children's blocks untouched."""
    prompt = list(range(100, 105))
    engine = l12(tiny_model, 4, 16)
    kids = engine.add_parallel(prompt, StopRule(4), SamplingParams(1.0, seed=SEED), n=N)
    engine.step()  # prefill once, fork, each child samples its first token
    assert engine.allocator.ref[kids[0].blocks[-1]] == N
    pool = engine.runner.pool
    before = {k.seq_id: [block_digest(pool, b) for b in k.blocks] for k in kids}
    first, rest = kids[0], kids[1:]
    first.reserve(first.num_tokens, engine.allocator)  # the next write lands in the shared block: copy it
    assert engine.stats.cow_copies == 1 and first.blocks[-1] != rest[0].blocks[-1]
    assert block_digest(pool, first.blocks[-1]) == before[first.seq_id][-1], "the copy carries codes and scales"
    engine.runner.forward([Slice.of(first, 1, decode=True)])  # writes position 5 into first's copy only
    for k in rest:
        assert [block_digest(pool, b) for b in k.blocks] == before[k.seq_id]
    assert block_digest(pool, first.blocks[-1]) != before[first.seq_id][-1]


def test_int8_forked_children_equal_their_seeds_alone(tiny_model, invariant, prompt_ids):
    """n = 3 seeded children of a 5-token prompt (blocks of 4: two copies on write): each child's tokens are its
    seed's alone in a fresh int8 engine."""
    prompt, stop = prompt_ids[0], stop_for(tiny_model, NEW)
    sampling = SamplingParams(0.8, top_k=50, seed=SEED)
    engine = l12(invariant, 4)
    kids = engine.add_parallel(prompt, stop, sampling, n=N)
    while engine.scheduler.has_work():
        engine.step()
    assert engine.stats.cow_copies == N - 1
    for i, kid in enumerate(kids):
        sampling_i = SamplingParams(0.8, top_k=50, seed=SEED + i)
        assert kid.output_ids == l12(invariant, 4).run([Arrival(prompt, stop, sampling_i)])[0], f"child {i}"
    assert len({tuple(k.output_ids) for k in kids}) == N
    assert_no_leak(engine)


# --- swap, at L5's level (L6+ are recompute-only) -------------------------------------------------------------


def int8_l5(model, block_size: int, num_blocks: int, policy: str) -> L5Engine:
    runner = quantized(PagedRunner, "int8")(model, block_size, num_blocks)
    return L5Engine(model, block_size, num_blocks, policy=policy, runner=runner)


@pytest.mark.parametrize("block_size", [2, 4])
def test_int8_swap_preemption_gives_the_tokens_of_a_big_pool(tiny_model, invariant, hf, prompt_ids, block_size):
    """L5's engine over an int8 runner, a pool that holds the biggest request with one block to spare (so
    decodes preempt and swap each other out and in), against a pool that never preempts."""
    prompts = prompt_ids[:3]
    stop = stop_for(tiny_model, NEW)
    small = 1 + max(blocks_for(len(p) + NEW - 1, block_size) for p in prompts)
    swapping = int8_l5(invariant, block_size, small, "swap")
    got = swapping.generate_batch(prompts, stop, stagger=1)
    roomy = int8_l5(invariant, block_size, 64, "swap")
    want = roomy.generate_batch(prompts, stop, stagger=1)
    assert got == want
    assert_int8_differs_from_fp32(hf, prompts, want, stop)
    s = swapping.stats
    assert s.preemptions > 0 and s.swaps_out == s.swaps_in == s.preemptions
    assert roomy.stats.preemptions == 0
    assert swapping.allocator.num_free == small


def test_int8_host_pool_round_trip_is_bitwise(tiny_model, prompt_ids):
    """Pages written by a real forward, swapped out to the host and back into other device blocks: the same
    bytes, codes and scales. The host pool mirrors the device pool's int8 rows of D + 4."""
    cfg = tiny_model.config
    runner = quantized(PagedRunner, "int8")(tiny_model, 4, 16)
    prompt = prompt_ids[3][:14]
    blocks = runner.allocator.alloc(blocks_for(len(prompt), 4))
    runner.forward([Request(prompt, 4, blocks=blocks)])
    pages = [rows[blocks].clone() for rows in runner.pool.k + runner.pool.v]
    assert any(p[..., cfg.head_dim:].any() for p in pages), "the scales were written"
    host = HostKvPool(runner.pool, 8)
    for rows in host.k + host.v:
        assert rows.dtype == torch.int8 and rows.shape == (8, 4, cfg.num_key_value_heads, cfg.head_dim + SCALE_BYTES)
    host_blocks = host.swap_out(blocks)
    for rows in runner.pool.k + runner.pool.v:
        rows[blocks] = 0  # the device blocks are reused by someone else meanwhile
    back = runner.allocator.alloc(len(blocks))
    assert not set(back) & set(blocks)
    host.swap_in(host_blocks, back)
    for before, rows in zip(pages, runner.pool.k + runner.pool.v):
        assert torch.equal(rows[back], before)
    assert host.allocator.num_free == 8


# --- two ranks ------------------------------------------------------------------------------------------------


def recorded_messages(group) -> list[tuple]:
    """What rank 0 sends the followers from now on, kind and arguments (the list fills as it runs)."""
    sent: list[tuple] = []
    inner = group._send

    def send(kind, *args, wait_s):
        sent.append((kind, *args))
        return inner(kind, *args, wait_s=wait_s)

    group._send = send
    return sent


def test_tp2_int8_equals_tp1_int8(tp_model, tiny_model, hf, prompt_ids):
    """L12TpEngine, int8, 2 ranks (each holds 1 of the 2 KV heads): the long prompt sliced by a budget of 24,
    short ones arriving while it decodes, a forked seeded prompt (n = 2, its copy-on-write made on both ranks),
    a later prompt sharing the long one's first 4 blocks (a prefix hit), replayed drafts. Every output equals
    one rank's int8 engine on the same workload. Rank 0's pool holds its one head's int8 rows of D + 4; the
    follower was told to build the int8 runner, whose pool holds its own head's rows."""
    block_size, budget = 16, 24
    stop = stop_for(tiny_model, NEW)
    long, short = prompt_ids[3], prompt_ids[:3]
    sequel = long[:4 * block_size] + prompt_ids[0]
    greedy = [long, short[0], short[2], sequel]
    sampling = SamplingParams(temperature=0.8, top_k=50, seed=SEED)

    def workload(engine) -> list[list[int]]:
        seqs, step = [], 0
        while step <= 10 or engine.scheduler.has_work():
            if step in (0, 1, 3, 10):
                seqs.append(engine.add_request(greedy[[0, 1, 3, 10].index(step)], stop))
            if step == 1:
                seqs += engine.add_parallel(short[1], stop, sampling, n=2)
            engine.step()
            step += 1
        return [s.output_ids for s in seqs]

    one = l12(tiny_model, block_size, max_batched_tokens=budget)
    want = workload(one)
    greedy_out = [want[i] for i in (0, 1, 4, 5)]
    assert greedy_out != [hf.generate(p, stop).tokens for p in greedy], "int8 leaves fp32 somewhere"
    expected = {tuple(p): w for p, w in zip(greedy, greedy_out)}
    group = tp_model.tp
    sent = recorded_messages(group)
    try:
        tp = L12TpEngine(tp_model, block_size, None, 64, "auto", kv_dtype="int8", max_batched_tokens=budget,
                         drafter=ReplayDrafter(expected, tiny_model.config.vocab_size, every_nth_wrong(3)),
                         num_speculative_tokens=4)
        reduces = group.calls["all-reduce"]
        assert workload(tp) == want
    finally:
        del group._send
    assert group.calls["all-reduce"] > reduces, "the ranks computed the workload together"
    assert tp.stats.cached_tokens >= 4 * block_size and tp.stats.cow_copies > 0
    assert_mixed_acceptance(tp)
    assert_no_leak(tp)
    assert tp.allocator.pending_copies == []
    cfg = tiny_model.config
    # kv_bytes is per rank (sized from the rank's own config): L11's default pool of a rank holding one head.
    assert tp.kv_bytes == one.kv_bytes // 2 and tp.usable_blocks == one.usable_blocks
    assert_int8_pool(tp, cfg.num_key_value_heads // 2, cfg.head_dim)
    [build] = [m for m in sent if m[0] == "build_runner"]
    assert build == ("build_runner", block_size, tp.runner.pool.num_blocks, "auto",
                     "lessons.l12_kv_quant.runner:requantized", "int8", "lessons.l10_tensor_parallel.runner:TpRunner")
    # Rank 1 builds its runner from that message with its own part of the model: the same int8 class, over a
    # pool of its one KV head (its process is out of reach here, so its pool is built as it builds it).
    theirs = follower.runner_class(*build[4:])
    assert theirs is type(tp.runner) and issubclass(theirs, TpRunner)
    rank1 = TpLayout.of(cfg, 1, 2).local_config(cfg)
    assert rank1.num_key_value_heads == cfg.num_key_value_heads // 2
    their_pool = Int8KvPool(rank1, 2, block_size, CPU)
    assert their_pool.k[0].dtype == torch.int8 and their_pool.k[0].shape[2:] == (1, cfg.head_dim + SCALE_BYTES)


# --- pool accounting ------------------------------------------------------------------------------------------


@pytest.mark.task("L12.5")
def test_the_pool_is_sized_in_bytes(tiny_model):
    """Default kv_bytes: L11's default pool in the model's dtype (fp32 here). int8 rows of D + 4 bytes fit
    more than 1.8x the bf16 blocks and 3.5x the fp32 ones in it; an explicit kv_bytes or num_blocks is obeyed."""
    cfg, s = tiny_model.config, 16
    default = default_kv_bytes(cfg, s, torch.float32)
    assert default == blocks_for(DEFAULT_POOL_TOKENS, s) * 2 * cfg.num_hidden_layers * s * cfg.num_key_value_heads \
        * cfg.head_dim * 4
    int8 = l12(tiny_model, s)
    assert int8.kv_bytes == default
    assert int8.usable_blocks == blocks_in(default, cfg, s, torch.int8) == default // (
        2 * cfg.num_hidden_layers * s * cfg.num_key_value_heads * (cfg.head_dim + SCALE_BYTES))
    auto = l12(tiny_model, s, kv_dtype="auto")
    assert auto.usable_blocks == blocks_in(default, cfg, s, torch.float32) == blocks_for(DEFAULT_POOL_TOKENS, s)
    assert int8.usable_blocks > 1.8 * blocks_in(default, cfg, s, torch.bfloat16)
    assert int8.usable_blocks > 3.5 * auto.usable_blocks
    assert_int8_pool(int8, cfg.num_key_value_heads, cfg.head_dim)
    assert int8.runner.pool.num_blocks == int8.usable_blocks + 1  # L7's dummy block beside them
    one_block = block_bytes(cfg, s, torch.int8)
    assert l12(tiny_model, s, kv_bytes=37 * one_block + 5).usable_blocks == 37
    assert l12(tiny_model, s, num_blocks=20, kv_bytes=10**9).usable_blocks == 20  # a count overrides bytes


def test_no_block_leaks_after_runs_with_aborts(tiny_model, prompt_ids):
    """A tight int8 pool (blocks of 4), staggered requests, a fork, replayed drafts, and aborts between steps
    (waiting, mid-prompt, decoding): when all is done every block is free or cached, and the allocator has all
    usable blocks back."""
    stop = stop_for(tiny_model, NEW)
    prompts = [prompt_ids[3][:40], prompt_ids[0], prompt_ids[3][:24] + prompt_ids[1], prompt_ids[2], prompt_ids[1]]
    drafter = ReplayDrafter({}, tiny_model.config.vocab_size)  # proposes nothing for unknown prompts
    engine = l12(tiny_model, 4, 24, max_batched_tokens=8, drafter=drafter, num_speculative_tokens=2)
    seqs, step = [], 0
    while step < 40 or engine.scheduler.has_work():
        if step < len(prompts):
            seqs.append(engine.add_request(prompts[step], stop))
        if step == 2:
            seqs += engine.add_parallel(prompt_ids[0], stop, SamplingParams(0.8, seed=3), n=2)
        if step in (3, 9, 15):
            alive = [s for s in seqs if s.status is not Status.FINISHED]
            if alive:
                engine.abort([alive[len(alive) // 2]])
        engine.step()
        step += 1
    assert engine.stats.preemptions > 0, "the pool was tight enough to preempt"
    assert sum(1 for s in seqs if len(s.output_ids) < NEW) >= 3, "the aborts cut requests short"
    assert_no_leak(engine)


@pytest.mark.parametrize("kv_dtype", ["INT8", "int4", "fp16", "", None, 8])
def test_a_bad_kv_dtype_is_refused_in_one_line(tiny_model, kv_dtype):
    with pytest.raises(CourseError) as e:
        l12(tiny_model, kv_dtype=kv_dtype)
    assert "\n" not in str(e.value) and "kv-dtype" in str(e.value) and "int8" in str(e.value)


@pytest.mark.parametrize("kv_bytes", [0, -1, True, 1.5, "4096", 100])
def test_a_bad_kv_bytes_is_refused_in_one_line(tiny_model, kv_bytes):
    """100 bytes: a positive number that holds no block."""
    with pytest.raises(CourseError) as e:
        l12(tiny_model, kv_bytes=kv_bytes)
    assert "\n" not in str(e.value) and "kv-bytes" in str(e.value)


@pytest.mark.parametrize("backend", ["batched", "flashinfer"])
def test_int8_on_a_backend_that_cannot_read_it_is_refused(tiny_model, backend):
    with pytest.raises(CourseError) as e:
        l12(tiny_model, backend=backend)
    msg = str(e.value)
    assert "\n" not in msg and "int8" in msg and backend in msg
