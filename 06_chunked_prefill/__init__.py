"""Stage 06: chunked prefill. Each step has a token budget: decodes first, then chunks of prompts, in one pass."""

TITLE = "Stage 06: chunked prefill"  # the server's title; the docstring above is its command-line description
PORT = 8006  # the default port of `python -m 06_chunked_prefill`
