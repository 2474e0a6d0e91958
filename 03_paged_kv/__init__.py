"""Stage 03: the streaming server on its own Llama-family model, with a paged KV cache (blocks, block tables)."""

TITLE = "Stage 03: paged KV cache"  # the server's title; the docstring above is its command-line description
PORT = 8003  # the default port of `python -m 03_paged_kv`
