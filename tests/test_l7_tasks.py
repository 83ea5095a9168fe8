"""L7's build-track tests (scripts/course.py check L7): the capture sizes, the static buffers, the padded
metadata and the recorded step, each on its own, on the CPU (where a "graph" runs eagerly over the same
buffers); capture and replay through the engine are marked in test_l7_capture_coverage.py and
test_l7_graph_runner.py."""
import pytest
import torch

from lessons.l2_token_flat.request import Request
from lessons.l3_block_tensor.backends.torch_backend import TorchBackend
from lessons.l3_block_tensor.batch_meta import BatchMeta
from lessons.l3_block_tensor.runner import PagedRunner
from lessons.l7_cuda_graphs import L7Engine
from lessons.l7_cuda_graphs.capture_sizes import check_capture_sizes, default_capture_sizes, padded_size
from lessons.l7_cuda_graphs.graph_runner import GraphRunner, SizedStep
from lessons.l7_cuda_graphs.static_buffers import StaticDecodeBuffers
from shared.errors import CourseError

S = 4
CPU = torch.device("cpu")


def decode_row(tokens: list[int], blocks: list[int]) -> Request:
    """A request whose history is tokens[:-1] (cached) and whose next step feeds tokens[-1]."""
    return Request(list(tokens), S, blocks=list(blocks), num_cached=len(tokens) - 1)


# --- task 1: the sizes ---


@pytest.mark.task("L7.1")
def test_capture_sizes_are_checked_sorted_and_distinct():
    for sizes, max_running, want in (([8, 2, 2, 5], 8, [2, 5, 8]), ([3], 3, [3]), ([], 4, []), ([4, 1, 4], 4, [1, 4])):
        got = check_capture_sizes(sizes, max_running)
        assert got == want, f"check_capture_sizes({sizes}, {max_running}) = {got}: want sorted, each size once: {want}"
    for bad in (0, 9, -1, 2.5, True, "4"):
        with pytest.raises(CourseError, match="capture size"):
            check_capture_sizes([1, bad], 8)  # each size must be an int from 1 to max_running (8)
    assert default_capture_sizes(1) == [1] and default_capture_sizes(3) == [1, 2]
    assert default_capture_sizes(17) == [1, 2, 4, 8, 16], "above 8, one size every 8 rows, none above max_running"
    got = [padded_size([2, 5, 8], n) for n in range(1, 10)]
    assert got == [2, 2, 5, 5, 5, 8, 8, 8, None], f"padded sizes of 1..9 rows on sizes 2 5 8: {got}"


# --- task 2: the static buffers ---


@pytest.mark.task("L7.2")
def test_the_buffers_are_allocated_once_at_the_largest_size():
    b = StaticDecodeBuffers(8, 40, 16, torch.bfloat16, CPU)
    want = {"input_ids": ((8,), torch.int64), "positions": ((8,), torch.int64), "slot_mapping": ((8,), torch.int64),
            "kv_indptr": ((9,), torch.int32), "kv_indices": ((40,), torch.int32), "kv_last_page_len": ((8,), torch.int32),
            "hidden": ((8, 16), torch.bfloat16)}
    for name, (shape, dtype) in want.items():
        t = getattr(b, name)
        assert tuple(t.shape) == shape and t.dtype == dtype, \
            f"buffers.{name} is {tuple(t.shape)} {t.dtype}; want {shape} {dtype} (see static_buffers.py's docstring)"
    assert (b.max_size, b.max_pages) == (8, 40)


@pytest.mark.task("L7.2")
def test_fill_writes_the_rows_then_pads_into_the_dummy_block():
    b = StaticDecodeBuffers(8, 40, 16, torch.float32, CPU)
    addresses = [t.data_ptr() for t in (b.input_ids, b.positions, b.slot_mapping, b.kv_indptr, b.kv_indices)]
    dummy = 9
    # 5 rows: 0 at position 6 (blocks 3, 4), 1 at position 0 (block 7), 2 at position 4 (blocks 1, 2), 3 and 4 padding
    rows = [decode_row(list(range(10, 17)), [3, 4]), decode_row([20], [7]), decode_row(list(range(30, 35)), [1, 2, 5])]
    b.fill(rows, 5, dummy, S)
    assert b.input_ids[:5].tolist() == [16, 20, 34, 0, 0], "input_ids: each row's one new token, then token 0 per pad"
    assert b.positions[:5].tolist() == [6, 0, 4, 0, 0], "positions: each row's num_cached, then 0 per pad"
    want_slots = [4 * S + 2, 7 * S + 0, 2 * S + 0, dummy * S, dummy * S]
    assert b.slot_mapping[:5].tolist() == want_slots, \
        f"slot_mapping {b.slot_mapping[:5].tolist()}: want {want_slots} (a padded row writes the dummy block's slot 0)"
    assert b.kv_indptr[:6].tolist() == [0, 2, 3, 5, 6, 7], \
        "kv_indptr: 2, 1 and 2 pages (only those the history fills: row 2's third block is not named), then 1 per pad"
    assert b.kv_indices[:7].tolist() == [3, 4, 7, 1, 2, dummy, dummy], "kv_indices: the rows' pages, then the dummy"
    assert b.kv_last_page_len[:5].tolist() == [3, 1, 1, 1, 1], "kv_last_page_len: tokens in each row's last page"
    now = [t.data_ptr() for t in (b.input_ids, b.positions, b.slot_mapping, b.kv_indptr, b.kv_indices)]
    assert now == addresses, "fill must copy into the buffers (copy_), never replace them: a graph keeps the addresses"
    b.fill(rows[1:2], 2, dummy, S)  # a smaller step after a bigger one: row 1 is padding now, rewritten
    assert b.input_ids[:2].tolist() == [20, 0] and b.positions[:2].tolist() == [0, 0]
    assert b.slot_mapping[1] == dummy * S, "row 1 kept the slot of an earlier step: it would write into that block"
    assert b.kv_indptr[:3].tolist() == [0, 1, 2] and b.kv_indices[1] == dummy and b.kv_last_page_len[1] == 1


@pytest.mark.task("L7.2")
def test_fill_refuses_what_cannot_be_a_static_decode_step():
    b = StaticDecodeBuffers(4, 8, 16, torch.float32, CPU)
    with pytest.raises(ValueError):
        b.fill([Request([1, 2, 3], S, blocks=[0], num_cached=1)], 1, 5, S)  # feeds 2 tokens: not a decode row
    with pytest.raises(ValueError):
        b.fill([decode_row([1], [0])], 8, 5, S)  # size 8 > the buffers' 4 rows
    with pytest.raises(ValueError):
        b.fill([decode_row([1], [0])] * 2, 1, 5, S)  # 2 rows do not fit in size 1


# --- task 3: the padded metadata ---


@pytest.mark.task("L7.3")
def test_a_sizes_metadata_is_views_of_the_static_buffers(tiny_model):
    runner = GraphRunner(tiny_model, S, 12, "torch")
    runner.buffers = b = StaticDecodeBuffers(8, 8 * 12, tiny_model.config.hidden_size, torch.float32, CPU)
    meta = runner.padded_meta(4)
    assert meta.block_size == S and meta.decode_only, "a static step is a decode step: decode_only, one row each"
    assert meta.qo_indptr.tolist() == [0, 1, 2, 3, 4] and meta.last_rows.tolist() == [0, 1, 2, 3]
    for name, buf, n in (("positions", b.positions, 4), ("slot_mapping", b.slot_mapping, 4),
                         ("kv_indptr", b.kv_indptr, 5), ("kv_last_page_len", b.kv_last_page_len, 4)):
        t = getattr(meta, name)
        assert t.data_ptr() == buf.data_ptr() and t.numel() == n, \
            f"meta.{name} must be a view of buffers.{name} ({n} entries), not a copy: a fill must show through it"
    rows = [decode_row([1, 2, 3, 4, 5, 6], [2, 3]), decode_row([7], [5])]
    b.fill(rows, 4, 11, S)
    assert meta.positions.tolist() == [5, 0, 0, 0], "after a fill, the size's metadata reads the new values"
    cut = runner.step_meta(SizedStep(4, meta, runner.backend))
    assert cut.kv_indices.tolist() == [2, 3, 5, 11, 11], \
        f"step_meta: kv_indices cut to the {int(b.kv_indptr[4])} pages this fill wrote; got {cut.kv_indices.tolist()}"
    assert cut.kv_indices.data_ptr() == b.kv_indices.data_ptr(), "a view of buffers.kv_indices, cut, not a copy"
    assert cut.positions is meta.positions, "step_meta changes kv_indices only"


# --- task 4: the recorded step ---


class Counted:
    """An attention backend that counts its runs (and delegates to the one it wraps)."""

    def __init__(self, inner):
        self.inner, self.name, self.runs = inner, inner.name, 0

    def plan(self, meta: BatchMeta) -> None:
        self.inner.plan(meta)

    def run(self, q, k_cache, v_cache, meta):
        self.runs += 1
        return self.inner.run(q, k_cache, v_cache, meta)


@pytest.mark.task("L7.4")
def test_the_static_step_runs_the_model_over_the_buffers_with_its_sizes_backend(tiny_model, prompt_ids):
    """Three prompts prefilled (eagerly), then one decode step two ways: L3's eager forward on one runner, and
    run_static over the buffers padded to 4 rows on another. The real rows agree; the output is buffers.hidden."""
    cfg = tiny_model.config
    runners = [GraphRunner(tiny_model, S, 32, Counted(TorchBackend())) for _ in range(2)]
    batches = []
    for runner in runners:
        reqs = [Request(list(p[:7]), S) for p in prompt_ids[:3]]
        for r in reqs:
            r.reserve(8, runner.allocator)
        PagedRunner.forward(runner, reqs)  # the prefill: L3's forward, through GraphRunner.attend
        for r in reqs:
            r.output_ids.append(100 + len(r.output_ids))  # the next token to feed
        batches.append(reqs)
    assert runners[0].backend.runs == cfg.num_hidden_layers, "the eager prefill attends through runner.backend"
    eager = PagedRunner.forward(runners[0], batches[0])  # [3, vocab]
    g = runners[1]
    dummy = g.allocator.alloc(1)[0]
    g.buffers = b = StaticDecodeBuffers(4, 4 * 32, cfg.hidden_size, torch.float32, CPU)
    step = SizedStep(4, g.padded_meta(4), Counted(TorchBackend()))
    b.fill(batches[1], 4, dummy, S)
    meta = g.step_meta(step)
    step.backend.plan(meta)
    before = g.backend.runs
    hidden = g.run_static(step, meta)
    assert step.backend.runs == cfg.num_hidden_layers and g.backend.runs == before, \
        "a static step attends with its size's own backend (step.backend) in every layer, not runner.backend"
    assert g._active is None, "after the step, attend must fall back to runner.backend (reset _active)"
    assert hidden.data_ptr() == b.hidden.data_ptr() and tuple(hidden.shape) == (4, cfg.hidden_size), \
        "run_static returns buffers.hidden[:size], written in place (a graph's output is fixed too)"
    got = tiny_model.logits(hidden[:3])
    # Logits up to about 55 in magnitude, rounded differently over 4 rows than over 3: measured 2.9e-5 (Intel Xeon AMX;
    # 0 on one thread), 4.8e-5 (torch capped to AVX2), 2x under the 1e-4 this had; 5e-4 is a 10x margin, and a wrong
    # row or a step that skipped a layer moves logits by far more.
    for i in range(3):
        torch.testing.assert_close(got[i], eager[i], rtol=0, atol=5e-4,
                                   msg=lambda m, i=i: f"row {i}: the static step's logits differ from the eager step's: {m}")
    assert g.pool.k[0][dummy].abs().sum() > 0, "the padded row wrote its K into the dummy block"


# --- task 5: capture ---


@pytest.mark.task("L7.5")
def test_capture_builds_each_size_over_padded_rows_and_writes_the_dummy_block_only(tiny_model):
    engine = L7Engine(tiny_model, S, 8, 8, "torch", capture_sizes=[4, 1, 2])
    r = engine.runner
    assert r.sizes == [1, 2, 4] and sorted(r.steps) == [1, 2, 4], f"sizes {r.sizes}, steps {sorted(r.steps)}"
    assert all(r.steps[s].size == s for s in r.steps), "steps[size] is that size's SizedStep"
    assert r.captures == {1: 1, 2: 1, 4: 1}, f"each size captured exactly once: {dict(r.captures)}"
    assert r.buffers.max_size == 4, "one set of buffers, at the largest size"
    assert len({id(r.steps[s].backend) for s in r.steps}) == 3, "each size gets a backend of its own"
    others = [i for i in range(r.pool.num_blocks) if i != engine.dummy_block]
    for layer, (k, v) in enumerate(zip(r.pool.k, r.pool.v)):
        assert not k[others].any() and not v[others].any(), f"layer {layer}: capture wrote a block other than the dummy"
        assert k[engine.dummy_block].any(), f"layer {layer}: capture runs every size once, writing the dummy block"
    assert (dict(r.replays), r.eager_steps, r.real_rows, r.padded_rows) == ({}, 0, 0, 0), "capture is not a step"
