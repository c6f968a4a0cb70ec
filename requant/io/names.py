"""The file names of a Hugging Face checkpoint directory that requant reads and writes, in one
place for the modules that cannot import io.checkpoint (it imports them)."""

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
