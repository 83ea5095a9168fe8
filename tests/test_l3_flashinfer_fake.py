"""The FlashInfer backend's step logic on CPU, with a stand-in `flashinfer` module.

The stand-in's wrappers keep FlashInfer's documented behaviour that matters here (plan stores the CSR
tables, q_data_type defaults to float16 and must match q, causal defaults to False, decode is one query
per request) and compute attention from what plan received. So the real backend code runs end to end:
which wrapper each step picks, what it plans, that it runs once per layer, and the tokens equal HF's.
"""
from __future__ import annotations

import sys
import types

import torch

from lessons.l3_block_tensor import L3Engine
from lessons.l3_block_tensor.backends.flashinfer_backend import FlashInferBackend
from shared.attention import causal_attention
from shared.generation import StopRule


class FakeWrapper:
    decode = False
    calls: list[tuple[str, str]]

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_tensor_cores: bool = False):
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        assert not float_workspace_buffer.any(), "the workspace must start zeroed"

    def plan(self, *args, **kw) -> None:
        assert not args, "positional optionals are deprecated: pass keywords"
        if self.decode:
            kw = {"qo_indptr": torch.arange(kw["indptr"].numel(), dtype=torch.int32), "paged_kv_indptr": kw["indptr"],
                  "paged_kv_indices": kw["indices"], "paged_kv_last_page_len": kw["last_page_len"], "causal": True, **kw}
        for name in ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"):
            assert kw[name].dtype == torch.int32 and kw[name].device.type == "cpu", name
        self.kw = kw
        self.calls.append(("decode" if self.decode else "prefill", "plan"))

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        kw = self.kw
        if kw.get("q_data_type", torch.float16) != q.dtype:  # FlashInfer raises on this mismatch too
            raise ValueError("q dtype does not match the planned q_data_type")
        k_cache, v_cache = paged_kv_cache
        s = kw["page_size"]
        qo, kv, idx, last = (kw[n].tolist() for n in ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"))
        assert q.shape[0] == qo[-1] and k_cache.shape[1] == s
        outs = []
        for b in range(len(last)):
            k = torch.cat([k_cache[p] for p in idx[kv[b]: kv[b + 1]]])[: s * (kv[b + 1] - kv[b] - 1) + last[b]]
            v = torch.cat([v_cache[p] for p in idx[kv[b]: kv[b + 1]]])[: k.shape[0]]
            qb = q[qo[b]: qo[b + 1]]
            if kw.get("causal", False):
                outs.append(causal_attention(qb, k, v))
            else:  # what the real kernel does with causal=False: every query sees the whole history
                outs.append(torch.cat([causal_attention(qb[i: i + 1], k, v) for i in range(qb.shape[0])]))
        self.calls.append(("decode" if self.decode else "prefill", "run"))
        return torch.cat(outs)


def fake_flashinfer(calls: list) -> types.ModuleType:
    mod = types.ModuleType("flashinfer")
    mod.BatchPrefillWithPagedKVCacheWrapper = type("Prefill", (FakeWrapper,), {"calls": calls})
    mod.BatchDecodeWithPagedKVCacheWrapper = type("Decode", (FakeWrapper,), {"decode": True, "calls": calls})
    return mod


def test_flashinfer_backend_end_to_end_with_a_stand_in_kernel(tiny_model, hf, prompt_ids, monkeypatch):
    calls: list[tuple[str, str]] = []
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer(calls))
    cfg, cpu = tiny_model.config, torch.device("cpu")
    backend = FlashInferBackend(cfg, torch.float32, cpu)  # the real backend, fp32 so HF parity is exact
    stop = StopRule(5, ignore_eos=True)
    assert L3Engine(tiny_model, block_size=7, backend=backend).generate_batch(prompt_ids, stop) == [
        hf.generate(p, stop).tokens for p in prompt_ids
    ]
    layers = cfg.num_hidden_layers
    per_step = [calls[i: i + 1 + layers] for i in range(0, len(calls), 1 + layers)]
    assert len(per_step) == 5  # one plan, then one run per layer, each step
    assert per_step[0] == [("prefill", "plan")] + [("prefill", "run")] * layers
    assert all(st == [("decode", "plan")] + [("decode", "run")] * layers for st in per_step[1:])
