"""Planted learner bugs for scripts/checks/mutation_check.py: exact snippet swaps, and the behavioural tests (never
tests/test_docs.py) expected to catch them. Each `old` must occur exactly once in its file. The lessons'
exercises are here too (ids `l6-ex1-...`), so an exercise whose bug no longer applies or is no longer
caught fails the check instead of going stale in a doc."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Mutation:
    id: str
    area: str
    description: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments: node ids, files, or "-k", "expr"
    more: tuple[tuple[str, str, str], ...] = ()  # further (file, old, new) swaps, for a bug spanning files

    def edits(self) -> tuple[tuple[str, str, str], ...]:
        return ((self.file, self.old, self.new), *self.more)


def plant(m: Mutation, root: Path) -> dict[Path, str]:
    """Apply every swap of `m` to the tree at `root`; return each touched file's original text, to restore.
    Raises ValueError naming the first snippet that is not found exactly once (nothing is written then)."""
    originals: dict[Path, str] = {}
    planted: dict[Path, str] = {}
    for file, old, new in m.edits():
        path = root / file
        if not path.is_file():
            raise ValueError(f"stale: {file} does not exist")
        text = planted.get(path, path.read_text())
        originals.setdefault(path, text)
        if text.count(old) != 1:
            raise ValueError(f"stale: snippet found {text.count(old)} times in {file}")
        planted[path] = text.replace(old, new)
    for path, text in planted.items():
        path.write_text(text)
    return originals


L1L2_PARITY = ("tests/test_l1_l2_parity.py::test_default_model_l1_l2_hf_ignore_eos",)
L3_PARITY = ("tests/test_l3_engine.py::test_batch_matches_hf_alone",)
REQ = "lessons/l2_token_flat/request.py"
META = "lessons/l3_block_tensor/batch_meta.py"
CPP = "lessons/l3_block_tensor/backends/paged_attention.cpp"
L14_OPS = "shared/cpu_ops.cpp"  # the matmul and RMSNorm L14 teaches
L4S = "lessons/l4_continuous/scheduler.py"
L5S = "lessons/l5_preemption/scheduler.py"
HOST = "lessons/l5_preemption/host_pool.py"
SAMP = "lessons/l4_continuous/sampling.py"
L6S = "lessons/l6_prefix_sharing/scheduler.py"
L6_EXACT = "tests/test_l6_exact_counts.py"
L7R = "lessons/l7_cuda_graphs/graph_runner.py"
L7_COVER = "tests/test_l7_capture_coverage.py"
L6_RANDOM = ("tests/test_l6_scheduler.py", "-k", "random")
L8S = "lessons/l8_chunked_prefill/scheduler.py"
L8_BUDGETS = ("tests/test_l8_parity.py", "-k", "any_budget")
L8_RANDOM = ("tests/test_l8_scheduler.py", "-k", "random")
L11E = "lessons/l11_speculative/engine.py"
L11S = "lessons/l11_speculative/scheduler.py"
L11V = "lessons/l11_speculative/verify.py"
L11_INVARIANTS = ("tests/test_l11_invariants.py::test_every_step_keeps_the_invariants",)
L11_MATRIX = ("tests/test_l11_parity.py", "-k", "replay_drafts_keep_parity")
L12Q = "lessons/l12_kv_quant/quantize.py"
L12_SCALES = ("tests/test_l12_kernel.py::test_every_rows_own_scale_is_applied_to_keys_and_to_values",)
L13E = "lessons/l13_structured/engine.py"
L13_SERVER = "tests/test_l13_server.py"
L13_SPEC_SERVER = f"{L13_SERVER}::test_speculation_with_rejected_drafts_gives_the_same_json"
# the engine's own check first (seconds); the server's ngram drafts second (two servers to start)
L13_REPLAY = ("tests/test_l13_interactions.py::test_replayed_drafts_with_rejections_give_the_tokens_without_drafts"
              "[2-greedy]", L13_SPEC_SERVER)
L15C = "lessons/l15_disaggregated/connector.py"
L15T = "tests/test_l15_transfer.py"
L15_FAILED_PULL = (f"{L15T}::test_a_failed_pull_recomputes_or_fails_and_leaks_nothing",)
L7_USER_SIZES = (f"{L7_COVER}::test_decode_batches_on_user_sizes_given_unsorted_with_a_duplicate",)
L16B = "lessons/l16_weight_quant/blocks.py"
L16BT = "tests/test_l16_blocks.py"
L16_GGUF_BYTES = (f"{L16BT}::test_quantize_writes_ggufs_bytes_on_the_edge_blocks",
                  f"{L16BT}::test_quantize_writes_ggufs_bytes_on_random_matrices")
L16ET = "tests/test_l16_engine.py"

MUTATIONS: list[Mutation] = [
    # --- L1: contiguous cache ---
    Mutation("l1-rows-short", "L1 cache", "cache sized one row short (forgets the last fed token)",
             "lessons/l1_contiguous/engine.py",
             "len(prompt_ids) + stop.max_new_tokens - 1, self.dtype", "len(prompt_ids) + stop.max_new_tokens - 2, self.dtype",
             L1L2_PARITY),
    Mutation("l1-start-advance", "positions", "decode start advanced by 1 after prefill instead of by the tokens fed",
             "lessons/l1_contiguous/engine.py", "start += len(tokens)", "start += 1", L1L2_PARITY),
    Mutation("l1-meta-start", "L1 cache", "ContiguousMeta start off by one (writes one row late)",
             "lessons/l1_contiguous/engine.py", "ContiguousMeta(start))", "ContiguousMeta(start + 1))", L1L2_PARITY),
    Mutation("l1-decode-positions-shifted", "positions", "decode positions shifted by one, prefill's right (shifting "
             "every position is invisible: RoPE sees distances only) (docs/l1_contiguous.md, pitfall 2)",
             "lessons/l1_contiguous/engine.py", "positions = torch.arange(start, start + len(tokens), device=self.device)",
             "positions = torch.arange(start, start + len(tokens), device=self.device) + (start > 0)",
             ("tests/test_l1_tasks.py::test_generate_matches_hf_token_for_token",) + L1L2_PARITY),
    Mutation("config-rope-theta-top-level", "config", "rope_theta read only at the config's top level: transformers 5 "
             "keeps it in rope_parameters (KeyError) (docs/l1_contiguous.md, pitfall 5)",
             "shared/config.py", 'theta = raw.get("rope_theta", rope.get("rope_theta"))', 'theta = raw["rope_theta"]',
             ("tests/test_l1_l2_parity.py::test_other_configs",)),
    Mutation("tiny-final-norm-ones", "tiny model", "the tiny model's final norm gains all 1 (not +-1): tied "
             "embeddings predict the current token, greedy repeats it (docs/l1_contiguous.md, pitfall 4)",
             "shared/tiny_qwen3.py", "(e,), generator=g).float() * 2 - 1", "(e,), generator=g).float() * 0 + 1",
             ("tests/test_tiny_model.py::test_a_fresh_build_is_not_lazy",)),
    # --- shared attention / model ---
    Mutation("mask-strict", "masks", "causal mask excludes the diagonal (< instead of <=)",
             "shared/attention.py", "[None, :] <= q_pos", "[None, :] < q_pos", ("tests/test_l3_torch_backend.py",)),
    Mutation("mask-top-left", "masks", "causal mask top-left aligned (query i at position i, not Tk - Tq + i)",
             "shared/attention.py", "torch.arange(tk - tq, tk, device=q.device)", "torch.arange(0, tq, device=q.device)",
             ("tests/test_l3_torch_backend.py",)),
    Mutation("rope-keys-unrotated", "positions", "keys cached before RoPE (only q rotated)",
             "shared/model.py", "q, k = rope(q, k, rope_tables)", "q, _ = rope(q, k, rope_tables)", L1L2_PARITY),
    # --- L2: token-flat pool ---
    Mutation("slot-offset-div", "slot math", "slot offset pos // S instead of pos % S",
             REQ, "* self.block_size + pos % self.block_size", "* self.block_size + pos // self.block_size",
             ("tests/test_l2_reserve.py",)),
    Mutation("slot-logical-block", "slot math", "slot uses the logical block index, not the physical block id",
             REQ, "return self.blocks[pos // self.block_size] * self.block_size",
             "return (pos // self.block_size) * self.block_size", ("tests/test_l2_reserve.py", "tests/test_l3_batch_meta.py")),
    Mutation("slot-no-block-size", "slot math", "slot forgets * S: block b's slots start at b and overlap the next block's "
             "(docs/l2_token_flat.md, exercise 1)",
             REQ, "self.blocks[pos // self.block_size] * self.block_size + pos % self.block_size",
             "self.blocks[pos // self.block_size] + pos % self.block_size", ("tests/test_l2_reserve.py", "-k", "slots")),
    Mutation("reserve-floor", "allocator", "reserve uses floor instead of ceil (one block too few)",
             REQ, "needed = -(-num_tokens // self.block_size) - len(self.blocks)",
             "needed = num_tokens // self.block_size - len(self.blocks)", ("tests/test_l2_reserve.py",)),
    Mutation("l2-positions-zero", "positions", "step positions restart at 0 (relative, not absolute)",
             "lessons/l2_token_flat/forward_meta.py", "positions=torch.arange(start, end, device=device)",
             "positions=torch.arange(0, end - start, device=device)", ("tests/test_l2_reserve.py",)),
    Mutation("l2-history-new-only", "page tables", "kv_indices gathers only the new tokens, not the whole history",
             "lessons/l2_token_flat/forward_meta.py", "kv_indices=torch.tensor(req.slots(0, end)",
             "kv_indices=torch.tensor(req.slots(start, end)", ("tests/test_l2_reserve.py",)),
    Mutation("l2-v-gets-k", "layer/KV", "writes K into the V cache",
             "lessons/l2_token_flat/kv_pool.py", "self.v[layer][meta.slot_mapping] = v", "self.v[layer][meta.slot_mapping] = k",
             L1L2_PARITY),
    Mutation("l2-read-layer0", "layer/KV", "attend gathers layer 0's pool for every layer",
             "lessons/l2_token_flat/kv_pool.py", "causal_attention(q, self.k[layer][meta.kv_indices], self.v[layer][meta.kv_indices])",
             "causal_attention(q, self.k[0][meta.kv_indices], self.v[0][meta.kv_indices])", L1L2_PARITY),
    Mutation("l2-no-advance", "runner", "engine never advances num_cached (re-prefills everything every step)",
             "lessons/l2_token_flat/engine.py", "req.num_cached = req.num_tokens", "pass",
             ("tests/test_l2_tasks.py::test_generate_prefills_once_then_feeds_one_token_a_step",
              "tests/test_l1_l2_parity.py", "-k", "prefill_once")),
    Mutation("l2-no-check-fits", "runner", "generate skips check_fits: a request the pool can never hold fails "
             "halfway with PoolExhausted (docs/l2_token_flat.md, pitfall 3)",
             "lessons/l2_token_flat/engine.py", "        self.check_fits(prompt_ids, stop)\n", "",
             ("tests/test_l2_tasks.py", "-k", "never_hold")),
    Mutation("l2-leak", "runner", "generate never frees the request's blocks (docs/l2_token_flat.md, exercise 3)",
             "lessons/l2_token_flat/engine.py",
             "            self.allocator.free(req.blocks)  # on success and on any failure: no block leaks\n", "",
             ("tests/test_l2_tasks.py", "-k", "frees_every_block")),
    Mutation("l2-reserve-not-atomic", "allocator", "reserve takes one block at a time: a reserve that fails with "
             "PoolExhausted leaves the blocks it got behind (docs/l2_token_flat.md, exercise 4)",
             REQ, "self.blocks += allocator.alloc(needed)",
             "for _ in range(needed):\n                self.blocks += allocator.alloc(1)",
             ("tests/test_l2_allocator.py", "-k", "reserve_failure")),
    Mutation("alloc-free-front", "allocator", "free pushes to the front of the free list (reused first)",
             "lessons/l2_token_flat/block_allocator.py", "self._free.append(b)", "self._free.appendleft(b)",
             ("tests/test_l2_allocator.py",)),
    Mutation("alloc-not-marked", "allocator", "alloc does not mark its blocks used (double free undetected)",
             "lessons/l2_token_flat/block_allocator.py", "self._is_free[b] = False", "pass",
             ("tests/test_l2_allocator.py",)),
    # --- L3: block tensor, CSR ---
    Mutation("last-page-len-mod", "page tables", "kv_last_page_len = end % S (0 for a full page instead of S)",
             META, "last.append(end - (n_pages - 1) * block_size)", "last.append(end % block_size)",
             ("tests/test_l3_batch_meta.py",)),
    Mutation("kv-indices-reserved", "page tables", "kv_indices includes blocks reserved ahead of the history",
             META, "pages.append(r.block_table_tensor(n_pages))", "pages.append(r.block_table_tensor(len(r.blocks)))",
             ("tests/test_l3_batch_meta.py",)),
    Mutation("kv-indptr-reserved", "page tables", "kv_indptr counts every reserved block, not the pages used",
             META, "kv.append(kv[-1] + n_pages)", "kv.append(kv[-1] + len(r.blocks))", ("tests/test_l3_batch_meta.py",)),
    Mutation("qo-indptr-noncumulative", "page tables", "qo_indptr holds per-request lengths, not prefix sums",
             META, "qo.append(qo[-1] + end - start)", "qo.append(end - start)", ("tests/test_l3_batch_meta.py",)),
    Mutation("last-rows-first", "page tables", "last_rows picks each request's first new row",
             META, "last_rows=dev([q - 1 for q in qo[1:]])", "last_rows=dev(qo[:-1])", ("tests/test_l3_batch_meta.py",)),
    Mutation("batch-positions-zero", "positions", "batch positions start at 0 for every step (decode at position 0)",
             META, "positions += range(start, end)", "positions += range(0, end - start)", ("tests/test_l3_batch_meta.py",)),
    Mutation("history-missing-last-page", "page tables", "torch backend history drops the last (partial) page",
             "lessons/l3_block_tensor/backends/torch_backend.py",
             "kv_len = s * (hi - lo - 1) + int(meta.kv_last_page_len[b])", "kv_len = s * (hi - lo - 1)",
             ("tests/test_l3_torch_backend.py",)),
    Mutation("batched-mask-one-more-key", "masks", "batched backend's key mask lets one padding key through (<=)",
             "lessons/l3_block_tensor/backends/batched_backend.py",
             "key_mask = torch.arange(max_pages * s)[None, :] < kv_len[:, None]",
             "key_mask = torch.arange(max_pages * s)[None, :] <= kv_len[:, None]",
             ("tests/test_l3_batched_backend.py::test_worked_example_padded_table_and_mask",)),
    Mutation("batched-last-page-full", "page tables", "batched backend counts every last page as full (unmasks its unwritten tail)",
             "lessons/l3_block_tensor/backends/batched_backend.py",
             "kv_len = s * (n_pages - 1) + meta.kv_last_page_len.long()[requests]", "kv_len = s * n_pages",
             ("tests/test_l3_batched_backend.py::test_worked_example_padded_table_and_mask",
              "tests/test_l3_batched_backend.py::test_mixed_batch_matches_oracle_fp32")),
    Mutation("cpp-last-page-full", "page tables", "C++ kernel counts every last page as full (reads its unwritten tail)",
             CPP, "const int64_t kv_len = s * (n_pages - 1) + last[b];", "const int64_t kv_len = s * n_pages;",
             ("tests/test_l3_cpp_backend.py::test_every_last_page_length_matches_oracle",)),
    Mutation("cpp-no-rescale", "online softmax", "C++ kernel does not shrink the accumulator when a page raises the max",
             CPP, "    scale_by(acc, shrink, d);\n", "",
             ("tests/test_l3_cpp_backend.py::test_online_softmax_rescales_when_a_later_page_holds_the_max",)),
    Mutation("cpp-wrong-request-pages", "page tables", "C++ kernel reads every request's pages from request 0's table",
             CPP, "idx + kv_start[it[kRequest]]", "idx + kv_start[0]",
             ("tests/test_l3_cpp_backend.py::test_requests_read_only_their_own_pages",)),
    Mutation("l3-v-gets-k", "layer/KV", "block pool writes K into V",
             "lessons/l3_block_tensor/kv_pool.py", "self.v[layer].view(-1, hkv, d)[slot_mapping] = v",
             "self.v[layer].view(-1, hkv, d)[slot_mapping] = k", L3_PARITY),
    Mutation("l3-layer0", "layer/KV", "runner attends over layer 0's pages for every layer",
             "lessons/l3_block_tensor/runner.py", "self.backend.run(q, self.pool.k[layer], self.pool.v[layer], meta)",
             "self.backend.run(q, self.pool.k[0], self.pool.v[0], meta)", L3_PARITY),
    Mutation("l3-attend-before-write", "layer/KV", "runner attends before writing this step's K/V",
             "lessons/l3_block_tensor/runner.py",
             "        self.pool.write(layer, k, v, meta.slot_mapping)\n        return self.backend.run(q, self.pool.k[layer], self.pool.v[layer], meta)",
             "        out = self.backend.run(q, self.pool.k[layer], self.pool.v[layer], meta)\n"
             "        self.pool.write(layer, k, v, meta.slot_mapping)\n        return out", L3_PARITY),
    # --- L4: scheduler, sampling, stats ---
    Mutation("l4-admit-beyond-promise", "scheduler", "admission checks free blocks now, not the promises made",
             L4S, "return promised + seq.max_blocks <= self.allocator.num_blocks",
             "return seq.max_blocks <= self.allocator.num_free", ("tests/test_l4_scheduler.py",)),
    Mutation("l4-admit-lifo", "scheduler", "admission takes the newest waiting request (LIFO)",
             L4S, "seq = self.waiting.popleft()", "seq = self.waiting.pop()", ("tests/test_l4_scheduler.py",)),
    Mutation("l4-max-running-off-by-one", "scheduler", "max_running admits one too many (<=)",
             L4S, "while self.waiting and len(self.running) < self.max_running",
             "while self.waiting and len(self.running) <= self.max_running", ("tests/test_l4_scheduler.py",)),
    Mutation("l4-retire-no-free", "scheduler", "retire forgets to free the finished request's blocks",
             L4S, "        self.allocator.free(seq.blocks)\n        seq.blocks = []\n        seq.status, seq.finished_at",
             "        seq.blocks = []\n        seq.status, seq.finished_at", ("tests/test_l4_scheduler.py",)),
    Mutation("l4-ignore-stop-ids", "stop rule", "postprocess checks only the StopRule, not the request's stop_token_ids",
             L4S, "if seq.is_finished():", "if seq.stop.is_done(seq.output_ids):",
             ("tests/test_l4_parity.py", "-k", "stop_token_ids")),
    Mutation("stop-one-late", "stop rule", "stop rule stops one token late (> instead of >=)",
             "shared/generation.py", "if len(generated) >= self.max_new_tokens:", "if len(generated) > self.max_new_tokens:",
             ("tests/test_l4_scheduler.py",)),
    Mutation("stats-reserved-blocks", "stats", "slots reserved recorded in blocks, not blocks x S",
             "lessons/l4_continuous/stats.py", "self.slots_reserved.append(allocated_blocks * block_size)",
             "self.slots_reserved.append(allocated_blocks)", ("tests/test_l4_scheduler.py", "-k", "utilization")),
    Mutation("stats-free-as-used", "stats", "engine passes the free block count as the allocated count",
             "lessons/l4_continuous/engine.py", "self.stats.record(batch, self.allocator.num_blocks - self.allocator.num_free,",
             "self.stats.record(batch, self.allocator.num_free,", ("tests/test_l4_scheduler.py", "-k", "utilization")),
    Mutation("temp-multiply", "sampling", "logits multiplied by the temperature instead of divided",
             SAMP, "scaled = (row - row.max()) / max(p.temperature, MIN_TEMPERATURE)",
             "scaled = (row - row.max()) * max(p.temperature, MIN_TEMPERATURE)", ("tests/test_l4_sampler.py",)),
    Mutation("temp-after-softmax", "sampling", "temperature applied to probabilities after softmax",
             SAMP, "probs = torch.softmax(scaled, dim=-1)",
             "probs = torch.softmax(scaled * max(p.temperature, MIN_TEMPERATURE), dim=-1) ** (1 / max(p.temperature, MIN_TEMPERATURE))",
             ("tests/test_l4_sampler.py",)),
    Mutation("top-k-drops-kth", "sampling", "top-k keeps only k-1 (drops the k-th and its ties)",
             SAMP, "scaled.masked_fill(scaled < kth, -math.inf)", "scaled.masked_fill(scaled <= kth, -math.inf)",
             ("tests/test_l4_sampler.py",)),
    Mutation("top-p-mass-swapped", "sampling", "top-p drops while the tail mass <= p (not 1 - p)",
             SAMP, "cumsum(dim=-1) <= 1 - p.top_p", "cumsum(dim=-1) <= p.top_p", ("tests/test_l4_sampler.py",)),
    Mutation("top-p-drops-top", "sampling", "top-p may drop the most likely token too",
             SAMP, "        drop[-1] = False\n", "", ("tests/test_l4_sampler.py",)),
    Mutation("global-rng", "sampling", "draw from the global RNG instead of the request's generator",
             SAMP, "torch.rand(1, generator=generator, device=generator.device)", "torch.rand(1, device=generator.device)",
             ("tests/test_l4_sampler.py",)),
    Mutation("l4-no-max-shift", "sampling", "the row divided by the temperature without subtracting its max first: "
             "large logits over a tiny temperature overflow to inf, and inf - inf is NaN (docs/l4_continuous.md, "
             "exercise 3)",
             SAMP, "scaled = (row - row.max()) / max(p.temperature, MIN_TEMPERATURE)",
             "scaled = row / max(p.temperature, MIN_TEMPERATURE)",
             ("tests/test_l4_sampler.py", "-k", "max_shifted or extreme")),
    Mutation("l4-shared-generator", "sampling", "the step hands every sampled row one generator (the first sampled "
             "request's): a request's tokens depend on its batch mates (docs/l4_continuous.md, exercise 4)",
             "lessons/l4_continuous/engine.py", "[s.generator for s in batch])",
             "[s.generator and next(g.generator for g in batch if g.generator) for s in batch])",
             ("tests/test_l4_parity.py", "-k", "seeded")),
    Mutation("hf-batch-one-max-new", "HF baseline", "the benchmark's HF row gives every request the longest "
             "max_new_tokens, as generate_batch does (docs/l4_continuous.md, pitfall 1)",
             "scripts/benchmark/bench_systems.py", "m.add_request(j.prompt_ids, max_new_tokens=j.new_tokens)",
             "m.add_request(j.prompt_ids)",
             ("tests/test_l4_parity.py::test_the_benchmarks_hf_row_gives_each_request_its_own_max_new_tokens",)),
    # --- L5: preemption, swap ---
    Mutation("l5-victim-oldest", "preemption", "evicts the oldest unplaced running request instead of the newest",
             L5S, "self.preempt(todo.pop())", "self.preempt(todo.popleft())", ("tests/test_l5_scheduler.py",)),
    Mutation("l5-recompute-keeps-cached", "preemption", "recompute preemption does not reset num_cached",
             L5S, "seq.num_cached = 0", "pass", ("tests/test_l5_scheduler.py",)),
    Mutation("l5-preempt-no-free", "preemption", "preempt forgets to free the victim's device blocks",
             L5S, "        self.allocator.free(seq.blocks)\n        seq.blocks = []", "        seq.blocks = []",
             ("tests/test_l5_scheduler.py",)),
    Mutation("l5-requeue-back", "preemption", "a recomputed victim is queued at the back of waiting",
             L5S, "self.waiting.appendleft(seq)", "self.waiting.append(seq)", ("tests/test_l5_scheduler.py",)),
    Mutation("l5-swapped-back", "swap", "a swapped victim is queued at the back of swapped",
             L5S, "self.swapped.appendleft(seq)", "self.swapped.append(seq)", ("tests/test_l5_scheduler.py",)),
    Mutation("l5-swapped-first", "scheduler order", "admission always prefers the swapped queue over older waiting ones",
             L5S, "queue = min(heads, key=lambda q: q[0].seq_id)", "queue = heads[0]", ("tests/test_l5_scheduler.py",)),
    Mutation("swap-in-wrong-blocks", "swap", "swap_in copies into the host block ids instead of the device blocks",
             HOST, "dst = torch.tensor(device_blocks[: len(host_blocks)], device=",
             "dst = torch.tensor(host_blocks, device=", ("tests/test_l5_parity.py", "-k", "swap")),
    Mutation("swap-out-k-only", "swap", "swap_out copies only K to the host",
             HOST, "for dev, host in zip(self.device_pool.k + self.device_pool.v, self.k + self.v):\n            host[dst]",
             "for dev, host in zip(self.device_pool.k, self.k):\n            host[dst]", ("tests/test_l5_parity.py", "-k", "swap")),
    Mutation("host-blocks-not-freed", "swap", "swap_in never frees the host blocks",
             HOST, "        self.allocator.free(host_blocks)\n", "", ("tests/test_l5_scheduler.py",)),
    # --- L6: prefix cache and its statistics (tokens stay right: only exact counts see these) ---
    Mutation("l6-keys-unchained", "prefix cache", "a block's key hashes its own tokens, not its parent's key too "
             "(repeated blocks collide: registered once, later hits lost)",
             "lessons/l6_prefix_sharing/prefix_cache.py", "keys.append(hash_fn(parent, ", "keys.append(hash_fn(None, ",
             (f"{L6_EXACT}::test_a_prompt_whose_blocks_repeat_each_other",)),
    Mutation("l6-register-prompt-only", "prefix cache", "register_written caches the prompt's blocks only: blocks "
             "holding generated tokens are never hit (a re-admission recomputes them)",
             L6S, "full, done = seq.num_cached // self.block_size, seq.extra.get(\"registered\", 0)",
             "full, done = len(seq.prompt_ids) // self.block_size, seq.extra.get(\"registered\", 0)",
             (f"{L6_EXACT}::test_a_preempted_request_re_hits_its_own_blocks_generated_tokens_included",)),
    Mutation("l6-prefill-prompt-only", "stats", "prefill_tokens counts the prompt only (a re-admission's generated "
             "tokens are computed but not counted)",
             L6S, "self.stats.prefill_tokens += seq.num_tokens - seq.num_cached",
             "self.stats.prefill_tokens += len(seq.prompt_ids) - seq.num_cached",
             ("tests/test_l6_scheduler.py", "-k", "random_shared_prefix_workloads")),
    Mutation("l6-cached-prompt-only", "stats", "cached_tokens counts at most the prompt (a re-admission's hit on "
             "its generated tokens is not counted)",
             L6S, "self.stats.cached_tokens += seq.num_cached",
             "self.stats.cached_tokens += min(seq.num_cached, len(seq.prompt_ids))",
             (f"{L6_EXACT}::test_a_preempted_request_re_hits_its_own_blocks_generated_tokens_included",)),
    Mutation("l6-wait-ignores-running", "admission", "admission waits for blocks this step's other admissions "
             "fill, not for the block a running request's decode completes (computes it again)",
             L6S, "inflight = self.inflight_keys() if self.wait_for_inflight else set()", "inflight = set()",
             (f"{L6_EXACT}::test_a_block_a_running_request_completes_is_waited_for",)),
    # --- L7: capture sizes and graph bookkeeping (the eager path is right too: only exact counts see these) ---
    Mutation("l7-graph-size-pow2", "graph sizes", "graph_size rounds the batch up to a power of two first "
             "(33..39 rows of 40 find no size and run eagerly; 17..24 pad to 32)",
             L7R, "return padded_size(self.sizes, len(requests))",
             "return padded_size(self.sizes, 1 << (len(requests) - 1).bit_length())",
             (f"{L7_COVER}::test_decode_batches_39_down_to_1_on_the_default_sizes",)),
    Mutation("l7-no-output-is-prefill", "graph sizes", "graph_size calls a step prefill whenever a request has no "
             "output yet: one-token first steps (1-token prompts, prompts cached but for one token) run eagerly",
             L7R, "if any(r.num_tokens - r.num_cached != 1 for r in requests):",
             "if any(not r.output_ids for r in requests):",
             L7_USER_SIZES + (f"{L7_COVER}::test_requests_sharing_cached_prefix_blocks_decode_together",)),
    Mutation("l7-sizes-not-deduped", "graph sizes", "check_capture_sizes sorts but does not deduplicate: a repeated "
             "size is captured twice",
             "lessons/l7_cuda_graphs/capture_sizes.py", "return sorted(set(sizes))", "return sorted(sizes)",
             (f"{L7_COVER}::test_user_sizes_are_sorted_deduplicated_and_captured_once",)),
    Mutation("l7-padding-per-step", "graph stats", "padded_rows counts padded steps, not padded rows",
             L7R, "self.padded_rows + size - n", "self.padded_rows + (size > n)", L7_USER_SIZES),
    Mutation("l7-real-rows-padded", "graph stats", "real_rows counts the padded size, padding included",
             L7R, "self.real_rows + n,", "self.real_rows + size,", L7_USER_SIZES),
    Mutation("l7-pad-repeats-row-0", "L7 padding", "padded rows repeat row 0 (its slot and pages), not the dummy "
             "block: they write that request's next slot again (docs/l7_cuda_graphs.md, pitfall 2)",
             "lessons/l7_cuda_graphs/static_buffers.py",
             "            slots.append(dummy_block * block_size)\n"
             "            tables.append(torch.tensor([dummy_block], dtype=torch.int32))\n"
             "            indptr.append(indptr[-1] + 1)\n            last.append(1)\n",
             "            slots.append(slots[0] if requests else dummy_block * block_size)\n"
             "            tables.append(tables[0] if requests else torch.tensor([dummy_block], dtype=torch.int32))\n"
             "            indptr.append(indptr[-1] + len(tables[-1]))\n            last.append(last[0] if requests else 1)\n",
             ("tests/test_l7_tasks.py::test_fill_writes_the_rows_then_pads_into_the_dummy_block",
              "tests/test_l7_graph_runner.py::test_padded_rows_write_only_the_dummy_block")),
    # --- the oracle itself (docs/maintainers.md tells this bug's story) ---
    Mutation("hf-no-mask", "HF reference", "HF generate called without an attention mask: it guesses one from "
             "pad_token_id 0, and token 0 is '!', so a prompt ending in '!' loses its last token",
             "shared/hf_reference.py", "            attention_mask=torch.ones_like(ids),\n", "",
             ("tests/test_l1_l2_parity.py",)),
    # --- the lessons' exercises: each doc's planted bug, caught by the test the doc names ---
    Mutation("l6-ex1-evict-keeps-key", "L6 exercise 1", "eviction forgets to drop the block's key from the cache",
             "lessons/l6_prefix_sharing/block_manager.py",
             "                self.cache.drop(b)  # its key must not name a block about to hold other tokens\n", "",
             L6_RANDOM),
    Mutation("l6-ex2-no-cow", "L6 exercise 2", "a write into a shared block, no copy-on-write",
             "lessons/l6_prefix_sharing/sequence.py",
             "cow = i < len(self.blocks) and allocator.is_shared(self.blocks[i])", "cow = False",
             ("tests/test_l6_fork.py",)),
    Mutation("l6-ex3-match-every-block", "L6 exercise 3", "the match may take every block (no token left to feed)",
             L6S, "limit = (len(tokens) - 1) // S", "limit = len(tokens) // S",
             ("tests/test_l6_parity.py", "-k", "fully_cached")),
    Mutation("l6-ex4-register-late", "L6 exercise 4", "blocks registered after postprocess, counted by num_tokens "
             "(one slot early: the last sampled token is not written yet)",
             "lessons/l6_prefix_sharing/engine.py",
             "        self.scheduler.register_written(batch)\n", "",
             L6_RANDOM,
             more=(("lessons/l6_prefix_sharing/engine.py",
                    "        return self.scheduler.postprocess(batch, tokens)",
                    "        finished = self.scheduler.postprocess(batch, tokens)\n"
                    "        self.scheduler.register_written([s for s in batch if s.blocks])\n"
                    "        return finished"),
                   (L6S, "full, done = seq.num_cached // self.block_size,", "full, done = seq.num_tokens // self.block_size,"))),
    Mutation("l6-ex5-no-wait", "L6 exercise 5", "admission never waits for an in-flight prefix (as wait_for_inflight=False)",
             L6S, "return len(hits) < limit and self.keys(seq, limit)[len(hits)] in inflight", "return False",
             (f"{L6_EXACT}::test_same_step_arrivals_sharing_a_prefix",)),
    Mutation("l7-ex-stale-rows", "L7 exercise", "only the real rows of the slot mapping are refilled (stale rows)",
             "lessons/l7_cuda_graphs/static_buffers.py",
             "self.slot_mapping[:size].copy_(torch.tensor(slots), non_blocking=True)",
             "self.slot_mapping[: len(requests)].copy_(torch.tensor(slots[: len(requests)]), non_blocking=True)",
             ("tests/test_l7_graph_runner.py", "-k", "refilled or eight_rows")),
    Mutation("l8-ex-sample-partial", "L8 exercise", "every slice samples (Slice.samples is True): it gets a logits row "
             "and a token, a prompt's middle too (docs/l8_chunked_prefill.md, pitfall 2 and the exercise)",
             "lessons/l8_chunked_prefill/slice.py", "return self.num_tokens == self.seq.num_tokens", "return True",
             L8_BUDGETS),
    Mutation("l8-slice-whole-history", "L8 chunked prefill", "a slice's num_tokens is the whole request's, not its "
             "end: it feeds and attends past the slice, over blocks not reserved for it (docs/l8_chunked_prefill.md, "
             "pitfall 1)",
             "lessons/l8_chunked_prefill/slice.py", "    def num_tokens(self) -> int:\n        return self.end",
             "    def num_tokens(self) -> int:\n        return self.seq.num_tokens",
             ("tests/test_l8_tasks.py::test_a_slice_is_the_request_cut_short",) + L8_BUDGETS),
    Mutation("l8-slice-before-hit", "L8 chunked prefill", "the first slice is sized before the prefix hit is applied",
             L8S, "n = self.slice_size(seq.num_tokens - cached)", "n = self.slice_size(seq.num_tokens)",
             ("tests/test_l8_parity.py", "-k", "fully_cached or identical")),
    Mutation("l8-no-rotation", "L8 chunked prefill", "decodes always in arrival order: with a small budget the youngest starve",
             L8S, 'decodes.sort(key=lambda s: (s.extra.get("fed_at", -1), s.seq_id))',
             "decodes.sort(key=lambda s: s.seq_id)",
             ("tests/test_l8_scheduler.py", "-k", "take_turns or random")),
    Mutation("l8-prefills-first", "L8 chunked prefill", "prompt slices scheduled before the decodes",
             L8S, "[(s, True) for s in decodes] + [(s, False) for s in prefills]",
             "[(s, False) for s in prefills] + [(s, True) for s in decodes]", L8_RANDOM),
    Mutation("l8-graph-any-one-token-step", "L8 chunked prefill",
             "a step of one-token prompt slices replays a graph (projecting every row, meant for decodes only)",
             "lessons/l8_chunked_prefill/runner.py", "if not all(s.decode and s.samples for s in requests):",
             "if False:", ("tests/test_l8_parity.py", "-k", "graphs_on_and_off")),
    Mutation("l8-admission-uncharged", "L8 chunked prefill", "a slice does not charge the budget",
             L8S, "self.budget -= piece.num_tokens - piece.num_cached", "pass", L8_RANDOM),
    Mutation("l9-ex-no-abort", "L9 exercise", "a stream whose client disconnects is never aborted",
             "lessons/l9_server/app.py", "            if not self.events.finished:\n                self.abort()",
             "            pass", ("tests/test_l9_server.py", "-k", "abort_mid_stream or abort_mid_prefill")),
    Mutation("l9-abort-keeps-blocks", "L9 serving", "abort removes a running request but never frees its blocks",
             "lessons/l9_server/engine.py", "                self.allocator.free(seq.blocks)\n", "",
             ("tests/test_l9_units.py", "-k", "abort")),
    Mutation("l9-detok-per-token", "L9 serving", "each token decoded on its own: half characters become U+FFFD",
             "lessons/l9_server/detokenizer.py",
             'return self.utf8.decode(b"".join(self.token_bytes(t) for t in token_ids))',
             'return "".join(self.token_bytes(t).decode(errors="replace") for t in token_ids)',
             ("tests/test_l9_units.py", "-k", "split_character or random_ids")),
    Mutation("l9-stop-prefix-leaks", "L9 serving", "the start of a stop string is released before the rest arrives",
             "lessons/l9_server/stop_strings.py", "keep = self._partial_suffix(text)", "keep = 0",
             ("tests/test_l9_units.py", "-k", "stop")),
    Mutation("l9-stop-string-runs-on", "L9 serving", "a stop string ends the text but the sequence keeps decoding",
             "lessons/l9_server/engine_loop.py",
             "                    self.engine.abort([seq])  # a stop string: the sequence ends here, its blocks go back\n",
             "", ("tests/test_l9_units.py", "-k", "stop_string_ends")),
    Mutation("l9-usage-counts-text-only", "L9 serving", "continuous_usage_stats counts only the tokens of chunks "
             "sent: a token that completes no character yet (half of é) is never counted",
             "lessons/l9_server/app.py",
             "                    generated += len(event.token_ids)\n                    if event.text or "
             "event.finish_reason or (req.return_token_ids and event.token_ids):\n",
             "                    if event.text or event.finish_reason or (req.return_token_ids and event.token_ids):"
             "\n                        generated += len(event.token_ids)\n",
             ("tests/test_l9_streams.py::test_continuous_usage_counts_the_tokens_of_a_character_not_yet_shown",)),
    Mutation("l9-step-on-event-loop", "L9 serving", "engine.step() runs on the event loop (as an async handler "
             "calling it would): every client stalls for the length of a step (docs/l9_server.md, pitfall 3)",
             "lessons/l9_server/engine_loop.py",
             "                    self.engine.step()\n",
             "                    async def step_on_the_event_loop():\n"
             "                        self.engine.step()\n"
             "                    loops = [job.subscriber.loop for job in self.jobs.values()]\n"
             "                    if loops:\n"
             "                        asyncio.run_coroutine_threadsafe(step_on_the_event_loop(), loops[0]).result()\n"
             "                    else:\n"
             "                        self.engine.step()\n",
             ("tests/test_l9_streams.py::test_the_event_loop_answers_while_a_step_runs",)),
    # --- L10: tensor parallelism ---
    Mutation("l10-no-all-reduce", "L10 exercise", "a row-parallel linear returns its partial sum, never all-reduced "
             "(docs/l10_tensor_parallel.md, exercise)", "lessons/l10_tensor_parallel/layers.py",
             "        return self.group.all_reduce(super().forward(x))", "        return super().forward(x)",
             ("tests/test_l10_units.py::test_row_parallel_partial_sums_add_up_to_the_full_linear",
              "tests/test_l10_units.py::test_split_model_in_threads_agrees_with_the_whole_model")),
    Mutation("l10-embedding-unmasked", "L10 tensor parallel", "the vocabulary-parallel embedding does not zero the "
             "rows of ids outside its shard (they read the shard's row 0)", "lessons/l10_tensor_parallel/layers.py",
             "return self.group.all_reduce(rows.masked_fill(~mine[:, None], 0))",
             "return self.group.all_reduce(rows)",
             ("tests/test_l10_units.py::test_vocab_parallel_embedding_shards_add_up_exactly",)),
    Mutation("l10-copies-skipped", "L10 tensor parallel", "the step's deferred copy-on-write copies are never made: "
             "the forked child's copy of the shared block holds no K/V", "lessons/l10_tensor_parallel/runner.py",
             "        for src, dst in copies:\n            for rows in self.pool.k + self.pool.v:\n"
             "                rows[dst].copy_(rows[src])\n", "",
             ("tests/test_l10_tp.py::test_forked_sampling_copies_on_write_on_every_rank",
              "tests/test_l10_units.py::test_tp1_engine_forks_seeded_samples_as_l8_does")),
    Mutation("l10-copies-rank0-only", "L10 tensor parallel", "copy-on-write made on rank 0 only: the followers' copy "
             "of the block holds stale heads", "lessons/l10_tensor_parallel/runner.py",
             "        for src, dst in copies:", "        for src, dst in (copies if self.tp.leader else []):",
             ("tests/test_l10_tp.py::test_forked_sampling_copies_on_write_on_every_rank",)),
    Mutation("l10-kv-replica-wrong-head", "L10 tensor parallel", "with more ranks than KV heads, rank r keeps KV head "
             "r % Hkv, not the one its query heads read (r * Hkv // tp)", "lessons/l10_tensor_parallel/layout.py",
             "range(rank * hkv // size, rank * hkv // size + 1)", "range(rank % hkv, rank % hkv + 1)",
             ("tests/test_l10_tp.py::test_smoke_tp4_replicates_kv_heads_and_matches",
              "tests/test_l10_units.py::test_split_model_in_threads_agrees_with_the_whole_model",
              "tests/test_l10_units.py::test_kv_replication_rank_keeps_head_rank_times_hkv_over_tp")),
    Mutation("l10-wire-negative-kind", "L10 tensor parallel", "the wire takes a negative kind: KINDS[-6] reads as "
             "\"stop\", a follower told to quit by a malformed header", "lessons/l10_tensor_parallel/wire.py",
             "    if not 0 <= kind < len(KINDS):", "    if kind >= len(KINDS):",
             ("tests/test_l10_control.py", "-k", "malformed")),
    Mutation("l10-wire-negative-length", "L10 tensor parallel", "the wire takes a negative payload length (the "
             "follower's torch.zeros raises, not Malformed)", "lessons/l10_tensor_parallel/wire.py",
             "    if not 0 <= length <= most:", "    if length > most:",
             ("tests/test_l10_control.py", "-k", "malformed")),
    Mutation("l10-wire-unbounded-payload", "L10 tensor parallel", "a follower sizes the payload from the header "
             "unchecked against what it knows (its pool, the engine's budget): 2 GiB announced, 2 GiB allocated",
             "lessons/l10_tensor_parallel/group.py",
             "torch.zeros(wire.payload_len(header, self.limits), dtype=torch.int64)",
             "torch.zeros(wire.payload_len(header), dtype=torch.int64)",
             ("tests/test_l10_control.py::test_a_header_announcing_more_than_a_step_can_hold_is_refused_before_allocation",)),
    # --- L11: speculative decoding ---
    Mutation("l11-ex-drafts-cached", "L11 exercise", "the step counts a verify slice's drafts as cached (L8's "
             "`seq.num_cached = piece.num_cached` for every slice) and registers decodes with the prompt slices, "
             "before verification: blocks holding drafts enter the prefix cache (docs/l11_speculative.md, exercise)",
             L11E, "            if not piece.decode:\n"
             "                piece.seq.num_cached = piece.num_cached  # a prompt slice: all it fed is real\n",
             "            piece.seq.num_cached = piece.num_cached  # as in L8: every position fed counts\n"
             "            if not piece.decode:\n",
             L11_INVARIANTS,
             more=((L11E, "self.scheduler.register_written([p.seq for p in plan if not p.decode])",
                    "self.scheduler.register_written(batch)"),)),
    Mutation("l11-rollback-keeps-tail", "L11 speculative", "the rollback resets num_cached but keeps the blocks "
             "reserved for rejected drafts in the table", L11S,
             "        keep = blocks_for(end, self.block_size)\n        if len(seq.blocks) > keep:",
             "        keep = blocks_for(end, self.block_size)\n        if False:", L11_INVARIANTS),
    Mutation("l11-rollback-leaks", "L11 speculative", "the rollback cuts the table but never frees the blocks past "
             "the kept end", L11S, "            self.allocator.free(tail)\n", "", L11_MATRIX),
    Mutation("l11-rollback-off-by-one", "L11 speculative", "the rollback counts the last kept token as cached "
             "(num_cached = end): it is never fed", L11S, "seq.num_cached = end - 1", "seq.num_cached = end",
             L11_MATRIX),
    Mutation("l11-keeps-wrong-draft", "L11 speculative", "the greedy rule keeps the rejected draft instead of the "
             "target's own token at the first mismatch", L11V, "            return targets[:j + 1]",
             "            return targets[:j] + [draft]", L11_MATRIX),
    Mutation("l11-sampled-every-row", "L11 speculative", "the one-hot rule on sampled rows draws every row up front "
             "(one uniform per row, not per emitted token): the law holds, the seeded tokens are not L9's", L11V,
             "    for j in range(len(drafts) + 1):\n"
             "        token = sample_row(logits[j], params, generator)  # one uniform per emitted token, as without drafts\n",
             "    rows = [sample_row(logits[j], params, generator) for j in range(len(drafts) + 1)]\n"
             "    for j in range(len(drafts) + 1):\n        token = rows[j]\n",
             ("tests/test_l11_parity.py", "-k", "seeded_forks")),
    Mutation("l11-room-evicts-cached", "L11 speculative", "the drafts' room counts cached-but-unheld blocks as free: "
             "a draft's block evicts a cached prefix", L11S,
             "        unheld = self.allocator.num_free - self.allocator.num_cached_unheld  # free, and nobody's prefix\n",
             "        unheld = self.allocator.num_free  # free, and nobody's prefix\n",
             ("tests/test_l11_pinned.py::test_drafts_never_evict_a_cached_prefix_block",)),
    Mutation("l11-stats-count-kept", "L11 speculative", "the counters count the tokens a stop kept, not what "
             "verification accepted", L11E,
             "self.spec.record(len(getattr(piece, \"drafts\", ())), len(tokens) - 1, len(tokens))",
             "self.spec.record(len(getattr(piece, \"drafts\", ())), kept[-1] - 1, kept[-1])",
             ("tests/test_l11_pinned.py", "-k", "counters_count_what_verification_decided")),
    # --- L12: int8 KV cache ---
    Mutation("l12-ex-wrong-head-scale", "L12 exercise", "the kernel scales every KV head's scores with KV head 0's key "
             "scales (the page's first row, not the head's): on real data the heads' scales are close, so the tokens "
             "barely move (docs/l12_kv_quant.md, exercise)", CPP,
             "        row_scales(k_cache + head_offset, page_tokens, token_size, d, w.scales.data());",
             "        row_scales(k_cache + page_offset, page_tokens, token_size, d, w.scales.data());", L12_SCALES),
    Mutation("l12-values-with-key-scales", "L12 int8 KV", "the kernel weights the value rows with the key rows' scales",
             CPP, "        row_scales(v_cache + head_offset, page_tokens, token_size, d, w.scales.data());",
             "        row_scales(k_cache + head_offset, page_tokens, token_size, d, w.scales.data());", L12_SCALES),
    Mutation("l12-quantize-truncates", "L12 int8 KV", "the quantizer truncates toward zero instead of rounding: errors "
             "up to a whole step", L12Q, "codes = torch.round(x /", "codes = torch.trunc(x /",
             ("tests/test_l12_quantize.py::test_random_rows_round_trip_within_half_a_step",)),
    Mutation("l12-pool-writes-k-as-v", "L12 int8 KV", "the int8 pool writes the keys' packed rows into the value pages",
             "lessons/l12_kv_quant/kv_pool.py", "[slot_mapping] = pack_rows(v)", "[slot_mapping] = pack_rows(k)",
             ("tests/test_l12_quality.py::test_the_contract_holds_on_the_embedded_model",)),
    Mutation("l12-int8-widening-portable", "L12 int8 KV", "load8(int8) widens with the portable "
             "__builtin_convertvector on every CPU: GCC 12 makes it eight scalar converts, int8 decode attention 2.9x "
             "bf16's time (docs/l12_kv_quant.md, pitfalls)", CPP,
             "inline f32x8 load8(const int8_t* p) {\n#if defined(__AVX2__)\n",
             "inline f32x8 load8(const int8_t* p) {\n#if 0  // the portable form on every CPU\n",
             ("tests/test_l12_kernel.py::test_int8_codes_widen_to_fp32_with_vector_instructions",)),
    Mutation("l12-smoke-int8-by-parity", "L12 smoke", "the smoke judges int8 pages by HF parity, as --kv-dtype auto: "
             "a near-tie flips and it 'fails' at prompt 6's fifth token (docs/l12_kv_quant.md, pitfalls)",
             "scripts/l12_smoke.py", "    if args.kv_dtype == \"auto\":\n        return run_smoke(",
             "    if args.kv_dtype in (\"auto\", \"int8\"):\n        return run_smoke(",
             ("tests/test_l12_smoke.py::test_no_arguments_is_int8_and_the_contract_holds",)),
    # --- L13: structured output ---
    Mutation("l12-kl-reversed", "L12 quality", "the quality measure computes KL(P_test || P_ref), the reverse of what "
             "the doc and llama.cpp's tool state", "lessons/l12_kv_quant/quality.py",
             "return torch.log_softmax(test_logits.double(), -1).neg_().add_(log_p).mul_(log_p.exp()).sum(-1)",
             "log_q = torch.log_softmax(test_logits.double(), -1)\n    return log_p.neg().add_(log_q).mul_(log_q.exp()).sum(-1)",
             ("tests/test_l12_quality.py::test_kl_is_reference_to_test_per_row",)),
    Mutation("l12-contract-unpaired", "L12 quality", "the judge draws the yardstick's bootstrap resamples apart from the "
             "test's: the comparison is no longer paired by position", "lessons/l12_kv_quant/quality.py",
             "measures = [ratio(\"mean KL\", test.mean_kl, yardstick.mean_kl, means(test.kl), means(yardstick.kl))]",
             "measures = [ratio(\"mean KL\", test.mean_kl, yardstick.mean_kl, means(test.kl), means(yardstick.kl)[torch.randperm(RESAMPLES)])]",
             ("tests/test_l12_quality.py::test_judge_verdicts_on_runs_with_a_known_answer",)),
    Mutation("l13-ex-no-rollback", "L13 exercise", "advance() never rolls the matcher back: the drafts it took in "
             "while masking a verify slice stay in it after the target rejects them, so the next mask is the mask "
             "of text that was never emitted (docs/l13_structured_output.md, exercise)", L13E,
             "    rejected = drafts_taken - (len(tokens) - 1)\n    if rejected:\n        matcher.rollback(rejected)\n",
             "", L13_REPLAY),
    Mutation("l13-verify-last-row-only", "L13 structured", "a verify slice is masked like a plain row: only its last "
             "row, with the mask of the state before the drafts; the rows that check the drafts go unmasked", L13E,
             "rows = rows if drafts else range(rows.stop - 1, rows.stop)", "rows = range(rows.stop - 1, rows.stop)",
             ("tests/test_l13_interactions.py::test_drafts_the_grammar_forbids_are_all_rejected", L13_SPEC_SERVER)),
    Mutation("l13-eos-not-a-stop", "L13 structured", "the grammar's EOS ids are not added to the request's stop ids: "
             "with ignore_eos the output runs on past the grammar's end", L13E,
             "stop_token_ids=sampling.stop_token_ids | grammar.eos_ids", "stop_token_ids=sampling.stop_token_ids",
             ("tests/test_l13_interactions.py::test_ignore_eos_still_ends_at_the_grammars_eos",
              f"{L13_SERVER}::test_the_grammars_end_stops_a_request_that_ignores_eos")),
    Mutation("l13-sampled-rows-unmasked", "L13 structured", "only greedy rows are constrained: a request sampled at "
             "temperature > 0 gets neither a mask nor a matcher advance", L13E,
             "if grammar_of(seq.sampling) is not None]", "if grammar_of(seq.sampling) is not None and seq.sampling.greedy]",
             ("tests/test_l13_engine.py::test_200_seeded_sampled_requests_validate_and_leave_their_neighbours_unchanged",
              f"{L13_SERVER}::test_two_seeded_samples_both_validate")),
    Mutation("l13-compile-on-the-event-loop", "L13 server", "the server compiles a grammar on the event loop, not in a "
             "worker thread: a slow compile stalls /health and every other request", "lessons/l13_structured/server.py",
             "grammar = await asyncio.wait_for(run_in_threadpool(self.compile, spec), COMPILE_TIMEOUT_S)",
             "grammar = self.compile(spec)",
             (f"{L13_SERVER}::test_a_compile_that_blocks_stalls_neither_health_nor_other_requests",)),
    Mutation("l13-compile-deadline-ignored", "L13 server", "the compile's deadline is dropped: a request whose "
             "grammar compiles for ever waits for it instead of a 400 at the deadline",
             "lessons/l13_structured/server.py",
             "grammar = await asyncio.wait_for(run_in_threadpool(self.compile, spec), COMPILE_TIMEOUT_S)",
             "grammar = await run_in_threadpool(self.compile, spec)",
             (f"{L13_SERVER}::test_a_compile_past_its_deadline_is_a_400_that_frees_everything",)),
    Mutation("l13-json-free-whitespace", "L13 structured", "a JSON schema compiles with llguidance's default, free "
             "whitespace between tokens: a weak model loops on spaces (docs/l13_structured_output.md, pitfalls)",
             "lessons/l13_structured/grammar.py",
             "grammar_from_json_schema(ecma_schema(spec.source), defaults=JSON_OPTIONS)",
             "grammar_from_json_schema(ecma_schema(spec.source))",
             ("tests/test_l13_tasks.py::test_grammar_text_of_each_kind_accepts_its_outputs_only",)),
    Mutation("l14-ex-gemv-row", "L14 batch invariance", "a one-row fast path in the invariant matmul sums its "
             "lanes left to right instead of the tree: a row alone rounds unlike the same row in a tile "
             "(docs/l14_batch_invariant.md, exercise)", L14_OPS,
             # the fp32 tile's store, after its tail (L16's block tile stores the same way)
             "load_tail(w + c * k + body, k - body));\n  }\n  for (int r = 0; r < R; ++r)\n"
             "    for (int c = 0; c < C; ++c) put(out + r * n + c, sum_lanes(acc[r][c]));",
             "load_tail(w + c * k + body, k - body));\n  }\n  for (int r = 0; r < R; ++r)\n"
             "    for (int c = 0; c < C; ++c)\n      put(out + r * n + c, R == 1 ? [](auto v) { float l[sizeof v / 4], s = 0; "
             "std::memcpy(l, &v, sizeof v); for (float f : l) s += f; return s; }(acc[r][c]) : sum_lanes(acc[r][c]));",
             ("tests/test_l14_ops.py", "-k", "linear_rows")),
    Mutation("l14-rms-split-by-batch", "L14 batch invariance", "the invariant RMSNorm sums a row's squares one "
             "by one, not in its fixed lanes, when the batch has more than one row: a batch-dependent order", L14_OPS,
             "    for (int64_t r = first; r < last; ++r) norm_row(x + r * e, weight, out + r * e, e, eps);",
             "    for (int64_t r = first; r < last; ++r) {\n      if (rows == 1) { norm_row(x + r * e, weight, out + r * e, e, eps); "
             "continue; }\n      float ss = 0;\n      for (int64_t i = 0; i < e; ++i) ss += float(x[r * e + i]) * float(x[r * e + i]);\n"
             "      const float scale = 1.0f / std::sqrt(ss / float(e) + eps);\n      for (int64_t i = 0; i < e; ++i) "
             "put(out + r * e + i, float(static_cast<T>(float(x[r * e + i]) * scale)) * float(weight[i]));\n    }",
             ("tests/test_l14_ops.py", "-k", "rms_norm")),
    Mutation("l14-decode-attention-backwards", "L14 batch invariance", "L3's kernel gives items of one query row per "
             "head group (decodes) their own path, adding the page's V rows last to first: accurate, but a decode "
             "row and the same prompt row differ in the last bits", CPP,
             "      for (int64_t t = 0; t < n; ++t) {\n        const VT* row = v + t * stride + i0;",
             "      for (int64_t j = 0; j < n; ++j) {\n        const int64_t t = lanes <= 2 ? n - 1 - j : j;\n"
             "        const VT* row = v + t * stride + i0;",
             ("tests/test_l14_ops.py::test_attention_rows_are_the_same_whole_sliced_decoded_and_in_a_crowd",)),
    Mutation("l14-twin-keeps-lm-head", "L14 batch invariance", "the model's twin swaps every Linear but the LM head: "
             "the vocabulary projection stays torch's, whose kernel depends on how many rows get logits",
             "lessons/l14_batch_invariant/model.py", "if isinstance(child, nn.Linear):",
             'if isinstance(child, nn.Linear) and name != "lm_head":',
             ("tests/test_l14_invariance.py::test_needle_alone_equals_needle_among_64_fillers_anywhere",
              "tests/test_l14_tasks.py::test_the_twin_shares_every_weight_and_leaves_the_model_alone")),
    Mutation("l14-walkthrough-hook-returns", "L14 batch invariance", "the walkthrough's forward hook is a lambda that "
             "returns the row it stored: PyTorch replaces the module's output with it, and layer 0 crashes "
             "(docs/l14_batch_invariant.md, pitfalls)", "scripts/l14_walkthrough.py",
             "        def hook(module, args, out=None) -> None:\n"
             "            rows.setdefault(name, (args[0] if out is None else out)[row].float().flatten().clone())\n"
             "        return hook\n",
             "        return lambda module, args, out=None: rows.setdefault(\n"
             "            name, (args[0] if out is None else out)[row].float().flatten().clone())\n",
             ("tests/test_l14_walkthrough.py",)),
    Mutation("l14-first-difference-tolerance", "L14 batch invariance", "first_difference compares the records within "
             "a tolerance (torch.isclose): rows a few units in the last place apart pass as the same "
             "(docs/l14_batch_invariant.md, pitfalls)", "lessons/l14_batch_invariant/record.py",
             "differs = (a.view(torch.int32) != b.view(torch.int32)).nonzero()",
             "differs = (~torch.isclose(a, b)).nonzero()",
             ("tests/test_l14_tasks.py::test_first_difference_names_the_output_the_token_and_the_bit",)),
    Mutation("l14-record-every-verify-row", "L14 batch invariance", "the record keeps every row of a verify group, "
             "each output index's first: a row past a rejected draft (it saw the draft) stands for the token the next "
             "step chose (docs/l14_batch_invariant.md, pitfalls; keeping every row with later rows overwriting is "
             "harmless)", "lessons/l14_batch_invariant/record.py",
             "                for j, row in enumerate(copy[:len(tokens)]):\n"
             "                    self.rows.setdefault(seq.seq_id, {})[len(seq.output_ids) + j] = row\n",
             "                for j, row in enumerate(copy):  # every row of the group\n"
             "                    self.rows.setdefault(seq.seq_id, {}).setdefault(len(seq.output_ids) + j, row)\n",
             ("tests/test_l14_tasks.py::test_the_record_keeps_the_row_each_output_token_was_chosen_from",)),
    Mutation("l15-register-before-pull", "L15 disaggregation", "D files the blocks it took for a pull in its prefix "
             "cache at once, before their pages have landed: a request admitted meanwhile, or any request after a "
             "failed pull, hits blocks holding stale K/V (docs/l15_disaggregated.md, pitfalls)", L15C,
             "        return PendingLoad(list(prompt_ids), params, keys, hits, manager.alloc(want))",
             "        pending = PendingLoad(list(prompt_ids), params, keys, hits, manager.alloc(want))\n"
             "        self._register(pending)  # filed now: the request's admission will hit them\n"
             "        return pending",
             (f"{L15T}::test_blocks_in_flight_enter_ds_cache_only_once_their_pages_have_landed", *L15_FAILED_PULL)),
    Mutation("l15-register-on-failure", "L15 disaggregation", "D files the pulled blocks whether or not the pull "
             "completed: after a prefill engine dies mid-transfer, zeros or half a prompt's pages sit in D's cache "
             "under the prompt's keys (docs/l15_disaggregated.md, pitfalls)", L15C,
             "        manager = self.engine.allocator\n        if pending.error:\n",
             "        manager = self.engine.allocator\n        self._register(pending)  # whatever came\n"
             "        if pending.error:\n",
             L15_FAILED_PULL),
    Mutation("l15-alloc-before-sharing-hits", "L15 disaggregation", "D allocates the pull's blocks before it takes its "
             "own hits: with no free block left, alloc evicts a hit, the prompt's chain breaks in D's cache and the "
             "admission recomputes what was pulled (docs/l15_disaggregated.md, pitfalls)", L15C,
             "        manager.share(hits)  # first: alloc below must not evict the blocks just hit\n"
             "        return PendingLoad(list(prompt_ids), params, keys, hits, manager.alloc(want))",
             "        fresh = manager.alloc(want)\n        manager.share(hits)\n"
             "        return PendingLoad(list(prompt_ids), params, keys, hits, fresh)",
             (f"{L15T}::test_d_holds_its_own_hits_before_it_allocates_so_a_full_pool_evicts_none",)),
    Mutation("l15-lease-freed-under-reader", "L15 disaggregation", "P frees a released or expired lease's blocks while "
             "a pull is still reading them: a new prefill can write those blocks mid-send, and D files another "
             "prompt's K/V (docs/l15_disaggregated.md, pitfalls)", L15C,
             "if (lease.released or lease.deadline <= now) and lease.readers == 0:",
             "if lease.released or lease.deadline <= now:",
             (f"{L15T}::test_a_lease_is_read_until_released_or_expired_and_freed_only_when_nobody_reads",)),
    Mutation("l15-read-before-length-check", "L15 disaggregation", "receive reads a message's payload before checking "
             "its header's length: a corrupt or hostile header announcing a terabyte makes D wait for (and buffer) "
             "bytes it must refuse (docs/l15_disaggregated.md, pitfalls)", "lessons/l15_disaggregated/transfer.py",
             "    name = KINDS[kind]\n    limit = MAX_TEXT if name == \"refused\" else most\n",
             "    name = KINDS[kind]\n    payload = read_exact(sock, length)\n"
             "    limit = MAX_TEXT if name == \"refused\" else most\n",
             (f"{L15T}::test_a_header_is_refused_before_its_payload_is_read",),
             more=(("lessons/l15_disaggregated/transfer.py", "    return name, read_exact(sock, length), count",
                    "    return name, payload, count"),)),
    Mutation("l15-ex-fingerprint-no-mode", "L15 disaggregation", "the fingerprint leaves out L14's mode: a decode "
             "engine in the mode files pages a default-mode prefill engine rounded its own way, and is no longer "
             "bitwise a colocated engine (docs/l15_disaggregated.md, exercise)",
             "lessons/l15_disaggregated/fingerprint.py",
             "    h.update(f\"{pool.k[0].dtype} {engine.block_size} "
             "{getattr(engine, 'batch_invariant', False)}\".encode())",
             "    h.update(f\"{pool.k[0].dtype} {engine.block_size}\".encode())",
             (f"{L15T}::test_the_fingerprint_tells_apart_mode_pool_dtype_block_size_and_weights",)),
    # No planted FMA in the blocks' dequantize: d q is exact in fp32 (an fp16's 11 significant bits times a q of 4 or
    # 8 bits), so d q + m rounds once, fused or not (GCC 12 does fuse it, -O3 -march=native), and no test can tell:
    # nothing to plant (shared/cpu_ops.cpp says why beside the formats).
    Mutation("l16-interleaved-nibbles", "L16 weight quantization", "quantize packs byte j as weights 2j and 2j + 1, "
             "the order a reader guesses: GGUF's Q4_1 puts weight j low and j + 16 high, so every file it writes is "
             "read back scrambled by gguf, llama.cpp and the kernel (docs/l16_weight_quant.md, pitfalls)", L16B,
             "        nibbles = q[:, :16] | (q[:, 16:] << 4)  # byte j: weight j low, weight j + 16 high",
             "        nibbles = q[:, 0::2] | (q[:, 1::2] << 4)  # byte j: weights 2j and 2j + 1",
             (f"{L16BT}::test_a_q4_1_block_by_hand", *L16_GGUF_BYTES)),
    Mutation("l16-no-unpermute", "L16 weight quantization", "read_gguf keeps a Llama file's q and k rows in "
             "llama.cpp's order: rotary embedding pairs the wrong dimensions and the model's attention is noise "
             "(a Qwen3 file would not show it: llama.cpp permutes no Qwen3 rows) (docs/l16_weight_quant.md, pitfalls)",
             "lessons/l16_weight_quant/gguf_file.py",
             "            rows = unpermute_rows(rows, heads)\n",
             "            rows = rows  # as the file holds them\n",
             (f"{L16ET}::test_read_gguf_puts_a_llama_files_q_and_k_rows_back",)),
    Mutation("l16-fp16-scale-rounding", "L16 weight quantization", "quantize divides by the scale after rounding it "
             "to fp16, as it is stored: sounder-looking, but llama.cpp's reference rounds each q with the fp32 scale, "
             "so some weights get another q than every GGUF writer gives them (docs/l16_weight_quant.md)", L16B,
             "        d = x.abs().amax(1, keepdim=True) / 127\n",
             "        d = (x.abs().amax(1, keepdim=True) / 127).half().float()\n",
             L16_GGUF_BYTES,
             more=((L16B, "        d = (hi - lo) / 15\n", "        d = ((hi - lo) / 15).half().float()\n"),)),
    Mutation("l16-round-half-even", "L16 weight quantization", "quantize rounds Q8_0's q with torch.round (halves to "
             "even) instead of C's roundf (halves away from zero): a weight exactly between two steps gets another "
             "q than gguf and llama.cpp give it (docs/l16_weight_quant.md)", L16B,
             "        q = round_half_away(x * inv).to(torch.int8)",
             "        q = torch.round(x * inv).to(torch.int8)",
             (f"{L16BT}::test_a_q8_0_block_by_hand", *L16_GGUF_BYTES)),
    Mutation("l16-prefill-through-blocks", "L16 weight quantization", "QuantLinear takes the block kernel for every "
             "row count: a prompt of more than 16 tokens sums in the kernel's order, not torch's GEMM's, so the "
             "logits are no longer bitwise the dequantized fp32 model's (docs/l16_weight_quant.md, pitfalls)",
             "lessons/l16_weight_quant/quant_linear.py",
             "        if self.every_row or x.numel() <= FEW_ROWS * self.in_features:",
             "        if self.every_row or x.numel() > 0:  # the kernel for every row count",
             ("tests/test_l16_kernel.py::test_quant_linear_takes_the_kernel_for_few_rows_and_torchs_gemm_beyond_bitwise"
              "_the_fp32_linear", f"{L16ET}::test_the_engine_is_bitwise_the_dequantized_fp32_model")),
    Mutation("l16-ex-invariant-every-row", "L16 weight quantization", "L16Engine forgets every_row in L14's mode: a "
             "prompt's rows take torch's GEMM over the dequantized matrix, whose order depends on the row count, so a "
             "request's logits depend on what else runs (docs/l16_weight_quant.md, exercise)",
             "lessons/l16_weight_quant/engine.py",
             "            for module in model.modules():\n                if isinstance(module, QuantLinear):\n"
             "                    module.every_row = True\n",
             "",
             (f"{L16ET}::test_l14s_mode_is_bitwise_the_dequantized_model_in_it_and_batch_invariant",)),
]
