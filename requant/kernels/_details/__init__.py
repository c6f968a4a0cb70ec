"""The fused-MoE kernel's internals, one job a module (the public op is `requant.kernels.fused_moe`):

- `device`: facts about the device a launch runs on (interpreter, programmatic dependent launch,
  the name its launch configs are filed under). No triton.
- `configs`: `KernelConfig`, the activation codes and the launch-config lookup (per-device JSON in
  `requant/kernels/configs/`, then the built-in rule). No triton.
- `align`: sorting (token, k) pairs by expert and padding them to the M tile, in torch. No triton.
- `layout`: the weights' and activations' layout in the kernel (bit permutation of the words,
  64-row blocks, column order of A, how scales are read). No triton.
- `ptx`: the inline PTX that decodes a pair of weights. No triton.
- `_decode`, `_kernels`: the @triton.jit code (dequantization to the MMA operand; the GEMM,
  prologue and epilogue kernels).
- `launch`: one GEMM launch from `KernelWeights` and a config.
"""
