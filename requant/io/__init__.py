"""I/O: safetensors headers and shards, the index, checkpoints on disk. No numerics here."""
