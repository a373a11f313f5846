"""Model shapes by name. `vocab_size` here is used only when no tokenizer decides it (estimates,
synthetic benchmarks); a training run takes the tokenizer's vocabulary, padded."""

_LLAMA = dict(arch="llama", tie_embeddings=False, norm_eps=1e-5, rope_theta=10000.0)
_GPT2 = dict(arch="gpt2", tie_embeddings=True, norm_eps=1e-5, rope_theta=10000.0)

PRESETS = {
    # The embedded default: trains on two CPU cores in minutes.
    "tiny": dict(_LLAMA, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                 ffn_hidden_size=704, max_seq_length=1024, vocab_size=4096, tie_embeddings=True),
    "gpt2_tiny": dict(_GPT2, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=8,
                      ffn_hidden_size=1024, max_seq_length=1024, vocab_size=4096),
    "llama_125m": dict(_LLAMA, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12,
                       ffn_hidden_size=2048, max_seq_length=2048, vocab_size=32000,
                       tie_embeddings=True),
    "gpt2_124m": dict(_GPT2, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12,
                      ffn_hidden_size=3072, max_seq_length=1024, vocab_size=50257),
    # Llama-3.2-1B shape.
    "llama_1b": dict(_LLAMA, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                     ffn_hidden_size=8192, max_seq_length=4096, vocab_size=128256,
                     tie_embeddings=True, rope_theta=500000.0),
    # Llama-2-7B and Llama-2-70B shapes.
    "llama_7b": dict(_LLAMA, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                     ffn_hidden_size=11008, max_seq_length=4096, vocab_size=32000),
    "llama_70b": dict(_LLAMA, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                      ffn_hidden_size=28672, max_seq_length=4096, vocab_size=32000),
}
