"""Planted learner bugs for scripts/mutation_check.py: one exact snippet swap each, and the behavioural
tests (never tests/test_docs.py) expected to catch it. `old` must occur exactly once in `file`."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    id: str
    area: str
    description: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments: node ids, files, or "-k", "expr"


L1L2_PARITY = ("tests/test_l1_l2_parity.py::test_default_model_l1_l2_hf_ignore_eos",)
L3_PARITY = ("tests/test_l3_engine.py::test_batch_matches_hf_alone",)
REQ = "lessons/l2_token_flat/request.py"
META = "lessons/l3_block_tensor/batch_meta.py"
L4S = "lessons/l4_continuous/scheduler.py"
L5S = "lessons/l5_preemption/scheduler.py"
HOST = "lessons/l5_preemption/host_pool.py"
SAMP = "lessons/l4_continuous/sampling.py"

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
    # --- shared attention / model ---
    Mutation("mask-strict", "masks", "causal mask excludes the diagonal (< instead of <=)",
             "shared/attention.py", "[None, :] <= q_pos", "[None, :] < q_pos", ("tests/test_l3_torch_backend.py",)),
    Mutation("mask-top-left", "masks", "causal mask top-left aligned (query i at position i, not Tk - Tq + i)",
             "shared/attention.py", "torch.arange(tk - tq, tk, device=q.device)", "torch.arange(0, tq, device=q.device)",
             ("tests/test_l3_torch_backend.py",)),
    Mutation("rope-keys-unrotated", "positions", "keys cached before RoPE (only q rotated)",
             "shared/model.py", "q, k = rope(q, k, positions)", "q, _ = rope(q, k, positions)", L1L2_PARITY),
    # --- L2: token-flat pool ---
    Mutation("slot-offset-div", "slot math", "slot offset pos // S instead of pos % S",
             REQ, "* self.block_size + pos % self.block_size", "* self.block_size + pos // self.block_size",
             ("tests/test_l2_reserve.py",)),
    Mutation("slot-logical-block", "slot math", "slot uses the logical block index, not the physical block id",
             REQ, "return self.blocks[pos // self.block_size] * self.block_size",
             "return (pos // self.block_size) * self.block_size", ("tests/test_l2_reserve.py", "tests/test_l3_batch_meta.py")),
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
             ("tests/test_l1_l2_parity.py", "-k", "prefill_once")),
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
             META, "pages += r.blocks[:n_pages]", "pages += r.blocks", ("tests/test_l3_batch_meta.py",)),
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
]
