"""requant: offline converter and re-quantizer for mixture-of-experts checkpoints."""

__version__ = "0.1.0"
