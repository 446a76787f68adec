"""The Llama family (Llama, Mistral, Qwen2, Qwen3), built from an artifact's manifest alone."""
