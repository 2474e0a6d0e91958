"""Stage 03: the streaming server on its own Llama-family model, with a paged KV cache (blocks, block tables)."""
