"""L16's engine: L15's, serving a model whose matrices are weight blocks (weights.py). Nothing in the engine changes
for that: the pool, the scheduler and the kernels of every earlier lesson see a model that takes token ids and
gives fp32 hidden states, the same values as the fp32 model it was dequantized to. What the engine owes is the
setups the blocks cannot run: the kernel is the CPU's, and it multiplies fp32 activations.
"""
from __future__ import annotations

from lessons.l15_disaggregated.engine import L15Engine
from lessons.l16_weight_quant.quant_linear import QuantLinear
from lessons.l16_weight_quant.weights import is_quantized, twin, weights_of
from shared.errors import CourseError


# Task L16.5: the engine: blocks on the CPU in fp32 only, L14's mode through the block kernel for every row
def check_weights_setup(model) -> None:
    """One line for a setup quantized weights cannot run (before anything is built)."""
    if not is_quantized(model):
        return
    blocks = model.lm_head.blocks
    if blocks.device.type != "cpu":
        raise CourseError(f"--weights {weights_of(model)} runs on the CPU (the block kernel is C++ for x86 and "
                          f"portable CPUs), not {blocks.device.type}")


class L16Engine(L15Engine):
    # Task L16.5: the engine: blocks on the CPU in fp32 only, L14's mode through the block kernel for every row
    def __init__(self, model, *args, batch_invariant: bool = False, **kwargs):
        check_weights_setup(model)
        if batch_invariant and is_quantized(model):
            # L14's mode swaps nn.Linear and RMSNorm for its invariant ones; a QuantLinear is neither, so a twin's
            # take the block kernel (whose order is per row, as the fp32 one's) for every row count instead
            model = twin(model)
            for module in model.modules():
                if isinstance(module, QuantLinear):
                    module.every_row = True
        super().__init__(model, *args, batch_invariant=batch_invariant, **kwargs)
