"""Data: sentencepiece tokenizer, Megatron-format .bin/.idx files, packed sequences, loaders."""
