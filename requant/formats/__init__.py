"""Pure numerics, one module per format: decode and encode side by side, no I/O."""

# Tensor parts (suffix -> accepted safetensors dtypes) that identify how routed experts are stored.
EXPERT_LAYOUTS: dict[str, dict[str, tuple[str, ...]]] = {
    "mxfp4": {"weight": ("I8", "U8"), "scale": ("F8_E8M0",)},
    "nvfp4": {"weight": ("U8",), "weight_scale": ("F8_E4M3",), "weight_scale_2": ("F32",)},
    "w4a16": {"weight_packed": ("I32",), "weight_scale": ("BF16", "F16", "F32")},
}


def identify(parts: dict[str, str]) -> str | None:
    """The format whose parts (suffix -> dtype) one expert projection has, or None."""
    for name, layout in EXPERT_LAYOUTS.items():
        if all(parts.get(suffix) in dtypes for suffix, dtypes in layout.items()):
            return name
    return None
