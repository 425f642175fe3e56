"""Llama-family decoder with a paged KV cache, checkpoint loaders (GGUF, Hugging Face) and tokenizers."""
