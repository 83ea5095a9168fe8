"""L16's models and engine on the embedded model (and a small Llama-shaped one), and SmolLM2's shipped file.

- read_gguf (task 2): a GGUF file written by the `gguf` package's own writer with llama.cpp's tensor names reads
  back as the blocks that went in, under the model's names; a Llama file's q and k rows (permuted by llama.cpp's
  converter) come back in HF's order, a Qwen3 file's (not permuted) as they are; a tensor type it does not read is
  one line.
- quantized_model (task 4): the source model untouched, the norms shared, no nn.Linear left, every matrix the
  quantizer's blocks, the embedding and the tied head one block tensor in EMBEDDING_FORMAT (an untied head its
  own); dequantized_model holds blocks.dequantize's values. gguf_model over a file of those blocks is the same
  model; a file without a tensor the config needs is one line.
- The engine (task 5): L16Engine on the quantized model against L15Engine on the dequantized one, prompts short and
  past 16 tokens (the GEMM path): bitwise the same logits at every output and the same tokens, in the default mode
  and in L14's, where a request's logits are also the same alone and among others. check_weights_setup refuses
  blocks off the CPU in one line.
- With the real model installed: the shipped Q4_1 file, dequantized, is the converted fp32 checkpoint to the bit.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from lessons.l14_batch_invariant.record import first_difference, run_recorded
from lessons.l15_disaggregated import L15Engine
from lessons.l16_weight_quant import L16Engine
from lessons.l16_weight_quant.blocks import dequantize, quantize
from lessons.l16_weight_quant.engine import check_weights_setup
from lessons.l16_weight_quant.gguf_file import read_gguf
from lessons.l16_weight_quant.quant_linear import QuantEmbedding, QuantLinear
from lessons.l16_weight_quant.weights import (
    EMBEDDING_FORMAT,
    QUANTIZED,
    dequantized_model,
    gguf_model,
    is_quantized,
    quantized_model,
    twin,
    weights_of,
)
from shared.config import Qwen3Config
from shared.errors import CourseError
from shared.generation import StopRule
from shared.layers import RMSNorm
from shared.model import Qwen3ForCausalLM
from shared.named_models import NAMED
from shared.tiny_qwen3 import default_model_dir
from test_l3_cpp_backend import needs_kernel
from test_l14_ops import needs_ops

needs_gguf = pytest.mark.skipif(importlib.util.find_spec("gguf") is None,
                                reason="reads and writes GGUF files with the gguf package: pip install gguf")
CPU = torch.device("cpu")
STOP = StopRule(12, ignore_eos=True)
LONG = ("Paged attention stores the key/value cache in fixed-size blocks, so memory is allocated on demand instead "
        "of reserved for the longest possible sequence")  # past 16 tokens: its prefill takes the GEMM path


# --- GGUF files as llama.cpp writes them --------------------------------------------------------------------------


def llamacpp_name(hf: str) -> str:
    """The llama.cpp tensor name of an HF one, from the gguf package's own tables (not the lesson's)."""
    import gguf

    t = gguf.MODEL_TENSOR
    names = {"model.embed_tokens.weight": t.TOKEN_EMBD, "model.norm.weight": t.OUTPUT_NORM, "lm_head.weight": t.OUTPUT}
    parts = {"self_attn.q_proj": t.ATTN_Q, "self_attn.k_proj": t.ATTN_K, "self_attn.v_proj": t.ATTN_V,
             "self_attn.o_proj": t.ATTN_OUT, "mlp.gate_proj": t.FFN_GATE, "mlp.up_proj": t.FFN_UP,
             "mlp.down_proj": t.FFN_DOWN, "input_layernorm": t.ATTN_NORM, "post_attention_layernorm": t.FFN_NORM,
             "self_attn.q_norm": t.ATTN_Q_NORM, "self_attn.k_norm": t.ATTN_K_NORM}
    if hf in names:
        return gguf.TENSOR_NAMES[names[hf]] + ".weight"
    layer, part = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", hf).groups()
    return gguf.TENSOR_NAMES[parts[part]].format(bid=int(layer)) + ".weight"


def llamacpp_permute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter on a Llama's q or k rows (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def file_tensors(model: Qwen3ForCausalLM, fmt: str) -> dict[str, tuple[str, torch.Tensor]]:
    """HF name -> (format, data) as llama.cpp's converter would write `model` quantized to fmt: matrices as blocks
    (the embedding in EMBEDDING_FORMAT), norms fp32, a tied head not written. Uses blocks.quantize only."""
    out = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if p.dim() == 1:
            out[name] = ("f32", p.float())
        else:
            f = EMBEDDING_FORMAT[fmt] if name == "model.embed_tokens.weight" else fmt
            out[name] = (f, quantize(p, f))
    return out


def write_gguf(path: Path, tensors: dict[str, tuple[str, torch.Tensor]], cfg: Qwen3Config,
               types: dict[str, str] | None = None) -> Path:
    """A GGUF file by gguf.GGUFWriter: a Llama's q/k rows permuted as llama.cpp's converter does (a Qwen3's not).
    `types` overrides a tensor's type by HF name (written as that numpy dtype: a file this lesson must refuse)."""
    import gguf

    qtypes = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_1": gguf.GGMLQuantizationType.Q4_1}
    writer = gguf.GGUFWriter(str(path), "qwen3" if cfg.qk_norm else "llama")
    for name, (fmt, data) in tensors.items():
        if not cfg.qk_norm and (name.endswith("q_proj.weight") or name.endswith("k_proj.weight")):
            data = llamacpp_permute(data, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        array = data.numpy()
        if types and name in types:
            writer.add_tensor(llamacpp_name(name), dequantize(data, fmt).numpy().astype(types[name]))
        elif fmt == "f32":
            writer.add_tensor(llamacpp_name(name), array)
        else:
            writer.add_tensor(llamacpp_name(name), array, raw_dtype=qtypes[fmt])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory) -> tuple[Path, Qwen3ForCausalLM]:
    """A Llama (no q/k norms: its file's q/k rows are permuted) with an untied head and a 256-token vocabulary:
    the embedded model's shapes otherwise, random weights and norms."""
    folder = tmp_path_factory.mktemp("small-llama")
    raw = json.loads((default_model_dir() / "config.json").read_text())
    raw |= {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256,
            "tie_word_embeddings": False, "eos_token_id": 1, "bos_token_id": 0}
    (folder / "config.json").write_text(json.dumps(raw))
    cfg = Qwen3Config.from_dir(folder)
    assert not cfg.qk_norm and not cfg.tie_word_embeddings
    torch.manual_seed(16)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if p.dim() == 1 else torch.randn_like(p) * 0.05)
    return folder, model


@pytest.fixture(scope="module")
def quantized(tiny_model) -> dict[str, Qwen3ForCausalLM]:
    return {fmt: quantized_model(tiny_model, fmt) for fmt in QUANTIZED}


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ids = [tokenizer.encode(p).ids for p in ("The capital of France is", "Hello, world!", LONG)]
    assert len(ids[2]) > 16
    return ids


def quant_modules(model: nn.Module) -> dict[str, QuantLinear | QuantEmbedding]:
    return {name: m for name, m in model.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))}


# --- task 2: read_gguf ------------------------------------------------------------------------------------------


@needs_gguf
@pytest.mark.task("L16.2")
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_read_gguf_gives_the_blocks_written_by_the_models_names(tiny_model, tmp_path, fmt):
    cfg = tiny_model.config
    written = file_tensors(tiny_model, fmt)
    got = read_gguf(write_gguf(tmp_path / f"tiny-{fmt}.gguf", written, cfg), cfg)
    assert set(got) == set(written), f"missing {set(written) - set(got)}, extra {set(got) - set(written)}"
    for name, (f, data) in written.items():
        t = got[name]
        assert t.fmt == f, f"{name}: {t.fmt}, written {f}"
        assert t.data.dtype == data.dtype and torch.equal(t.data, data), f"{name}: not the bytes written"
        if f != "f32":  # a Qwen3 file's q/k rows are not permuted: read as written
            assert t.k == tiny_model.get_parameter(name).shape[1], f"{name}: K {t.k}"
    # a copy, not a view of the file's read-only map
    assert got["model.layers.0.mlp.up_proj.weight"].data.numpy().flags.writeable


@needs_gguf
@pytest.mark.task("L16.2")
def test_read_gguf_puts_a_llama_files_q_and_k_rows_back(small_llama, tmp_path):
    folder, model = small_llama
    cfg = model.config
    written = file_tensors(model, "q4_1")
    got = read_gguf(write_gguf(tmp_path / "llama.gguf", written, cfg), cfg)
    assert set(got) == set(written) and "lm_head.weight" in got, "an untied head is the file's `output` tensor"
    for name, (f, data) in written.items():
        assert got[name].fmt == f and torch.equal(got[name].data, data), f"{name}: not HF's row order"
    q = written["model.layers.1.self_attn.q_proj.weight"][1]
    k = written["model.layers.1.self_attn.k_proj.weight"][1]
    # the permutation moves rows (the test would see nothing if it did not)
    assert not torch.equal(llamacpp_permute(q, cfg.num_attention_heads), q)
    assert not torch.equal(llamacpp_permute(k, cfg.num_key_value_heads), k)


@needs_gguf
@pytest.mark.task("L16.2")
def test_read_gguf_refuses_a_tensor_type_it_does_not_read_in_one_line(small_llama, tmp_path):
    folder, model = small_llama
    written = file_tensors(model, "q8_0")
    path = write_gguf(tmp_path / "f16.gguf", written, model.config,
                      types={"model.layers.0.mlp.up_proj.weight": np.float16})
    with pytest.raises(CourseError) as caught:
        read_gguf(path, model.config)
    message = str(caught.value)
    assert "f16.gguf: blk.0.ffn_up.weight is F16; this lesson reads F32, Q8_0 and Q4_1" == message, message


# --- task 4: the quantized model, from a checkpoint or a file ----------------------------------------------------


@pytest.mark.task("L16.4")
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_quantized_model_holds_blocks_only_and_leaves_the_model_alone(tiny_model, quantized, fmt):
    before = {name: (p.data_ptr(), p.clone()) for name, p in tiny_model.state_dict(keep_vars=True).items()}
    q = quantized[fmt]
    # the source: its modules and tensors as they were
    assert isinstance(tiny_model.lm_head, nn.Linear) and isinstance(tiny_model.model.embed_tokens, nn.Embedding)
    assert not quant_modules(tiny_model)
    for name, p in tiny_model.state_dict(keep_vars=True).items():
        assert p.data_ptr() == before[name][0] and torch.equal(p, before[name][1]), f"{name} changed"
    # the quantized model: no nn.Linear or nn.Embedding left, every matrix the quantizer's blocks
    assert not [n for n, m in q.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    layers = tiny_model.config.num_hidden_layers
    mods = quant_modules(q)
    assert len(mods) == 7 * layers + 2, "q k v o gate up down per layer, the embedding, the head"
    source = dict(tiny_model.named_parameters())
    for name, m in mods.items():
        if name == "lm_head":
            continue
        want = EMBEDDING_FORMAT[fmt] if name == "model.embed_tokens" else fmt
        assert m.fmt == want, f"{name} is {m.fmt}, not {want}"
        assert torch.equal(m.blocks, quantize(source[f"{name}.weight"], want)), f"{name}: not quantize's blocks"
    # the tied head reads the embedding's blocks: one tensor
    emb, head = q.model.embed_tokens, q.lm_head
    assert head.blocks is emb.blocks and head.fmt == emb.fmt == EMBEDDING_FORMAT[fmt] == "q8_0"
    assert (head.in_features, head.out_features) == (tiny_model.config.hidden_size, tiny_model.config.vocab_size)
    # the norms are the source's tensors, shared
    norms = {n: p for n, p in q.named_parameters()}
    assert set(norms) == {n for n, m in tiny_model.named_parameters() if m.dim() == 1}
    assert all(p is source[n] for n, p in norms.items()), "the norms are shared, not copied"
    assert all(isinstance(m, RMSNorm) for n, m in q.named_modules() if n.endswith("norm"))
    assert is_quantized(q) and weights_of(q) == fmt and weights_of(tiny_model) == "fp32"


@pytest.mark.task("L16.4")
def test_an_untied_head_is_a_matrix_like_the_others_and_bad_formats_are_refused(small_llama):
    _, model = small_llama
    q = quantized_model(model, "q4_1")
    assert q.lm_head.fmt == "q4_1" and q.model.embed_tokens.fmt == "q8_0"
    assert q.lm_head.blocks is not q.model.embed_tokens.blocks
    assert torch.equal(q.lm_head.blocks, quantize(model.lm_head.weight, "q4_1"))
    bf16 = quantized_model(twin(model).to(torch.bfloat16), "q8_0")  # a bf16 checkpoint: its values quantized
    assert torch.equal(bf16.lm_head.blocks, quantize(model.lm_head.weight.bfloat16(), "q8_0"))
    for fmt in ("q4_0", "fp32", "bf16"):
        with pytest.raises(CourseError, match=f"quantized_model takes q8_0 or q4_1, not '{fmt}'"):
            quantized_model(model, fmt)


@pytest.mark.task("L16.4")
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_the_dequantized_model_holds_the_blocks_values(tiny_model, quantized, fmt):
    q = quantized[fmt]
    dense = dequantized_model(q)
    assert not quant_modules(dense) and quant_modules(q), "a twin: the quantized model keeps its blocks"
    params = dict(dense.named_parameters(remove_duplicate=False))
    for name, m in quant_modules(q).items():
        assert torch.equal(params[f"{name}.weight"], dequantize(m.blocks, m.fmt)), name
    assert dense.lm_head.weight.data_ptr() == dense.model.embed_tokens.weight.data_ptr(), (
        "the tied head shares the embedding's fp32 tensor")
    assert all(p is dict(q.named_parameters())[n] for n, p in dense.named_parameters() if p.dim() == 1)


@needs_gguf
@pytest.mark.task("L16.4")
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_gguf_model_over_a_file_of_the_blocks_is_the_quantized_model(tiny_model, tiny_dir, quantized, tmp_path, fmt):
    path = write_gguf(tmp_path / f"tiny-{fmt}.gguf", file_tensors(tiny_model, fmt), tiny_model.config)
    from_file = gguf_model(tiny_dir, path)
    assert_same_model(from_file, quantized[fmt])
    # and it runs: the same logits as the model quantized here (L15's engine; L16's adds only its checks)
    a = run_recorded(L15Engine(from_file, 16), [[9707, 11, 1879, 0]], StopRule(4, ignore_eos=True))
    b = run_recorded(L15Engine(quantized[fmt], 16), [[9707, 11, 1879, 0]], StopRule(4, ignore_eos=True))
    assert first_difference(a.logits[0], b.logits[0]) is None


@needs_gguf
@pytest.mark.task("L16.4")
def test_gguf_model_over_a_llama_file_with_an_untied_head(small_llama, tmp_path):
    folder, model = small_llama
    path = write_gguf(tmp_path / "llama.gguf", file_tensors(model, "q4_1"), model.config)
    assert_same_model(gguf_model(folder, path), quantized_model(model, "q4_1"))


@needs_gguf
@pytest.mark.task("L16.4")
def test_a_file_missing_a_tensor_is_one_line(small_llama, tmp_path):
    folder, model = small_llama
    written = file_tensors(model, "q8_0")
    del written["model.layers.2.mlp.down_proj.weight"]
    with pytest.raises(CourseError) as caught:
        gguf_model(folder, write_gguf(tmp_path / "short.gguf", written, model.config))
    assert str(caught.value) == "short.gguf has no tensor for model.layers.2.mlp.down_proj.weight", caught.value


def assert_same_model(got: Qwen3ForCausalLM, want: Qwen3ForCausalLM) -> None:
    """The same modules holding the same blocks (format and bytes) and the same norms; no tensor left on meta."""
    assert [(n, type(m)) for n, m in got.named_modules()] == [(n, type(m)) for n, m in want.named_modules()]
    for name, m in quant_modules(want).items():
        other = got.get_submodule(name)
        assert other.fmt == m.fmt and torch.equal(other.blocks, m.blocks), f"{name}: other blocks"
    tied = [m.lm_head.blocks is m.model.embed_tokens.blocks for m in (got, want)]
    assert tied[0] == tied[1], f"the head shares the embedding's blocks: {tied[0]}, expected {tied[1]}"
    want_params = dict(want.named_parameters())
    for name, p in got.named_parameters():
        assert torch.equal(p, want_params[name]), f"{name}: other values"
    assert set(dict(got.named_parameters())) == set(want_params)
    meta = [n for n, t in [*got.named_parameters(), *got.named_buffers()] if t.is_meta]
    assert not meta, f"still on the meta device: {meta}"


# --- task 5: the engine -----------------------------------------------------------------------------------------


def assert_same_runs(got, want, what: str) -> None:
    for i, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        assert a.shape[0] == STOP.max_new_tokens, f"{what}, request {i}: {a.shape[0]} outputs"
        difference = first_difference(a, b)
        assert difference is None, f"{what}, request {i}: {difference}"
    assert got.tokens == want.tokens, what


@needs_kernel
@needs_ops
@pytest.mark.task("L16.5")
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_the_engine_is_bitwise_the_dequantized_fp32_model(quantized, prompts, fmt):
    q = quantized[fmt]
    dense = dequantized_model(q)
    got = run_recorded(L16Engine(q, 16), prompts, STOP)
    assert_same_runs(got, run_recorded(L15Engine(dense, 16), prompts, STOP), f"{fmt}, default mode")
    # each prompt alone too: the long one's prefill (past 16 rows) is the GEMM path's, the others' the kernel's
    for i, p in enumerate(prompts):
        alone = run_recorded(L16Engine(q, 16), [p], STOP)
        assert_same_runs(alone, run_recorded(L15Engine(dense, 16), [p], STOP), f"{fmt}, prompt {i} alone")


@needs_kernel
@needs_ops
@pytest.mark.task("L16.5")
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_l14s_mode_is_bitwise_the_dequantized_model_in_it_and_batch_invariant(quantized, prompts, fmt):
    q = quantized[fmt]
    engine = L16Engine(q, 16, batch_invariant=True)
    assert engine.model is not q and not any(m.every_row for m in q.modules() if isinstance(m, QuantLinear)), (
        "the mode runs a twin: the model passed in keeps its default paths")
    assert all(m.every_row for m in engine.model.modules() if isinstance(m, QuantLinear)), (
        "L14's mode: each QuantLinear of the engine's model takes the block kernel for every row count (every_row)")
    assert engine.model.lm_head.blocks is q.lm_head.blocks, "the twin shares the blocks"
    got = run_recorded(engine, prompts, STOP)
    dense = run_recorded(L15Engine(dequantized_model(q), 16, batch_invariant=True), prompts, STOP)
    assert_same_runs(got, dense, f"{fmt}, L14's mode")
    # a request's logits alone = among others, anywhere in the batch
    rng = random.Random(16)
    crowd = [[rng.randrange(1000, 150_000) for _ in range(rng.randrange(3, 30))] for _ in range(6)]
    for i, p in enumerate(prompts):
        at = rng.randrange(len(crowd) + 1)
        batch = run_recorded(L16Engine(q, 16, batch_invariant=True), crowd[:at] + [p] + crowd[at:], STOP)
        difference = first_difference(batch.logits[at], got.logits[i])
        assert difference is None, f"{fmt}, prompt {i} among {len(crowd)} others at {at}: {difference}"


@pytest.mark.task("L16.5")
def test_blocks_off_the_cpu_are_refused_in_one_line(quantized, tiny_model):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # a CUDA tensor's device without a GPU
        on_gpu = torch.empty(tuple(quantized["q4_1"].lm_head.blocks.shape), dtype=torch.uint8, device="cuda")
    on_meta = torch.empty(tuple(quantized["q4_1"].lm_head.blocks.shape), dtype=torch.uint8, device="meta")
    for blocks, device in ((on_gpu, "cuda"), (on_meta, "meta")):
        model = twin(quantized["q4_1"])
        model.lm_head = QuantLinear(blocks, "q8_0", tiny_model.config.hidden_size)
        for refuse in (check_weights_setup, lambda m: L16Engine(m, 16)):
            with pytest.raises(CourseError) as caught:
                refuse(model)
            message = str(caught.value)
            assert message.startswith("--weights q4_1 runs on the CPU") and message.endswith(f"not {device}"), message
            assert "\n" not in message
    check_weights_setup(quantized["q8_0"])  # blocks on the CPU: nothing to say
    check_weights_setup(tiny_model)  # no blocks: not this check's business
    assert L16Engine(tiny_model, 16).model is tiny_model, "an fp32 model runs as L15's engine runs it"


# --- the real model -----------------------------------------------------------------------------------------------


def real_model_installed() -> bool:
    """tests/test_real_model.py's check (not imported: a learner's workspace has no such file)."""
    try:
        importlib.metadata.distribution(NAMED["smollm2"].package)
    except importlib.metadata.PackageNotFoundError:
        return False
    return all(importlib.util.find_spec(m) for m in ("gguf", "accelerate"))


@pytest.mark.skipif(not real_model_installed(), reason=f"the real model is not installed: {NAMED['smollm2'].install}")
def test_smollm2s_shipped_q4_1_file_dequantized_is_the_converted_fp32_checkpoint():
    """transformers converted the same file (dequantizing with gguf's arithmetic, then undoing the q/k permutation
    on values): the blocks read here, rows put back and dequantized, are those weights to the bit."""
    from shared.cli import resolve_model_dir
    from shared.named_models import gguf_path

    folder = resolve_model_dir("smollm2", default_model_dir)
    q = gguf_model(folder, gguf_path(NAMED["smollm2"]))
    assert weights_of(q) == "q4_1" and q.model.embed_tokens.fmt == "q8_0"
    assert q.lm_head.blocks is q.model.embed_tokens.blocks
    dense = dict(dequantized_model(q).state_dict())
    converted = Qwen3ForCausalLM.from_dir(folder, torch.float32, CPU).state_dict()
    assert set(dense) == set(converted)
    differ = [name for name, t in converted.items()
              if not torch.equal(dense[name].view(torch.int32), t.view(torch.int32))]
    assert not differ, f"{len(differ)} tensors differ from the converted checkpoint, the first {differ[0]}"
