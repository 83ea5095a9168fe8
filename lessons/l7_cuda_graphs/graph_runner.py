"""L3's paged runner plus a decode path over static buffers: one step per captured size, padded up to it.

On CUDA (with FlashInfer) each size's step is captured into a CUDA graph and replayed. On CPU there are
no CUDA graphs: the same code fills the same buffers, pads the same way and writes the same dummy block,
and "replay" simply runs the step eagerly over those buffers. Steps with prefill tokens, and batches
above the largest size, take L3's eager path unchanged.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable

import torch

from lessons.l2_token_flat.request import Request
from lessons.l3_block_tensor.backends import AttentionBackend
from lessons.l3_block_tensor.batch_meta import BatchMeta
from lessons.l3_block_tensor.runner import PagedRunner
from lessons.l7_cuda_graphs.capture_sizes import padded_size
from lessons.l7_cuda_graphs.static_buffers import StaticDecodeBuffers
from shared.model import Qwen3ForCausalLM


@dataclass
class SizedStep:
    """What one captured size owns: its metadata (views of the static buffers) and its own backend."""

    size: int
    meta: BatchMeta
    backend: AttentionBackend
    # meta -> hidden [size, E], a view of buffers.hidden. A CUDA graph ignores the argument: it replays with
    # the addresses it captured, and the buffers behind them hold this step's values.
    replay: Callable[[BatchMeta], torch.Tensor] = lambda meta: torch.empty(0)


class GraphRunner(PagedRunner):
    def __init__(self, model: Qwen3ForCausalLM, block_size: int, num_blocks: int, backend: str | AttentionBackend = "auto"):
        super().__init__(model, block_size, num_blocks, backend)
        self.backend_choice = backend
        self.sizes: list[int] = []
        self.steps: dict[int, SizedStep] = {}
        self.dummy_block = -1
        self.captures: Counter[int] = Counter()  # size -> times captured (must stay 1)
        self.replays: Counter[int] = Counter()  # size -> decode steps run from it
        self.eager_steps = self.real_rows = self.padded_rows = 0
        self._active: SizedStep | None = None

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.device.type == "cuda" and self.backend.name == "flashinfer"

    # Task L7.5: capture every size once, largest first, over all-padded buffers (writes reach the dummy block only)
    def capture(self, sizes: list[int], dummy_block: int) -> None:
        """Build every size's step, largest first. Called once, after the engine reserved dummy_block."""
        self.sizes, self.dummy_block = sorted(sizes), dummy_block
        if not sizes:
            return  # --graphs off: every step eager, exactly L6
        cfg, dtype = self.model.config, self.model.lm_head.weight.dtype
        # A block may sit in every row's table (a shared prefix), so a row can name up to every block.
        max_pages = max(sizes) * self.pool.num_blocks
        self.buffers = StaticDecodeBuffers(max(sizes), max_pages, cfg.hidden_size, dtype, self.device)
        if self.uses_cuda_graphs:
            from lessons.l7_cuda_graphs import cuda_graph

            workspace, pool = cuda_graph.new_workspace(self.device), cuda_graph.new_pool()
        for size in reversed(self.sizes):  # largest first: the smaller graphs fit in the memory it pooled
            if self.uses_cuda_graphs:
                backend = cuda_graph.GraphDecodeBackend(cfg, dtype, size, max_pages, workspace)
            elif isinstance(self.backend_choice, str):
                backend = self.make_backend(self.backend_choice, dtype)
            else:
                backend = self.backend_choice
            step = SizedStep(size, self.padded_meta(size), backend)
            # Capture with every row padded: the recorded writes land in the dummy block, and no request's
            # block is allocated or touched to make a batch to capture with.
            self.buffers.fill([], size, dummy_block, self.block_size)
            meta = self.step_meta(step)
            backend.plan(meta)
            if self.uses_cuda_graphs:
                graph = cuda_graph.capture(lambda s=step, m=meta: self.run_static(s, m), pool)
                step.replay = lambda _meta, g=graph: g()
            else:
                step.replay = lambda m, s=step: self.run_static(s, m)
                step.replay(meta)  # the CPU stand-in for capture: one run over the buffers
            self.steps[size] = step
            self.captures[size] += 1

    # Task L7.3: a size's BatchMeta as views of the static buffers; kv_indices cut to the pages filled
    def padded_meta(self, size: int) -> BatchMeta:
        b = self.buffers
        qo = torch.arange(size + 1, dtype=torch.int32)  # one query row per request, fixed for the size
        return BatchMeta(
            block_size=self.block_size,
            qo_indptr=qo.pin_memory() if self.device.type == "cuda" else qo,
            kv_indptr=b.kv_indptr[: size + 1],
            kv_indices=b.kv_indices,  # whole buffer; step_meta cuts it to each step's pages
            kv_last_page_len=b.kv_last_page_len[:size],
            positions=b.positions[:size],
            slot_mapping=b.slot_mapping[:size],
            last_rows=torch.arange(size, device=self.device),
            decode_only=True,
        )

    # Task L7.3: a size's BatchMeta as views of the static buffers; kv_indices cut to the pages filled
    def step_meta(self, step: SizedStep) -> BatchMeta:
        """The size's metadata with kv_indices cut to the pages this fill wrote: plan() reads (and on CUDA
        copies to the device) only those, not the whole buffer."""
        used = int(self.buffers.kv_indptr[step.size])
        return replace(step.meta, kv_indices=self.buffers.kv_indices[:used])

    # Task L7.6: a decode step replays the smallest size that holds it; prefill steps and bigger batches run eagerly
    def graph_size(self, requests: list[Request]) -> int | None:
        """The captured size this step runs at, or None to run it eagerly."""
        if any(r.num_tokens - r.num_cached != 1 for r in requests):
            return None  # prefill tokens: variable length, nothing static to replay
        return padded_size(self.sizes, len(requests))

    # Task L7.6: a decode step replays the smallest size that holds it; prefill steps and bigger batches run eagerly
    def forward(self, requests: list[Request]) -> torch.Tensor:
        size = self.graph_size(requests)
        if size is None:
            self.eager_steps += 1
            return super().forward(requests)
        step, n = self.steps[size], len(requests)
        self.buffers.fill(requests, size, self.dummy_block, self.block_size)
        meta = self.step_meta(step)
        step.backend.plan(meta)  # outside the graph: host work reading this step's page table
        hidden = step.replay(meta)  # [size, E]
        for r in requests:
            r.num_cached = r.num_tokens
        self.replays[size] += 1
        self.real_rows, self.padded_rows = self.real_rows + n, self.padded_rows + size - n
        return self.model.logits(hidden[:n])  # real rows only: padded rows never reach the sampler

    # Task L7.4: the recorded step: the model over the static buffers into static hidden, with its size's backend
    def run_static(self, step: SizedStep, meta: BatchMeta) -> torch.Tensor:
        """The step a graph records: model over the static buffers, output into the static hidden buffer."""
        b, size = self.buffers, step.size
        self._active = step
        try:
            out = self.model(b.input_ids[:size], b.positions[:size], self, meta)
        finally:
            self._active = None
        b.hidden[:size].copy_(out)
        return b.hidden[:size]

    # Task L7.4: the recorded step: the model over the static buffers into static hidden, with its size's backend
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        # Write first: each request's new tokens must see themselves (the diagonal of the causal mask).
        self.pool.write(layer, k, v, meta.slot_mapping)  # padded rows write the dummy block's slot 0
        # A static step attends with its own size's backend (on CUDA: the graph-mode wrapper planned for it).
        backend = self._active.backend if self._active is not None else self.backend
        return backend.run(q, self.pool.k[layer], self.pool.v[layer], meta)
