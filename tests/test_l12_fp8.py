"""L12's fp8 pages without a GPU: the e4m3 pool, the torch oracle that reads it on the CPU, an engine run, the
quality it measures, and the FlashInfer fp8 backend's calls checked against FlashInfer's signatures.

FlashInfer's arithmetic for fp8 pages (flashinfer-python 0.7.2.post1, decode.py / prefill.py, the paged wrappers'
`run`): `sm_scale *= k_scale` before the kernel (the key scale multiplies every score) and `out *= v_scale` after
it (the value scale multiplies the output). SIGNATURES below copies the parameters of the calls we make from that
release; the tests bind our arguments to them here, and to the installed package's where flashinfer is installed.
"""
from __future__ import annotations

import inspect
import math
import sys
import types
from dataclasses import replace

import pytest
import torch

from lessons.l2_token_flat.request import Request
from lessons.l3_block_tensor.backends import flashinfer_args as fa
from lessons.l3_block_tensor.backends.torch_backend import history_slots
from lessons.l3_block_tensor.batch_meta import BatchMeta
from lessons.l3_block_tensor.runner import PagedRunner
from lessons.l12_kv_quant import fp8
from lessons.l12_kv_quant.engine import L12Engine, default_kv_bytes, storage_dtype
from lessons.l12_kv_quant.fp8 import FP8, Fp8FlashInferBackend, Fp8KvPool, Fp8TorchBackend, fp8_backend
from lessons.l12_kv_quant.kv_pool import block_bytes
from lessons.l12_kv_quant.quality import compare, holds, teacher_forced_logits
from lessons.l12_kv_quant.runner import KV_DTYPES, quantized
from shared.attention import causal_attention
from shared.errors import CourseError
from shared.generation import StopRule
from shared.model import Qwen3ForCausalLM

CPU = torch.device("cpu")
NUM_BLOCKS = 64
SELF = object()  # stands in for a wrapper instance: constructing a real one needs a GPU


# ---------------------------------------------------------------------------------------------- the pool

def test_e4m3_round_trip_is_within_half_a_step_and_outliers_saturate():
    """e4m3 keeps 3 mantissa bits: a normal value (|x| / scale >= 2^-6) comes back within 2^-4 of itself, a
    subnormal within half the 2^-9 step; beyond 448 * scale it saturates, never inf or NaN."""
    torch.manual_seed(0)
    for scale in (1.0, 0.05):
        x = torch.cat([torch.randn(4000) * 10 ** torch.empty(4000).uniform_(-4, 2), torch.zeros(8),
                       torch.tensor([447.0, -448.0, 500.0, -1e6]) * scale])
        back = fp8.from_fp8(fp8.to_fp8(x, scale), scale)
        inside = x.abs() <= fp8.FP8_MAX * scale
        bound = torch.maximum(x.abs() * 2.0**-4, torch.full_like(x, 2.0**-10 * scale))
        assert bool(((back - x).abs() <= bound * (1 + 1e-6))[inside].all())
        assert bool((back[~inside] == x[~inside].sign() * fp8.FP8_MAX * scale).all())
        assert bool((back[x == 0] == 0).all()) and bool(torch.isfinite(back).all())


def test_pool_writes_through_its_scales_and_every_layer_has_its_own(tiny_model):
    cfg = tiny_model.config
    pool = Fp8KvPool(cfg, 8, 4, CPU)
    assert pool.k[0].dtype == FP8 and pool.k[0].shape == (8, 4, cfg.num_key_value_heads, cfg.head_dim)
    assert pool.k_scale == pool.v_scale == [1.0] * cfg.num_hidden_layers  # vLLM's default
    pool.k_scale = [0.5 / (layer + 1) for layer in range(cfg.num_hidden_layers)]
    pool.v_scale = [0.25 / (layer + 1) for layer in range(cfg.num_hidden_layers)]
    k, v = torch.randn(5, cfg.num_key_value_heads, cfg.head_dim), torch.randn(5, cfg.num_key_value_heads, cfg.head_dim)
    slots = torch.tensor([3, 4, 9, 17, 31])
    for layer in range(cfg.num_hidden_layers):
        pool.write(layer, k, v, slots)
        assert pool.scales(pool.k[layer]) == (pool.k_scale[layer], pool.v_scale[layer])
        rows_k = pool.k[layer].flatten(0, 1)[slots].float() * pool.k_scale[layer]
        rows_v = pool.v[layer].flatten(0, 1)[slots].float() * pool.v_scale[layer]
        assert torch.allclose(rows_k, k, rtol=2.0**-4, atol=2.0**-10)
        assert torch.allclose(rows_v, v, rtol=2.0**-4, atol=2.0**-10)
    with pytest.raises(RuntimeError, match="not one of this pool's layers"):
        pool.scales(pool.k[0].clone())
    with pytest.raises(CourseError, match="positive finite"):
        Fp8KvPool(cfg, 8, 4, CPU, scale=0.0)


def test_fp8_block_bytes_are_one_byte_a_value_with_no_scale_per_row(tiny_model):
    cfg = tiny_model.config
    assert "fp8" in KV_DTYPES and storage_dtype("fp8", torch.bfloat16) == FP8
    assert block_bytes(cfg, 16, FP8) == 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * cfg.head_dim
    assert 2 * block_bytes(cfg, 16, FP8) == block_bytes(cfg, 16, torch.bfloat16)
    assert block_bytes(cfg, 16, FP8) < block_bytes(cfg, 16, torch.int8)  # int8 rows carry a 4-byte scale


# -------------------------------------------------------------------------------------- metadata helpers

def step(kind: str, s: int) -> BatchMeta:
    """A mixed prefill step (prompts of 1, s, s+1, 3s+2 tokens, one with a cached prefix) or a decode step,
    as tests/test_l3_flashinfer_contract.py builds them."""
    lengths, blocks, reqs, nxt = [1, s, s + 1, 3 * s + 2], list(range(NUM_BLOCKS))[::-1], [], 0
    for i, n in enumerate(lengths):
        pages = -(-n // s)
        cached = n - 1 if kind == "decode" else (n // 2 if i == 3 else 0)
        reqs.append(Request(list(range(n)), s, blocks=blocks[nxt: nxt + pages], num_cached=cached))
        nxt += pages
    return BatchMeta.build(reqs, s, CPU)


def filled_pool(cfg, s: int) -> Fp8KvPool:
    """Every slot written with random K/V, through per-layer scales that differ from each other and from 1."""
    torch.manual_seed(1)
    pool = Fp8KvPool(cfg, NUM_BLOCKS, s, CPU)
    pool.k_scale = [0.03 * (layer + 1) for layer in range(cfg.num_hidden_layers)]
    pool.v_scale = [0.02 * (layer + 2) for layer in range(cfg.num_hidden_layers)]
    slots = torch.arange(NUM_BLOCKS * s)
    for layer in range(cfg.num_hidden_layers):
        pool.write(layer, torch.randn(len(slots), cfg.num_key_value_heads, cfg.head_dim) * 3,
                   torch.randn(len(slots), cfg.num_key_value_heads, cfg.head_dim), slots)
    return pool


def flashinfer_arithmetic(q, k_pages, v_pages, meta, k_scale, v_scale, cast: bool = True) -> torch.Tensor:
    """What FlashInfer's paged wrappers compute over e4m3 pages, written out: the pages widened as they are
    (no scale), scores times sm_scale * k_scale, a causal softmax aligned bottom-right, weights times V, and the
    output times v_scale. In fp32, cast to q's dtype as FlashInfer's output is (o_data_type = q_data_type)
    unless cast is False."""
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) * k_scale
    k_flat, v_flat = k_pages.flatten(0, 1), v_pages.flatten(0, 1)
    outs = []
    for b in range(meta.batch_size):
        q0, q1 = int(meta.qo_indptr[b]), int(meta.qo_indptr[b + 1])
        slots = history_slots(meta, b)
        qb, kb, vb = q[q0:q1].float(), k_flat[slots].float(), v_flat[slots].float()
        group = qb.shape[1] // kb.shape[1]
        kb, vb = kb.repeat_interleave(group, 1), vb.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qb, kb) * sm_scale
        tq, tk = qb.shape[0], kb.shape[0]
        allowed = torch.arange(tk)[None, :] <= torch.arange(tk - tq, tk)[:, None]
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", weights, vb) * v_scale)
    out = torch.cat(outs)
    return out.to(q.dtype) if cast else out


def dequantize_then_attend(q, k_pages, v_pages, meta, k_scale, v_scale) -> torch.Tensor:
    """The oracle's arithmetic (Fp8TorchBackend.run) on the same arguments, in fp32 and not cast: the rows
    widened and multiplied by their scale, then shared/attention.py's causal attention."""
    k_flat, v_flat = k_pages.flatten(0, 1), v_pages.flatten(0, 1)
    outs = []
    for b in range(meta.batch_size):
        q0, q1, slots = int(meta.qo_indptr[b]), int(meta.qo_indptr[b + 1]), history_slots(meta, b)
        outs.append(causal_attention(q[q0:q1].float(), fp8.from_fp8(k_flat[slots], k_scale),
                                     fp8.from_fp8(v_flat[slots], v_scale)))
    return torch.cat(outs)


@pytest.mark.parametrize("s", [1, 7, 16])
@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_the_oracle_computes_what_flashinfer_computes(tiny_model, s, kind):
    """Dequantize-then-attend (the oracle) equals FlashInfer's scale placement (k_scale on the scores, v_scale
    on the output), layer by layer with each layer's own scales."""
    cfg, meta = tiny_model.config, step(kind, s)
    pool = filled_pool(cfg, s)
    oracle = Fp8TorchBackend(pool)
    oracle.plan(meta)
    q = torch.randn(meta.num_tokens, cfg.num_attention_heads, cfg.head_dim)
    for layer in range(cfg.num_hidden_layers):
        got = oracle.run(q, pool.k[layer], pool.v[layer], meta)
        want = flashinfer_arithmetic(q, pool.k[layer], pool.v[layer], meta, pool.k_scale[layer], pool.v_scale[layer])
        # measured 3.8e-6 (Intel Xeon AMX; torch capped to AVX2 the same): 6x margin
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), f"layer {layer}"


# ------------------------------------------------------------------------ FlashInfer's signatures, recorded

class SIGNATURES:
    """The parameters of the calls we make, copied from flashinfer-python 0.7.2.post1 (its wheel's
    flashinfer/decode.py and flashinfer/prefill.py; built from commit beabf5004585b03da60e927bbb803acbaa62fe36),
    annotations dropped. decode's `plan` takes **kwargs and forwards them to `_plan_impl`: both are here."""

    class Decode:
        def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                     paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                     paged_kv_last_page_len_buffer=None, backend="auto", jit_args=None): ...

        def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                 *deprecated_positional_args, **kwargs): ...

        def _plan_impl(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
                       pos_encoding_mode="NONE", window_left=-1, window_right=0, logits_soft_cap=None,
                       q_data_type="float16", kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None,
                       rope_scale=None, rope_theta=None, non_blocking=True, block_tables=None, seq_lens=None,
                       fixed_split_size=None, disable_split_kv=False, q_len_per_req=1, is_causal=None): ...

        def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
                return_lse=False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=None,
                skip_softmax_threshold_scale_factor=None, kv_cache_sf=None): ...

    class Prefill:
        def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                     paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                     custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None,
                     variant_owns_mask=False): ...

        def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                 num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
                 causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
                 logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
                 o_data_type=None, non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
                 token_pos_in_items_len=0, max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None,
                 max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None, disable_split_kv=False,
                 uniform_q_len=None): ...

        def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
                return_lse=False, lse_base="log2", lse_layout="NH", enable_pdl=None, window_left=None, sinks=None,
                kv_cache_sf=None, skip_softmax_threshold_scale_factor=None, use_fp16_softmax=None,
                uses_spcompress=None): ...


def bind(fn, *args, **kwargs) -> dict:
    return inspect.signature(fn).bind(*args, **kwargs).arguments


def qwen3_8b_like(cfg):
    return replace(cfg, num_attention_heads=32, num_key_value_heads=8, head_dim=128)  # GQA 4: tensor cores


def check_fp8_call_shapes(decode_cls, prefill_cls, cfg, s: int, dtype: torch.dtype) -> None:
    """Our fp8 plan and run arguments bind to these classes' methods, and say what FlashInfer needs."""
    prefill, decode = step("prefill", s), step("decode", s)
    plan = bind(prefill_cls.plan, SELF, **fp8.prefill_plan_kwargs(prefill, cfg, dtype))
    assert plan["kv_data_type"] is FP8 and plan["q_data_type"] == dtype  # q stays 16-bit: FA2's mixed kernel
    assert plan["causal"] is True and plan["pos_encoding_mode"] == "NONE" and plan["page_size"] == s
    kwargs = fp8.decode_plan_kwargs(decode, cfg, dtype)
    bind(decode_cls.plan, SELF, **kwargs)
    impl = bind(decode_cls._plan_impl, SELF, **kwargs)  # where decode's **kwargs land: a typo must fail here
    assert impl["kv_data_type"] is FP8 and impl["q_data_type"] == dtype
    pages = torch.zeros(NUM_BLOCKS, s, cfg.num_key_value_heads, cfg.head_dim, dtype=FP8)
    for meta, cls in ((prefill, prefill_cls), (decode, decode_cls)):
        q = torch.zeros(meta.num_tokens, cfg.num_attention_heads, cfg.head_dim, dtype=dtype)
        run = bind(cls.run, SELF, **fp8.run_kwargs(q, pages, pages.clone(), 0.5, 1))
        k_cache, v_cache = run["paged_kv_cache"]  # a (K, V) tuple, each NHD [pages, page_size, Hkv, D]
        assert k_cache.shape == (NUM_BLOCKS, s, cfg.num_key_value_heads, cfg.head_dim) and k_cache.dtype == FP8
        assert k_cache.stride() == v_cache.stride()  # decode needs K and V with identical strides
        # Python floats: decode's run is annotated Optional[float], and `out *= v_scale` is skipped only when
        # v_scale is the float 1.0 (a tensor 1.0 would cost a multiply every layer).
        assert type(run["k_scale"]) is float and type(run["v_scale"]) is float and run["v_scale"] == 1.0
        assert "q_scale" not in run  # q is not quantized


@pytest.mark.parametrize("s", [1, 7, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("big", [False, True])
def test_fp8_kwargs_bind_to_flashinfers_recorded_signatures(tiny_model, s, dtype, big):
    cfg = qwen3_8b_like(tiny_model.config) if big else tiny_model.config
    ws = torch.zeros(16, dtype=torch.uint8)
    bind(SIGNATURES.Prefill.__init__, SELF, **fa.prefill_init_kwargs(ws))
    assert bind(SIGNATURES.Decode.__init__, SELF, **fa.decode_init_kwargs(ws, cfg))["use_tensor_cores"] == big
    check_fp8_call_shapes(SIGNATURES.Decode, SIGNATURES.Prefill, cfg, s, dtype)


def test_a_misspelled_keyword_fails_the_recorded_binding(tiny_model):
    """The binding is a real check: decode's plan swallows **kwargs, its _plan_impl does not."""
    kwargs = {**fp8.decode_plan_kwargs(step("decode", 4), tiny_model.config, torch.bfloat16), "kv_dtype": FP8}
    bind(SIGNATURES.Decode.plan, SELF, **kwargs)
    with pytest.raises(TypeError):
        bind(SIGNATURES.Decode._plan_impl, SELF, **kwargs)


@pytest.mark.parametrize("s", [1, 16])
def test_fp8_kwargs_bind_to_the_installed_flashinfer(tiny_model, s):
    """Where the flashinfer extra is installed (the GPU machines): the same arguments bind to the real methods,
    and every parameter we pass is still there with the kind recorded above (drift in FlashInfer fails here)."""
    flashinfer = pytest.importorskip("flashinfer", reason="the flashinfer extra is not installed (GPU machines only)")
    decode_cls, prefill_cls = flashinfer.BatchDecodeWithPagedKVCacheWrapper, flashinfer.BatchPrefillWithPagedKVCacheWrapper
    for real, recorded in ((decode_cls._plan_impl, SIGNATURES.Decode._plan_impl), (decode_cls.run, SIGNATURES.Decode.run),
                           (prefill_cls.plan, SIGNATURES.Prefill.plan), (prefill_cls.run, SIGNATURES.Prefill.run)):
        have, want = inspect.signature(real).parameters, inspect.signature(recorded).parameters
        for name in ("kv_data_type", "q_data_type", "k_scale", "v_scale", "paged_kv_cache"):
            if name in want:
                assert name in have and have[name].kind == want[name].kind, f"{real.__qualname__}: {name}"
    for cfg in (tiny_model.config, qwen3_8b_like(tiny_model.config)):
        check_fp8_call_shapes(decode_cls, prefill_cls, cfg, s, torch.bfloat16)


def test_every_wrapper_call_in_the_fp8_backend_goes_through_the_checked_kwargs():
    src = inspect.getsource(Fp8FlashInferBackend)
    calls = [ln.strip() for ln in src.splitlines() if (".plan(" in ln or ".run(" in ln) and not ln.strip().startswith("#")]
    assert len(calls) == 3  # decode plan, prefill plan, run
    for line in calls:
        assert "(**decode_plan_kwargs(" in line or "(**prefill_plan_kwargs(" in line or "(**run_kwargs(" in line, line


# ------------------------------------------------------- the backend driven end to end through a fake FlashInfer

class FakeWrapper:
    """A stand-in for FlashInfer's paged wrappers on the CPU: every call binds to the recorded signature, is
    checked the way FlashInfer checks it (16-bit q, page and q dtypes as planned, NHD tuples with equal strides),
    and `run` computes FlashInfer's fp8 arithmetic and checks it against the oracle's on the same arguments.

    It returns the oracle's output, not its own. The two are the same math in a different fp32 order (scale on
    the scores or on the rows; einsum or SDPA), so they differ by a few fp32 ulps, by how much depends on the
    CPU's kernels (AVX-512 or AVX2 reductions, oneDNN's or MKL's GEMM). Cast to bf16, about one value in ten
    thousand then lands on the neighbouring bf16 value, and a bf16 model carries that step through every later
    layer: 0.06 to 0.27 KL at one position on some CPUs, 2e-7 on others. Returning the oracle's bits makes the
    model's logits comparable exactly on every CPU, so they check the backend's wiring (layer, pages, scales,
    rows) to the bit, while each run's own arithmetic is checked here, where one rounding step is the bound."""

    recorded: type
    calls: list

    def __init__(self, *args, **kwargs):
        init = bind(self.recorded.__init__, SELF, *args, **kwargs)
        assert init["kv_layout"] == "NHD"
        self.plan_args: dict | None = None

    def plan(self, *args, **kwargs):
        bind(self.recorded.plan, SELF, *args, **kwargs)
        plan_impl = getattr(self.recorded, "_plan_impl", self.recorded.plan)
        self.plan_args = bind(plan_impl, SELF, *args, **kwargs)
        assert self.plan_args["q_data_type"] in (torch.float16, torch.bfloat16), "FlashInfer rejects fp32 q"
        self.calls.append(("plan", type(self).__name__, self.plan_args))

    def run(self, *args, **kwargs):
        run = bind(self.recorded.run, SELF, *args, **kwargs)
        q, (k_cache, v_cache) = run["q"], run["paged_kv_cache"]
        assert q.dtype == self.plan_args["q_data_type"] and k_cache.dtype == self.plan_args["kv_data_type"]
        assert k_cache.dim() == 4 and k_cache.stride() == v_cache.stride()
        self.calls.append(("run", type(self).__name__, run))
        p = self.plan_args
        indptr = p.get("paged_kv_indptr", p.get("indptr"))
        meta = BatchMeta(block_size=k_cache.shape[1],
                         qo_indptr=p.get("qo_indptr", torch.arange(indptr.numel(), dtype=torch.int32)),
                         kv_indptr=indptr, kv_indices=p.get("paged_kv_indices", p.get("indices")),
                         kv_last_page_len=p.get("paged_kv_last_page_len", p.get("last_page_len")),
                         positions=torch.empty(0), slot_mapping=torch.empty(0), last_rows=torch.empty(0),
                         decode_only="indptr" in p)
        mine = flashinfer_arithmetic(q, k_cache, v_cache, meta, run["k_scale"], run["v_scale"], cast=False)
        oracle = dequantize_then_attend(q, k_cache, v_cache, meta, run["k_scale"], run["v_scale"])
        # fp32 against fp32: the bound of test_the_oracle_computes_what_flashinfer_computes (measured 2e-6 apart at
        # most, AMD EPYC AVX-512 and Intel Xeon AVX-512/AMX); the outputs, in q's dtype, one rounding step apart.
        assert torch.allclose(mine, oracle, atol=1e-5, rtol=1e-4), "FlashInfer's scale placement is not the oracle's"
        step = torch.finfo(q.dtype).eps * oracle.abs() + 1e-6
        assert bool(((mine.to(q.dtype).float() - oracle.to(q.dtype).float()).abs() <= step).all())
        return oracle.to(q.dtype)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    calls: list = []
    decode = type("BatchDecodeWithPagedKVCacheWrapper", (FakeWrapper,), {"recorded": SIGNATURES.Decode, "calls": calls})
    prefill = type("BatchPrefillWithPagedKVCacheWrapper", (FakeWrapper,), {"recorded": SIGNATURES.Prefill, "calls": calls})
    module = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=decode, BatchPrefillWithPagedKVCacheWrapper=prefill)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(fa, "WORKSPACE_BYTES", 16)  # the CPU stand-in needs no 128 MiB workspace
    return calls


@pytest.fixture(scope="module")
def model_bf16(tiny_dir) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.from_dir(tiny_dir, torch.bfloat16, CPU)


def test_the_flashinfer_fp8_backend_gives_the_oracles_logits(model_bf16, prompt_ids, fake_flashinfer):
    """A bf16 model over fp8 pages with per-layer scales, teacher-forced over a long prompt in chunks (prefill
    plans) and then token by token (decode plans): each of FlashInfer's calls, made by our backend, computes
    the oracle's attention within one bf16 rounding (the stand-in checks it), and with the oracle's bits the
    model gives the oracle's logits exactly; each layer's run gets that layer's pages and scales as floats."""
    cfg, stream = model_bf16.config, prompt_ids[3]
    runners = [quantized(PagedRunner, "fp8")(model_bf16, 16, 16, "torch") for _ in range(2)]
    for r in runners:
        r.pool.k_scale = [2.0 ** -(layer % 3) * 0.75 for layer in range(cfg.num_hidden_layers)]
        r.pool.v_scale = [0.05 * (layer + 1) for layer in range(cfg.num_hidden_layers)]
    runners[1].backend = Fp8FlashInferBackend(cfg, torch.bfloat16, CPU, runners[1].pool)
    assert runners[1].backend.name == "flashinfer-fp8"  # not "flashinfer": L7 captures no graph for it

    def logits(runner):
        blocks = runner.allocator.alloc(-(-len(stream) // 16))
        out, start = [], 0
        for end in [40, *range(41, len(stream) + 1)]:  # one prefill step, then decodes
            req = Request(stream[:end], 16, blocks=blocks, num_cached=start)
            meta = BatchMeta.build([req], 16, CPU)
            runner.backend.plan(meta)
            hidden = runner.model(torch.tensor(stream[start:end]), meta.positions, runner, meta)
            out.append(runner.model.logits(hidden).float())
            start = end
        return torch.cat(out)

    want, got = logits(runners[0]), logits(runners[1])
    assert torch.equal(want, got)  # any wiring mistake (a layer's pages or scales, rows out of order) shows here
    plans = [c for c in fake_flashinfer if c[0] == "plan"]
    decodes = len(stream) - 40
    assert [c[1] for c in plans] == ["BatchPrefillWithPagedKVCacheWrapper"] + ["BatchDecodeWithPagedKVCacheWrapper"] * decodes
    runs = [c[2] for c in fake_flashinfer if c[0] == "run"]
    assert len(runs) == len(plans) * cfg.num_hidden_layers
    pool = runners[1].pool
    for i, run in enumerate(runs):
        layer = i % cfg.num_hidden_layers
        assert run["paged_kv_cache"][0] is pool.k[layer] and run["paged_kv_cache"][1] is pool.v[layer]
        assert (run["k_scale"], run["v_scale"]) == (pool.k_scale[layer], pool.v_scale[layer])


# ------------------------------------------------------------------------------------- choosing a backend

def test_backend_choice_for_fp8_pages(tiny_model, capsys):
    cfg, pool = tiny_model.config, Fp8KvPool(tiny_model.config, 4, 4, CPU)
    assert isinstance(fp8_backend("auto", cfg, torch.float32, CPU, pool), Fp8TorchBackend)  # CPU: the oracle
    assert isinstance(fp8_backend("torch", cfg, torch.float32, CPU, pool), Fp8TorchBackend)
    for name in ("cpp", "batched", "bogus"):
        with pytest.raises(CourseError, match="FlashInfer on CUDA .* or the torch oracle"):
            fp8_backend(name, cfg, torch.float32, CPU, pool)
    with pytest.raises(CourseError, match="cannot read fp8 pages: FlashInfer needs a CUDA device"):
        fp8_backend("flashinfer", cfg, torch.bfloat16, CPU, pool)
    # CUDA named where FlashInfer cannot run (here: no flashinfer, or fp32 q): auto says why, once, and reads with
    # the oracle. Nothing is allocated on the device to choose.
    fp8._said_why_not_flashinfer = False
    assert isinstance(fp8_backend("auto", cfg, torch.float32, torch.device("cuda"), pool), Fp8TorchBackend)
    assert "fp8 pages are read by the torch oracle" in capsys.readouterr().err
    with pytest.raises(CourseError, match="--backend flashinfer cannot read fp8 pages"):
        fp8_backend("flashinfer", cfg, torch.float32, torch.device("cuda"), pool)


def test_an_fp8_runner_refuses_the_cpp_kernel(tiny_model):
    with pytest.raises(CourseError, match="C\\+\\+ kernel reads int8 pages"):
        quantized(PagedRunner, "fp8")(tiny_model, 16, 4, "cpp")
    runner = quantized(PagedRunner, "fp8")(tiny_model, 16, 4, "auto")
    assert type(runner).__name__ == "Fp8PagedRunner" and isinstance(runner.pool, Fp8KvPool)
    assert isinstance(runner.backend, Fp8TorchBackend) and runner.backend.pool is runner.pool


# -------------------------------------------------------------------------------- the engine and its quality

@pytest.fixture(scope="module")
def fp8_run(tiny_model, prompt_ids):
    """L12's engine with fp8 pages over the fp32 model, the torch oracle reading them, on the CPU."""
    engine = L12Engine(tiny_model, 16, None, 4, "torch", kv_dtype="fp8")
    outputs = engine.generate_batch(prompt_ids, StopRule(24, ignore_eos=True))
    return engine, outputs


def test_an_fp8_engine_run_finishes_with_no_leak_in_twice_the_bf16_blocks(tiny_model, fp8_run):
    engine, outputs = fp8_run
    assert [len(o) for o in outputs] == [24] * len(outputs)
    assert engine.allocator.num_free == engine.usable_blocks  # every request's blocks came back
    assert [b for b, r in enumerate(engine.allocator.ref) if r] == [engine.dummy_block]
    assert isinstance(engine.runner.pool, Fp8KvPool) and engine.runner.pool.k[0].dtype == FP8
    cfg = tiny_model.config
    assert engine.kv_bytes == default_kv_bytes(cfg, 16, torch.float32)  # L11's fp32 pool's bytes ...
    bf16_blocks = engine.kv_bytes // block_bytes(cfg, 16, torch.bfloat16)
    assert engine.allocator.num_blocks == 2 * bf16_blocks + 1  # ... hold twice bf16's blocks (+ L7's dummy)


@pytest.fixture(scope="module")
def fp8_quality(tiny_model, tiny_dir, prompt_ids, fp8_run):
    """Teacher-forced over the prompts and the fp8 engine's own continuations (a few hundred positions): fp8 and
    int8 pages against full-precision KV, and the bf16 yardstick."""
    streams = [p + o for p, o in zip(prompt_ids, fp8_run[1])]
    n = 2 + max(len(s) for s in streams) // 16
    bf16 = Qwen3ForCausalLM.from_dir(tiny_dir, torch.bfloat16, CPU)
    return compare(PagedRunner(tiny_model, 16, n, "torch"),
                   {"fp8": quantized(PagedRunner, "fp8")(tiny_model, 16, n, "torch"),
                    "int8": quantized(PagedRunner, "int8")(tiny_model, 16, n, "torch"),
                    "bf16": PagedRunner(bf16, 16, n, "torch")}, streams)


def test_fp8_pages_keep_the_distributions_close_but_coarser_than_int8(fp8_quality):
    """e4m3's 3 mantissa bits (an error up to 1/16 of each value) against int8's per-row 8 bits: fp8 moves the
    logits more than int8 does, and still keeps them recognisably the model's (a lost scale or a wrong layer's
    pages gives KL of several nats and top-1 near chance)."""
    q = fp8_quality
    assert q["fp8"].positions > 200
    # measured KL mean 0.286, top-1 74.4% (207 positions; Intel Xeon AMX, torch capped to AVX2, the same): 3.5x under
    # the KL bound, 14 points (30 positions) over the top-1 one, disagreement 1.6x under its 40%
    assert q["fp8"].mean_kl < 1.0 and q["fp8"].top1 > 0.6
    assert q["fp8"].mean_kl > q["int8"].mean_kl and q["fp8"].top1 < q["int8"].top1


@pytest.mark.xfail(strict=True, reason="measured: fp8 KV (e4m3, 3 mantissa bits) moves the embedded model's "
                   "logits about 12x more than bf16 compute does (2,061 positions: KL mean 0.44 against 0.036, "
                   "top-1 71.6% against 91.4%); the contract holds for int8, not for fp8. This fixture's 207 "
                   "positions: mean KL 9.0x bf16's, interval [7.4, 11.0] (Intel Xeon AMX), 9.6x [7.9, 12.0] (torch "
                   "capped to AVX2), against the 1.25x margin; top-1 -19.3 and -18.4 points, against -1")
def test_fp8_meets_the_bf16_contract(fp8_quality):
    assert holds(fp8_quality["fp8"], fp8_quality["bf16"])


def test_power_of_two_scales_change_nothing_but_the_subnormals(tiny_model, prompt_ids):
    """Dividing by 2^-k on the write and multiplying it back on the read is exact in floating point: only values
    that cross e4m3's subnormal edge round differently. So per-layer power-of-two scales give the scale-1 logits
    almost exactly; a scale dropped on either side, or read from the wrong layer, would not."""
    stream = prompt_ids[3]
    runners = [quantized(PagedRunner, "fp8")(tiny_model, 16, 16, "torch") for _ in range(2)]
    layers = tiny_model.config.num_hidden_layers
    runners[1].pool.k_scale = [2.0 ** -(layer + 1) for layer in range(layers)]
    runners[1].pool.v_scale = [2.0 ** (layer - 3) for layer in range(layers)]
    one, scaled = (torch.cat(list(teacher_forced_logits(r, stream))) for r in runners)
    kl = (one.log_softmax(-1).exp() * (one.log_softmax(-1) - scaled.log_softmax(-1))).sum(-1)
    # Measured KL mean 0.0073 (Intel Xeon AMX), 0.0070-0.0073 (torch capped to AVX2), 3 of 101 positions disagreeing
    # on both: 2.7x and 1.7x under the 0.02 and 95% this had. A K scale dropped on the read gives KL 9.1, top-1 15%; a
    # V scale dropped, 28 and 0%; the next layer's scales, 12 and 7%. 0.1 and 90% are 14x and 3.3x margins, and the
    # nearest of those wrong runs is 90x over the one and 75 points under the other.
    assert float(kl.mean()) < 0.1 and (one.argmax(-1) == scaled.argmax(-1)).float().mean() > 0.9


def test_gpu_checks_l12_row_runs_on_the_cpu_with_the_oracle_standing_in(capsys):
    """scripts/gpu_check.py --l12-fp8 (CUDA only) is this function on CUDA: here, on two short prompts, the torch
    oracle stands in for FlashInfer, so the run, the leak check and every printed figure are exercised."""
    from scripts.gpu_check import l12_fp8

    assert l12_fp8(None, CPU, new_tokens=6, prompts=["The capital of France is", "Hello, world!"]) == 0
    out = capsys.readouterr().out
    assert "blocks leaked: 0" in out and "with backend torch on cpu" in out
    assert "fp8 KV misses the bf16 contract (printed, not judged)" in out
    assert out.rstrip().endswith("L12 fp8: PASS (no leak, and torch agrees with the oracle within bf16's distance)")
