"""L16: weight-only quantization. The model's matrices are GGUF weight blocks (Q8_0, Q4_1), read from the shipped file
or quantized here, and a decode step's matmul reads each weight as its 4 or 8 bits and dequantizes it in registers,
summing in the fp32 path's order: on SmolLM2's Q4_1 file the logits are bitwise the fp32 dequantized model's."""
from lessons.l16_weight_quant.engine import L16Engine

# What scripts/lesson_diff.py compares with earlier lessons: role -> where this lesson defines it.
ROLES = {
    'engine setup': 'engine.py::L16Engine.__init__',
}

__all__ = ["L16Engine"]
