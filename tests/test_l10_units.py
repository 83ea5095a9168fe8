"""L10's parts in one process, in seconds: no rank is started here (tests/test_l10_tp.py starts real ones).

- TpLayout: every rank's heads, MLP rows and token ids at tp 1, 2 and 4 on the embedded model (4 query heads,
  2 KV heads: at tp 4 each KV head is kept by two ranks) and on an 8-KV-head config; check_tp's one-line
  refusals; slice_of for every checkpoint tensor.
- The four split layers against their unsplit versions, every "rank" run here with a recording stand-in
  for the group: column shards joined, row partial sums added, embedding shards added (ids on the shard
  edges), LM head shards joined.
- The split model against Qwen3ForCausalLM: at tp 1 (TpGroup(0, 1): no collectives) its logits are
  identical; at tp 2 and tp 4 (KV heads replicated) with every rank in a thread of this process, joined by
  an in-memory group, they agree to fp32 rounding and pick the same token at every position.
- SentSlice: only the tokens after num_cached travel (wire.py's tensors); what the runner reads survives the trip.
- DeferredCopyManager: copy-on-write records (src, dst) and leaves the pool alone; an L10Engine at tp 1
  (one rank: rank 0 makes the deferred copies itself) forks seeded samples exactly as L8 does.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lessons.l3_block_tensor.batch_meta import BatchMeta
from lessons.l4_continuous.sampling import SamplingParams
from lessons.l4_continuous.sequence import Sequence
from lessons.l6_prefix_sharing.block_manager import RefBlockManager
from lessons.l6_prefix_sharing.prefix_cache import PrefixCache
from lessons.l6_prefix_sharing.stats import PrefixStats
from lessons.l8_chunked_prefill import L8Engine
from lessons.l8_chunked_prefill.slice import Slice
from lessons.l10_tensor_parallel import L10Engine
from lessons.l10_tensor_parallel.block_manager import DeferredCopyManager
from lessons.l10_tensor_parallel.group import TpGroup
from lessons.l10_tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                                VocabParallelLMHead)
from lessons.l10_tensor_parallel.layout import TpLayout, check_tp
from lessons.l10_tensor_parallel.model import TpQwen3ForCausalLM
from lessons.l10_tensor_parallel.wire import SentSlice, pack, unpack
from shared.attention import causal_attention
from shared.checkpoint import tensor_shapes
from shared.config import Qwen3Config
from shared.errors import CourseError
from shared.generation import StopRule

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cfg(tiny_dir) -> Qwen3Config:
    c = Qwen3Config.from_dir(tiny_dir)
    # What the expectations below are written for (the embedded model of shared/tiny_qwen3.py).
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size, c.intermediate_size,
            c.vocab_size, c.num_hidden_layers) == (4, 2, 64, 128, 384, 151936, 4)
    return c


# --- TpLayout ---------------------------------------------------------------------------------------------

# tp -> per rank: (query heads, KV heads, MLP rows, token ids), for the embedded model.
EMBEDDED = {
    1: [(range(0, 4), range(0, 2), range(0, 384), range(0, 151936))],
    2: [(range(0, 2), range(0, 1), range(0, 192), range(0, 75968)),
        (range(2, 4), range(1, 2), range(192, 384), range(75968, 151936))],
    4: [(range(0, 1), range(0, 1), range(0, 96), range(0, 37984)),  # KV head 0 kept by ranks 0 and 1,
        (range(1, 2), range(0, 1), range(96, 192), range(37984, 75968)),  # the ones whose queries read it
        (range(2, 3), range(1, 2), range(192, 288), range(75968, 113952)),
        (range(3, 4), range(1, 2), range(288, 384), range(113952, 151936))],
}


@pytest.mark.task("L10.1")
@pytest.mark.parametrize("tp", sorted(EMBEDDED))
def test_layout_of_the_embedded_model(cfg, tp):
    layouts = [TpLayout.of(cfg, r, tp) for r in range(tp)]
    got = [(lay.q_heads, lay.kv_heads, lay.mlp, lay.vocab) for lay in layouts]
    assert got == EMBEDDED[tp]
    for lay in layouts:
        assert (lay.rank, lay.size, lay.head_dim) == (layouts.index(lay), tp, 64)
        local = lay.local_config(cfg)
        assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == \
               (4 // tp, 1 if tp > 2 else 2 // tp, 384 // tp)
        assert (local.hidden_size, local.vocab_size, local.head_dim) == (128, 151936, 64)
        # Each rank's query heads read its KV head (queries are grouped by KV head: head q reads q // ratio).
        assert {q // cfg.gqa_ratio for q in lay.q_heads} == set(lay.kv_heads)


@pytest.mark.task("L10.1")
def test_kv_replication_rank_keeps_head_rank_times_hkv_over_tp(cfg):
    kept = [TpLayout.of(cfg, r, 4).kv_heads for r in range(4)]
    assert kept == [range(r * 2 // 4, r * 2 // 4 + 1) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2


@pytest.mark.task("L10.1")
@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_layout_of_an_8_kv_head_model(cfg, tp):
    """16 query heads, 8 KV heads: KV heads split up to tp 8, replicated (each kept by two ranks) at tp 16.
    Whatever the tp, the ranks' ranges tile every dimension in rank order."""
    big = replace(cfg, num_attention_heads=16, num_key_value_heads=8)
    layouts = [TpLayout.of(big, r, tp) for r in range(tp)]
    for dim, total in (("q_heads", 16), ("mlp", 384), ("vocab", 151936)):
        parts = [getattr(lay, dim) for lay in layouts]
        assert [x for p in parts for x in p] == list(range(total)) and len({len(p) for p in parts}) == 1
    kv = [lay.kv_heads for lay in layouts]
    if tp <= 8:
        assert [x for p in kv for x in p] == list(range(8)) and all(len(p) == 8 // tp for p in kv)
    else:
        assert kv == [range(r // 2, r // 2 + 1) for r in range(16)]
    for lay in layouts:
        assert {q // big.gqa_ratio for q in lay.q_heads} == set(lay.kv_heads)


def refusal(c: Qwen3Config, tp: int) -> str:
    with pytest.raises(CourseError) as e:
        check_tp(c, tp)
    msg = str(e.value)
    assert "\n" not in msg and msg.strip() == msg and msg
    with pytest.raises(CourseError) as e2:  # the layout refuses the same tp with the same line
        TpLayout.of(c, 0, tp)
    assert str(e2.value) == msg
    return msg


@pytest.mark.task("L10.1")
def test_check_tp_refusals_are_one_line_naming_the_value(cfg):
    assert refusal(cfg, 3) == "--tp 3 does not divide the model's 4 attention heads"
    assert "--tp 8 " in refusal(cfg, 8) and "4 attention heads" in refusal(cfg, 8)
    assert "at least 1, got 0" in refusal(cfg, 0)
    # 12 query heads, 4 KV heads: tp 6 divides the heads but neither divides 4 nor is a multiple of it.
    odd = replace(cfg, num_attention_heads=12, num_key_value_heads=4, intermediate_size=384 * 3)
    msg = refusal(odd, 6)
    assert msg.startswith("--tp 6:") and "4 key/value heads" in msg
    assert "--tp 2 does not divide the model's intermediate_size 385" == refusal(replace(cfg, intermediate_size=385), 2)
    assert "vocab_size 151937" in refusal(replace(cfg, vocab_size=151937), 2)
    for tp in (1, 2, 4):
        check_tp(cfg, tp)  # accepted (4: a multiple of the 2 KV heads, replicated)


# tensor -> (dim, start, stop) at tp 2 rank 1 and at tp 4 rank 1 (KV head 0, replicated).
SPLIT_AT = {
    "model.layers.{i}.self_attn.q_proj.weight": ((0, 128, 256), (0, 64, 128)),
    "model.layers.{i}.self_attn.k_proj.weight": ((0, 64, 128), (0, 0, 64)),
    "model.layers.{i}.self_attn.v_proj.weight": ((0, 64, 128), (0, 0, 64)),
    "model.layers.{i}.self_attn.o_proj.weight": ((1, 128, 256), (1, 64, 128)),
    "model.layers.{i}.mlp.gate_proj.weight": ((0, 192, 384), (0, 96, 192)),
    "model.layers.{i}.mlp.up_proj.weight": ((0, 192, 384), (0, 96, 192)),
    "model.layers.{i}.mlp.down_proj.weight": ((1, 192, 384), (1, 96, 192)),
    "model.embed_tokens.weight": ((0, 75968, 151936), (0, 37984, 75968)),
    "lm_head.weight": ((0, 75968, 151936), (0, 37984, 75968)),
}


@pytest.mark.task("L10.2")
def test_slice_of_every_checkpoint_tensor(cfg, tiny_dir):
    two, four = TpLayout.of(cfg, 1, 2), TpLayout.of(cfg, 1, 4)
    for pattern, (at2, at4) in SPLIT_AT.items():
        for i in range(cfg.num_hidden_layers) if "{i}" in pattern else [None]:
            name = pattern.format(i=i)
            assert (two.slice_of(name), four.slice_of(name)) == (at2, at4), name
    shapes = tensor_shapes(tiny_dir)
    assert shapes, "the embedded checkpoint lists its tensors"
    for name, (shape, _file) in shapes.items():
        part = two.slice_of(name)
        if "norm" in name:  # q_norm, k_norm (per head, shared by all heads), the layer norms, the final norm
            assert part is None, name
            continue
        dim, start, stop = part
        assert 0 <= start < stop <= shape[dim] and (stop - start) * 2 == shape[dim], name
    assert TpLayout.of(cfg, 0, 1).slice_of("model.layers.0.self_attn.q_proj.weight") == (0, 0, 256)


# --- the split layers, every rank in this process --------------------------------------------------------


class Recorder:
    """A stand-in for one rank's TpGroup: all_reduce records the partial sum it was given (the test adds
    them up); gather_last_dim returns this rank's part (the test joins them)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.device = rank, size, CPU
        self.partials: list[torch.Tensor] = []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.partials.append(x.clone())
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        return x


def ints(*shape: int, seed: int = 0) -> torch.Tensor:
    """Small integers as fp32: every product and sum of a few hundred of them is exact."""
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).float()


def ranges(total: int, size: int) -> list[range]:
    n = total // size
    return [range(r * n, (r + 1) * n) for r in range(size)]


@pytest.mark.parametrize("tp", [2, 4])
def test_column_parallel_shards_joined_equal_the_full_linear(tp):
    full, x = nn.Linear(32, 24, bias=False), ints(7, 32)
    full.weight.data = ints(24, 32)
    outs = []
    for rows in ranges(24, tp):
        shard = ColumnParallelLinear(32, len(rows))
        shard.weight.data.copy_(full.weight.data[rows.start:rows.stop])
        outs.append(shard(x))
    # Each output element is one whole dot product on one rank. Small integers make every such sum exact in
    # fp32 whatever order the matmul kernel adds in, so "equal" here means equal, not "equal up to blocking".
    assert torch.equal(torch.cat(outs, dim=-1), full(x))


@pytest.mark.task("L10.3")
@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_partial_sums_add_up_to_the_full_linear(tp):
    torch.manual_seed(0)
    full, x = nn.Linear(32, 24, bias=False), torch.randn(7, 32)
    groups = [Recorder(r, tp) for r in range(tp)]
    for g, cols in zip(groups, ranges(32, tp)):
        shard = RowParallelLinear(len(cols), 24, g)
        shard.weight.data.copy_(full.weight.data[:, cols.start:cols.stop])
        shard(x[:, cols.start:cols.stop])
    assert [len(g.partials) for g in groups] == [1] * tp, "one all-reduce per rank per forward"
    partials = [g.partials[0] for g in groups]
    assert not any(torch.allclose(p, full(x), atol=1e-3) for p in partials), "a partial sum alone is not the output"
    # measured 3.6e-7 (Intel Xeon AMX), 2.4e-7 (torch capped to AVX2): 63x margin
    torch.testing.assert_close(sum(partials), full(x), rtol=1e-5, atol=1e-5)  # the same sum, added in another order


@pytest.mark.task("L10.3")
@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_embedding_shards_add_up_exactly(tiny_model, tp):
    full = tiny_model.model.embed_tokens
    V = full.weight.shape[0]
    edges = [0, V // 2 - 1, V // 2, V - 1] + [r.start for r in ranges(V, tp)] + [r.stop - 1 for r in ranges(V, tp)]
    ids = torch.tensor(edges + [785, 6722, 151643, 100000])
    groups = [Recorder(r, tp) for r in range(tp)]
    for g, vocab in zip(groups, ranges(V, tp)):
        shard = VocabParallelEmbedding(vocab, full.weight.shape[1], g)
        shard.weight.data.copy_(full.weight.data[vocab.start:vocab.stop])
        with torch.inference_mode():
            shard(ids)
        (out,) = g.partials
        mine = (ids >= vocab.start) & (ids < vocab.stop)
        assert mine.any() and (~mine).any()
        where = f"tp {tp}, rank {g.rank} (ids {vocab.start} .. {vocab.stop - 1})"
        assert torch.equal(out[mine], full.weight.data[ids[mine]]), (
            f"{where}: an id in the shard gives its own row of the table, weight[id - {vocab.start}]")
        # Unmasked, an id outside the shard would read the shard's row 0 (the clamped index), not zeros.
        assert full.weight.data[vocab.start].abs().sum() > 0
        others = ids[~mine][(out[~mine] != 0).any(-1)].tolist()
        assert not others, (f"{where}: ids outside the shard must give zero rows (mask, then zero, then sum), "
                            f"but ids {others} gave nonzero rows")
    assert torch.equal(sum(g.partials[0] for g in groups), full.weight.data[ids]), (
        "the ranks' rows summed must be the full embedding: one real row and zeros for each id")


@pytest.mark.task("L10.3")
@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_lm_head_shards_joined_equal_the_full_head(tp):
    V, E = 64, 16
    full, hidden = nn.Linear(E, V, bias=False), ints(3, E, seed=1)
    full.weight.data = ints(V, E, seed=2)  # exact sums (see ints): the joined logits must equal, bit for bit
    outs = []
    for r, vocab in enumerate(ranges(V, tp)):
        head = VocabParallelLMHead(E, vocab, V, Recorder(r, tp))
        head.weight.data.copy_(full.weight.data[vocab.start:vocab.stop])
        with torch.inference_mode():
            out = head(hidden)
            assert head(hidden[:0]).shape == (0, V)  # no row to sample: no gather, an empty [0, vocab]
        assert out.dtype == torch.float32 and out.shape == (3, len(vocab))
        outs.append(out)
    assert torch.equal(torch.cat(outs, dim=-1), full(hidden))


# --- the split model ----------------------------------------------------------------------------------------


class NoCache:
    """The KvAttention of a whole prompt in one forward, no pool: attend over this step's own K and V."""

    def attend(self, layer, q, k, v, meta):
        return causal_attention(q, k, v)


def logits_of(model, ids: list[int]) -> torch.Tensor | None:
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), NoCache(), None)
        return model.logits(hidden)


@pytest.mark.task("L10.4")
def test_tp1_model_logits_equal_the_whole_models(tiny_model, tiny_dir, prompt_ids):
    model = TpQwen3ForCausalLM.load(tiny_dir, torch.float32, TpGroup(0, 1, CPU))
    assert model.config == model.full_config == tiny_model.config
    prompt = prompt_ids[0] + prompt_ids[1]
    got, want = logits_of(model, prompt), logits_of(tiny_model, prompt)
    assert got.shape == (len(prompt), 151936)
    assert torch.equal(got, want)


class ThreadGroup:
    """The ranks of one in-memory group, one thread each: all_reduce adds every rank's tensor in rank order
    (every rank gets the same sum), gather_last_dim joins them on rank 0. A barrier keeps the ranks in step."""

    def __init__(self, size: int):
        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size, timeout=120)

    def rank(self, r: int) -> "ThreadRank":
        return ThreadRank(self, r)


class ThreadRank:
    def __init__(self, shared: ThreadGroup, rank: int):
        self.shared, self.rank, self.size, self.device = shared, rank, shared.size, CPU
        self.reduces = 0

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def lead(self, *message) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # every thread makes every call itself

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        s = self.shared
        s.slots[self.rank] = x.clone()
        s.barrier.wait()
        parts = list(s.slots)
        s.barrier.wait()  # nobody overwrites a slot before everyone has read them all
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.reduces += 1
        parts = self._exchange(x)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return x.copy_(total)

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        parts = self._exchange(x)
        return torch.cat(parts, dim=-1) if self.leader else None


def run_ranks(tp: int, fn) -> list:
    """fn(rank_group) on tp threads; their results in rank order (a thread's exception is re-raised)."""
    shared, results, errors = ThreadGroup(tp), [None] * tp, []

    def one(r: int) -> None:
        try:
            results[r] = fn(shared.rank(r))
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)
            shared.barrier.abort()

    threads = [threading.Thread(target=one, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.task("L10.4")
@pytest.mark.parametrize("tp", [2, 4])
def test_split_model_in_threads_agrees_with_the_whole_model(tiny_model, tiny_dir, prompt_ids, tp):
    """tp 4 replicates the KV heads: rank r must keep the head its query head reads, or its attention output
    (and every logit after it) changes."""
    prompt = prompt_ids[3][:40]
    want = logits_of(tiny_model, prompt)

    def rank_logits(group: ThreadRank):
        model = TpQwen3ForCausalLM.load(tiny_dir, torch.float32, group)
        return logits_of(model, prompt), group.reduces

    results = run_ranks(tp, rank_logits)
    (got, reduces), rest = results[0], results[1:]
    assert all(logits is None for logits, _ in rest), "only rank 0 gets the gathered logits"
    per_forward = 2 * tiny_model.config.num_hidden_layers + 1
    assert per_forward == 9 and {n for _, n in results} == {per_forward}
    assert got.shape == want.shape
    # Partial sums added in another order. Measured (logits up to 60): 1.3e-4 on an Intel Xeon with AMX, 1.56e-4 with
    # torch capped to AVX2 on two threads (10 of 6M logits over the 1e-4 this bound had): 6.4x under 1e-3. The
    # mistakes it is for are far larger (a KV replica's wrong head, a partial sum never all-reduced).
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


# --- SentSlice ----------------------------------------------------------------------------------------------


def sent(history: int, new: int, blocks: list[int] | None = None) -> SentSlice:
    # The new tokens are the same whatever the history, so any size difference is the history's.
    seq = Sequence(list(range(300, 300 + history)) + list(range(20000, 20000 + new)), 16, seq_id=3)
    seq.blocks = blocks if blocks is not None else list(range(40, 40 + -(-(history + new) // 16)))
    seq.num_cached = history
    return SentSlice.of(Slice.of(seq, new, decode=new == 1))


def trip(slices: list[SentSlice]) -> list[SentSlice]:
    kind, got, copies = unpack(*pack("run_step", slices, []))
    assert (kind, copies) == ("run_step", [])
    return got


@pytest.mark.task("L10.5")
def test_sent_slice_sends_only_the_tokens_it_feeds():
    blocks = list(range(100, 420))  # one table for every size below: only the token count varies
    size = {(h, n): pack("run_step", [sent(h, n, blocks)], [])[1].numel() for h in (10, 5000) for n in (1, 5, 500)}
    for n in (1, 5, 500):
        assert size[(5000, n)] == size[(10, n)], "the history must not travel"
    assert size[(10, 500)] - size[(10, 5)] == 495  # one int64 per new token
    s = sent(5000, 5)
    before = list(s.prompt_ids)
    pack("run_step", [s], [])
    assert s.prompt_ids == before, "sending must not cut the sender's own copy"


@pytest.mark.task("L10.5")
@pytest.mark.parametrize("history,new", [(0, 12), (20, 1), (35, 9), (48, 16)])
def test_sent_slice_round_trip_keeps_what_the_runner_reads(history, new):
    s = sent(history, new)
    [got] = trip([s])
    assert (got.block_size, got.blocks, got.num_cached, got.num_tokens, got.decode, got.samples) == \
           (s.block_size, s.blocks, s.num_cached, s.num_tokens, new == 1, True)
    assert got.token_ids(got.num_cached, got.num_tokens) == s.token_ids(s.num_cached, s.num_tokens)  # fed now
    a, b = BatchMeta.build([s], 16, CPU), BatchMeta.build([got], 16, CPU)
    for field in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "positions", "slot_mapping", "last_rows"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    # A slice that stops inside its prompt does not sample; the flag travels.
    seq = Sequence(list(range(30)), 16, seq_id=1, blocks=[5, 6])
    [mid] = trip([SentSlice.of(Slice.of(seq, 10))])
    assert (mid.samples, mid.decode, mid.num_tokens, mid.num_cached) == (False, False, 10, 0)


# --- deferred copy-on-write ----------------------------------------------------------------------------------


class FakePool:
    def __init__(self, blocks: int):
        torch.manual_seed(0)
        self.k = [torch.randn(blocks, 4, 2, 3) for _ in range(2)]
        self.v = [torch.randn(blocks, 4, 2, 3) for _ in range(2)]


@pytest.mark.task("L10.7")
def test_deferred_copy_manager_records_copies_and_leaves_the_pool_alone():
    pool = FakePool(6)
    before = [t.clone() for t in pool.k + pool.v]
    stats = PrefixStats()
    m = DeferredCopyManager(6, PrefixCache(), stats, pool)
    a, b = m.alloc(2)
    m.share([a, b])  # both shared by two tables
    new_a = m.copy_on_write(a)
    new_b = m.copy_on_write(b)
    assert stats.cow_copies == 2 and m.ref[a] == m.ref[b] == 1 and m.ref[new_a] == m.ref[new_b] == 1
    assert all(torch.equal(x, y) for x, y in zip(pool.k + pool.v, before)), "no pool write at copy-on-write time"
    assert m.take_copies() == [(a, new_a), (b, new_b)]  # in the order they were made
    assert m.take_copies() == []
    # L6's manager, the same calls: the copy is made at once (what the deferred one must not do).
    pool6 = FakePool(6)
    m6 = RefBlockManager(6, PrefixCache(), PrefixStats(), pool6)
    c, = m6.alloc(1)
    m6.share([c])
    d = m6.copy_on_write(c)
    assert all(torch.equal(t[d], t[c]) for t in pool6.k + pool6.v)


@pytest.mark.task("L10.7")
def test_tp1_engine_forks_seeded_samples_as_l8_does(tiny_model, tiny_dir, prompt_ids):
    """One rank: the deferred copies are made by rank 0's own run_step, before the step that writes into
    the copy. n = 2 on a 5-token prompt in blocks of 4: the children share the partial last block, so the
    first one to write copies it; if the copy is skipped, its attention reads the wrong rows."""
    stop = StopRule(8, frozenset(tiny_model.config.eos_token_ids), ignore_eos=True)
    prompt, sampling = prompt_ids[0], SamplingParams(0.8, top_k=50, seed=5)
    assert len(prompt) % 4
    model = TpQwen3ForCausalLM.load(tiny_dir, torch.float32, TpGroup(0, 1, CPU))
    outs = {}
    for name, cls, m in (("L10", L10Engine, model), ("L8", L8Engine, tiny_model)):
        engine = cls(m, 4, 32, 8, "torch", graphs=False, max_batched_tokens=16)
        kids = engine.add_parallel(prompt, stop, sampling, n=2)
        engine.add_request(prompt_ids[1], stop)  # a greedy neighbour in the same steps
        while engine.scheduler.has_work():
            engine.step()
        outs[name] = [k.output_ids for k in kids]
        assert engine.stats.cow_copies == 1
        assert engine.allocator.num_free == engine.usable_blocks
        if name == "L10":
            assert engine.allocator.pending_copies == []  # every recorded copy went out with a step
    assert outs["L10"] == outs["L8"]
    assert len({tuple(k) for k in outs["L10"]}) == 2 and all(len(k) == 8 for k in outs["L10"])
