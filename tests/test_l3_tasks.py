"""L3's build-track tests (scripts/course.py check L3) where no existing test fits: the pool, the oracle's page table
expansion, the runner's one ragged forward and the static batch's fit check. The step metadata's tests are in
test_l3_batch_meta.py, the oracle's in test_l3_torch_backend.py, the engine's in test_l3_engine.py and the batched
path's in test_l3_batched_backend.py."""
import pytest
import torch

from conftest import assert_same_tokens
from lessons.l2_token_flat.engine import blocks_for
from lessons.l2_token_flat.request import Request
from lessons.l3_block_tensor import L3Engine
from lessons.l3_block_tensor.backends.torch_backend import TorchBackend, history_slots
from lessons.l3_block_tensor.batch_meta import BatchMeta
from lessons.l3_block_tensor.kv_pool import BlockKvPool
from lessons.l3_block_tensor.runner import PagedRunner
from shared.errors import CourseError
from shared.generation import StopRule

CPU = torch.device("cpu")


@pytest.mark.task("L3.1")
def test_the_pool_holds_zeroed_pages_and_writes_by_flat_slot(tiny_model):
    cfg = tiny_model.config
    n, s, hkv, d = 6, 3, cfg.num_key_value_heads, cfg.head_dim
    pool = BlockKvPool(cfg, num_blocks=n, block_size=s, dtype=torch.bfloat16, device=CPU)
    assert (pool.num_blocks, pool.block_size) == (n, s), "the pool should remember num_blocks and block_size"
    for name in ("k", "v"):
        layers = getattr(pool, name)
        assert len(layers) == cfg.num_hidden_layers, (
            f"pool.{name} has {len(layers)} layers, the model {cfg.num_hidden_layers}")
        for i, t in enumerate(layers):
            assert tuple(t.shape) == (n, s, hkv, d), (
                f"pool.{name}[{i}] is {tuple(t.shape)}, want [N, S, Hkv, D] = {(n, s, hkv, d)}")
            assert t.dtype == torch.bfloat16 and not t.any(), (
                f"pool.{name}[{i}] should be zero-filled, in the dtype asked for")
    assert pool.k[0].data_ptr() != pool.v[0].data_ptr() and pool.k[0].data_ptr() != pool.k[1].data_ptr(), \
        "K and V, and each layer, need tensors of their own"
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(3, hkv, d, generator=g).to(torch.bfloat16) for _ in range(2))
    slots = [3 * s + 2, 0, 5 * s + 1]
    pool.write(1, k, v, torch.tensor(slots))
    for row, slot in enumerate(slots):
        block, offset = divmod(slot, s)
        assert torch.equal(pool.k[1][block, offset], k[row]), (
            f"row {row}'s key belongs in slot {slot} = block {block}, offset {offset} (slot = block * S + offset)")
        assert torch.equal(pool.v[1][block, offset], v[row]), f"row {row}'s value belongs in block {block}, offset {offset}"
    assert int((pool.k[1] != 0).any(dim=(2, 3)).sum()) == 3, "write() touched slots other than slot_mapping's"
    assert not pool.k[0].any() and not pool.v[0].any(), "write(layer=1, ...) wrote into layer 0"


@pytest.mark.task("L3.3")
def test_history_slots_expand_the_doc_example_page_tables():
    # docs/l3_block_tensor.md's worked example: S = 4; A prefills 5 tokens, B decodes its 8th, C prefills 3.
    s = 4
    reqs = [Request(list(range(5)), s, blocks=[12, 5]), Request(list(range(8)), s, blocks=[3, 7], num_cached=7),
            Request(list(range(3)), s, blocks=[0, 6])]
    meta = BatchMeta.build(reqs, s, CPU)
    want = {"A": [48, 49, 50, 51, 20], "B": [12, 13, 14, 15, 28, 29, 30, 31], "C": [0, 1, 2]}
    for b, (name, slots) in enumerate(want.items()):
        got = history_slots(meta, b).tolist()
        assert got == slots, (f"request {name} (b = {b}): its whole history, positions 0..{len(slots) - 1}, lives in "
                              f"slots {slots}; got {got}")


def prompt_requests(prompt_ids, block_size, allocator):
    reqs = [Request(list(p), block_size) for p in prompt_ids]
    for r in reqs:
        r.reserve(r.num_tokens, allocator)
    return reqs


@pytest.mark.task("L3.4")
def test_one_ragged_forward_gives_each_request_hfs_next_token(tiny_model, hf, prompt_ids):
    runner = PagedRunner(tiny_model, block_size=4, num_blocks=64, backend="torch")
    reqs = prompt_requests(prompt_ids, 4, runner.allocator)
    want = [hf.generate(p, StopRule(2, ignore_eos=True)).tokens for p in prompt_ids]
    for step in range(2):
        logits = runner.forward(reqs)
        want_shape = (len(reqs), tiny_model.config.vocab_size)
        assert tuple(logits.shape) == want_shape, (
            f"step {step}: logits are {tuple(logits.shape)}, want [B, vocab] = {want_shape}")
        for i, r in enumerate(reqs):
            assert r.num_cached == r.num_tokens, (
                f"step {step}, prompt {i}: num_cached is {r.num_cached} after the forward, want {r.num_tokens}")
            r.output_ids.append(int(logits[i].argmax()))
            r.reserve(r.num_tokens, runner.allocator)
    for i, r in enumerate(reqs):
        assert_same_tokens(r.output_ids, want[i], f"prompt {i} (a prefill step, then a decode step, all four in one batch)")


class Watching(TorchBackend):
    """The oracle, counting its calls and checking that each layer's new K/V are in the pages before run()."""

    def __init__(self):
        super().__init__()
        self.plans, self.runs, self.unwritten = 0, 0, []

    def plan(self, meta):
        self.plans += 1
        super().plan(meta)

    def run(self, q, k_cache, v_cache, meta):
        written = k_cache.flatten(0, 1)[meta.slot_mapping]
        if not written.abs().sum(dim=(1, 2)).all():
            self.unwritten.append(self.runs)
        self.runs += 1
        return super().run(q, k_cache, v_cache, meta)


@pytest.mark.task("L3.4")
def test_the_forward_plans_once_and_writes_before_attending(tiny_model, prompt_ids):
    backend = Watching()
    runner = PagedRunner(tiny_model, block_size=4, num_blocks=64, backend=backend)
    reqs = prompt_requests(prompt_ids, 4, runner.allocator)
    runner.forward(reqs)
    layers = tiny_model.config.num_hidden_layers
    assert backend.plans == 1, f"one forward planned {backend.plans} times: plan once per step, before the first layer"
    assert backend.runs == layers, f"one forward ran attention {backend.runs} times, want once per layer ({layers})"
    assert not backend.unwritten, (f"layer(s) {backend.unwritten}: attention ran before this step's K/V were written "
                                   "to the pages (each new token must see its own key)")


@pytest.mark.task("L3.5")
def test_check_fits_counts_each_request_at_its_longest(tiny_model, prompt_ids):
    stop = StopRule(3)
    need = sum(blocks_for(len(p) + stop.max_new_tokens - 1, 4) for p in prompt_ids)  # the last token is never cached
    engine = L3Engine(tiny_model, block_size=4, num_blocks=need - 1, backend="torch")
    with pytest.raises(CourseError, match=f"needs {need} blocks of 4 tokens; the pool has {need - 1} free"):
        engine.generate_batch(prompt_ids, stop)
    assert engine.allocator.num_free == need - 1, "a refused batch took blocks from the pool"
    engine = L3Engine(tiny_model, block_size=4, num_blocks=need, backend="torch")
    engine.generate_batch(prompt_ids, stop)  # exactly enough
    assert engine.allocator.num_free == need, f"{need - engine.allocator.num_free} blocks were never freed"
