"""What `--weights` selects, and the models it builds: a model whose matrices are weight blocks, either read from a
GGUF file as shipped (SmolLM2's Q4_1 file) or quantized here from any fp32 or bf16 checkpoint (the embedded model).

    fp32, bf16   the checkpoint's weights in that dtype: every earlier lesson's model
    q8_0         every matrix in Q8_0
    q4_1         every matrix in Q4_1 but the token embedding (tied to the LM head), which stays Q8_0: what
                 llama.cpp's quantizer writes and SmolLM2's file holds (the logits over the vocabulary, which
                 every choice of a token rests on, keep 8 bits)

Activations stay fp32 with blocks: the kernel dequantizes to fp32 and multiplies there, as the fp32 path does.
"""
from __future__ import annotations

import copy
import itertools
from pathlib import Path

import torch
from torch import nn

from lessons.l16_weight_quant.blocks import dequantize, quantize
from lessons.l16_weight_quant.gguf_file import read_gguf
from lessons.l16_weight_quant.quant_linear import QuantEmbedding, QuantLinear
from shared.config import Qwen3Config
from shared.errors import CourseError
from shared.layers import Linear, RotaryEmbedding
from shared.model import Qwen3ForCausalLM

WEIGHTS = ("fp32", "bf16", "q8_0", "q4_1")
QUANTIZED = ("q8_0", "q4_1")
EMBEDDING_FORMAT = {"q8_0": "q8_0", "q4_1": "q8_0"}


# Task L16.5: the engine: blocks on the CPU in fp32 only, L14's mode through the block kernel for every row
def check_weights(weights: str | None, dtype: str | None, device: str) -> tuple[str | None, str]:
    """The --dtype and --device a --weights runs under (None: the model's dtype, as before), or one line naming
    the option that contradicts it, before anything loads (the smoke's and the server's). Blocks (q8_0, q4_1, and
    the smoke's auto) run on the CPU in fp32 whatever --device auto would pick."""
    if weights is None:
        return dtype, device
    if weights in ("fp32", "bf16"):
        implied = {"fp32": "float32", "bf16": "bfloat16"}[weights]
        if dtype not in (None, implied):
            raise CourseError(f"--weights {weights} computes in {implied}; --dtype {dtype} contradicts it")
        return implied, device
    if dtype not in (None, "float32"):
        raise CourseError(f"--weights {weights} multiplies fp32 activations (the kernel dequantizes to fp32): "
                          f"leave --dtype out or use float32, not {dtype}")
    if device == "cuda":
        raise CourseError(f"--weights {weights} runs on the CPU (the block kernel is C++), not --device cuda")
    return "float32", "cpu"


def is_quantized(model: nn.Module) -> bool:
    return isinstance(model.lm_head, QuantLinear)


def weights_of(model: nn.Module) -> str:
    """The --weights name a model runs: its matrices' block format, or its dtype's."""
    if is_quantized(model):
        return next(m.fmt for m in model.modules() if isinstance(m, QuantLinear) and m is not model.lm_head)
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(model.lm_head.weight.dtype, "other")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every tensor the model holds, a tied head's once: blocks as stored, the rest in their dtype."""
    tensors = {t.untyped_storage().data_ptr(): t for t in itertools.chain(model.parameters(), model.buffers())}
    return sum(t.untyped_storage().nbytes() for t in tensors.values())


def twin(model: Qwen3ForCausalLM) -> Qwen3ForCausalLM:
    """A copy of the module tree sharing every tensor (L14's invariant_model does the same)."""
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo=shared)


def _replace_matrices(model: Qwen3ForCausalLM, matrix, embedding) -> Qwen3ForCausalLM:
    """Each Linear but the LM head through `matrix(name, linear)`, the embedding through `embedding(emb)`; a tied
    LM head then reads the embedding's blocks, an untied one is a matrix like the others."""
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if isinstance(child, nn.Linear) and full != "lm_head":
                setattr(parent, name, matrix(full, child))
    emb = embedding(model.model.embed_tokens)
    model.model.embed_tokens = emb
    model.lm_head = (QuantLinear(emb.blocks, emb.fmt, emb.embedding_dim) if model.config.tie_word_embeddings
                     else matrix("lm_head", model.lm_head))
    return model


# Task L16.4: a model whose matrices are blocks: quantized from a checkpoint's weights, or read from a GGUF file
def quantized_model(model: Qwen3ForCausalLM, fmt: str) -> Qwen3ForCausalLM:
    """Every matrix of `model` (fp32 or bf16) quantized to `fmt` (the embedding to EMBEDDING_FORMAT[fmt]); the
    norms are shared with `model`, which is left as it was."""
    if fmt not in QUANTIZED:
        raise CourseError(f"quantized_model takes {' or '.join(QUANTIZED)}, not {fmt!r}")
    emb_fmt = EMBEDDING_FORMAT[fmt]
    return _replace_matrices(
        twin(model), lambda name, lin: QuantLinear(quantize(lin.weight, fmt), fmt, lin.in_features),
        lambda e: QuantEmbedding(quantize(e.weight, emb_fmt), emb_fmt, e.embedding_dim)).eval()


# Task L16.4: a model whose matrices are blocks: quantized from a checkpoint's weights, or read from a GGUF file
def gguf_model(model_dir: Path, gguf: Path) -> Qwen3ForCausalLM:
    """The model of `model_dir`'s config with the file's tensors: quantized ones as blocks (no fp32 copy of any
    matrix is made), fp32 ones (the norms) as they are."""
    cfg = Qwen3Config.from_dir(model_dir)
    tensors = read_gguf(gguf, cfg)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)

    def tensor(name: str, want: tuple[int, ...] | None = None):
        if name not in tensors:
            raise CourseError(f"{gguf.name} has no tensor for {name}")
        t = tensors[name]
        if t.fmt == "f32" and want is not None and tuple(t.data.shape) != want:
            raise CourseError(f"{gguf.name}: {name} has shape {list(t.data.shape)}, the config implies {list(want)}")
        return t

    def matrix(name: str, lin: nn.Linear) -> QuantLinear:
        t = tensor(f"{name}.weight")
        if t.fmt == "f32" or t.k != lin.in_features or t.data.shape[0] != lin.out_features:
            raise CourseError(f"{gguf.name}: {name}.weight is not {lin.out_features} x {lin.in_features} in blocks")
        return QuantLinear(t.data, t.fmt, lin.in_features)

    def embedding(e: nn.Embedding) -> QuantEmbedding:
        t = tensor("model.embed_tokens.weight")
        if t.fmt == "f32" or t.k != e.embedding_dim or t.data.shape[0] != e.num_embeddings:
            raise CourseError(f"{gguf.name}: the token embedding is not {e.num_embeddings} x {e.embedding_dim} blocks")
        return QuantEmbedding(t.data, t.fmt, e.embedding_dim)

    _replace_matrices(model, matrix, embedding)
    norms = {name: tensor(name, tuple(p.shape)).data for name, p in model.named_parameters() if p.is_meta}
    model.load_state_dict(norms, strict=False, assign=True)
    model.model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)  # computed, not stored: off the meta device
    return model.eval()


def dequantized_model(model: Qwen3ForCausalLM) -> Qwen3ForCausalLM:
    """The fp32 model a quantized one computes: every block dequantized into an ordinary Linear and Embedding, the
    reference its logits are bitwise equal to. Norms shared; a tied LM head shares the embedding's fp32 tensor."""
    dense_model = twin(model)
    dense: dict[int, torch.Tensor] = {}  # blocks -> their fp32 weights, once per tensor (a tied head reuses them)

    def weights(blocks: torch.Tensor, fmt: str) -> nn.Parameter:
        if id(blocks) not in dense:
            dense[id(blocks)] = nn.Parameter(dequantize(blocks, fmt), requires_grad=False)
        return dense[id(blocks)]

    for parent in list(dense_model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantLinear):
                lin = Linear(child.in_features, child.out_features).to("meta")
                lin.weight = weights(child.blocks, child.fmt)
                setattr(parent, name, lin)
            elif isinstance(child, QuantEmbedding):
                setattr(parent, name, nn.Embedding.from_pretrained(weights(child.blocks, child.fmt), freeze=True))
    return dense_model.eval()
