"""The embedded model: real Qwen3 tokenizer, HF-loadable, deterministic, and sensitive to KV and norm bugs."""
from contextlib import contextmanager

import pytest
import torch

from lessons.l1_contiguous.kv_cache import ContiguousKvCache, ContiguousMeta
from shared.model import Qwen3ForCausalLM
from shared.tiny_qwen3 import build_tiny_qwen3, checkpoint_digest
from shared.tokenizer import FIRST_SPECIAL_ID, QWEN_TIKTOKEN_SHA256, SPECIAL_TOKENS, qwen_tiktoken_path


def test_rank_file_is_the_known_one():
    import hashlib

    assert hashlib.sha256(qwen_tiktoken_path().read_bytes()).hexdigest() == QWEN_TIKTOKEN_SHA256


def test_known_encodings(tokenizer):
    assert tokenizer.encode("Hello, world!").ids == [9707, 11, 1879, 0]
    assert tokenizer.encode("The capital of France is").ids == [785, 6722, 315, 9625, 374]
    assert tokenizer.decode([9707, 11, 1879, 0]) == "Hello, world!"


def test_special_tokens_have_qwen3_ids(tokenizer):
    for i, tok in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(tok) == FIRST_SPECIAL_ID + i
    assert tokenizer.token_to_id("</think>") == 151668
    assert tokenizer.encode("hi<|im_end|>").ids[-1] == 151645


def test_transformers_loads_it_unchanged(tiny_dir, tokenizer):
    from transformers import AutoConfig, AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    text = "Paged attention, 2026: <|im_start|>user\nnaïve café ½<|im_end|>"
    assert hf_tok(text).input_ids == tokenizer.encode(text).ids
    cfg = AutoConfig.from_pretrained(str(tiny_dir))
    assert cfg.model_type == "qwen3" and cfg.vocab_size == 151936 and cfg.head_dim in (64, 128)


def test_build_is_byte_for_byte_deterministic(tiny_dir, tmp_path):
    build_tiny_qwen3(tmp_path / "again")
    assert checkpoint_digest(tmp_path / "again") == checkpoint_digest(tiny_dir)


def greedy(model, ids, n, corrupt_layer=None, corrupt_pos=None, decode_shift=0):
    """A bare greedy loop over L1's cache with a planted bug: a negated cached K vector, or decode positions off by one."""
    cache = ContiguousKvCache(model.config, len(ids) + n, torch.float32, torch.device("cpu"))
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), cache, ContiguousMeta(0))
    if corrupt_layer is not None:
        cache.k[corrupt_layer][corrupt_pos] *= -1
    out = [int(model.logits(hidden[-1:]).argmax())]
    for pos in range(len(ids), len(ids) + n - 1):
        hidden = model(torch.tensor(out[-1:]), torch.tensor([pos + decode_shift]), cache, ContiguousMeta(pos))
        out.append(int(model.logits(hidden).argmax()))
    return out


@pytest.fixture(scope="module")
def sentence(tokenizer):
    return tokenizer.encode("The capital of France is a city that many people like to visit in spring").ids


def test_greedy_output_is_diverse(tiny_model, sentence):
    out = greedy(tiny_model, sentence, 20)
    assert len(set(out)) >= 15  # not a loop on one token: later tokens depend on the cache


@pytest.mark.parametrize("layer", [0, 3])
def test_one_corrupted_cached_key_changes_the_tokens(tiny_model, sentence, layer):
    clean = greedy(tiny_model, sentence, 20)
    for pos in (0, len(sentence) // 2, len(sentence) - 1):
        assert greedy(tiny_model, sentence, 20, corrupt_layer=layer, corrupt_pos=pos) != clean, (layer, pos)


def test_decode_positions_off_by_one_change_the_tokens(tiny_model, sentence):
    # Shifting *every* position is invisible (RoPE sees only distances); the real bug shifts decode steps only.
    assert greedy(tiny_model, sentence, 20, decode_shift=1) != greedy(tiny_model, sentence, 20)
    assert greedy(tiny_model, sentence, 20, decode_shift=-1) != greedy(tiny_model, sentence, 20)


def test_a_fresh_build_is_not_lazy(sentence, tmp_path):
    """The builder's own output, not the cached copy: with the final norm's gains all 1 (not +-1) tied embeddings
    predict the current token, greedy repeats one token and a corrupted cached key changes nothing."""
    model = Qwen3ForCausalLM.from_dir(build_tiny_qwen3(tmp_path / "fresh"), torch.float32, torch.device("cpu"))
    out = greedy(model, sentence, 20)
    assert len(set(out)) >= 15, (
        f"a fresh build of the tiny model gives {len(set(out))} distinct tokens in 20 ({out}): a lazy model that hides "
        "KV bugs (shared/tiny_qwen3.py's final-norm and q/k gains)")
    assert greedy(model, sentence, 20, corrupt_layer=0, corrupt_pos=len(sentence) // 2) != out, (
        "negating one cached key of a fresh build changes no token: KV bugs would pass unseen")



# Norm-wiring bugs: each norm's gains differ per channel, per norm and per layer, so using the wrong one
# rescales some channels and not others, and the tokens change. With uniform gains these were invisible.


@contextmanager
def planted(module: torch.nn.Module, **swaps: torch.nn.Module):
    """Rewire submodules for the duration of a test. Not monkeypatch: it looks for the old value in the
    instance __dict__, where torch keeps no submodules, so its undo deletes the submodule and the shared
    session model stays broken for every later test."""
    old = {name: getattr(module, name) for name in swaps}
    for name, new in swaps.items():
        setattr(module, name, new)
    try:
        yield
    finally:
        for name, orig in old.items():
            setattr(module, name, orig)


@pytest.mark.parametrize("layer", [0, 1, 2, 3])
def test_q_norm_applied_to_k_changes_the_tokens(tiny_model, sentence, layer):
    clean = greedy(tiny_model, sentence, 20)
    attn = tiny_model.model.layers[layer].self_attn
    with planted(attn, k_norm=attn.q_norm):
        assert greedy(tiny_model, sentence, 20) != clean


@pytest.mark.parametrize("layer", [0, 1, 2, 3])
def test_swapped_input_and_post_attention_norms_change_the_tokens(tiny_model, sentence, layer):
    clean = greedy(tiny_model, sentence, 20)
    block = tiny_model.model.layers[layer]
    with planted(block, input_layernorm=block.post_attention_layernorm, post_attention_layernorm=block.input_layernorm):
        assert greedy(tiny_model, sentence, 20) != clean


@pytest.mark.parametrize(("owner", "user"), [(0, 2), (3, 1)])
def test_one_layers_norms_used_in_another_change_the_tokens(tiny_model, sentence, owner, user):
    clean = greedy(tiny_model, sentence, 20)
    src, dst = tiny_model.model.layers[owner], tiny_model.model.layers[user]
    with planted(dst, input_layernorm=src.input_layernorm, post_attention_layernorm=src.post_attention_layernorm), \
            planted(dst.self_attn, q_norm=src.self_attn.q_norm, k_norm=src.self_attn.k_norm):
        assert greedy(tiny_model, sentence, 20) != clean
