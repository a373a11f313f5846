"""The training loop around a DeepSpeed engine, and what plugs into it."""
