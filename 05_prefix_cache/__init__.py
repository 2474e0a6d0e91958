"""Stage 05: a prefix cache. KV blocks are found by their content and shared: a known prompt start is computed once."""

TITLE = "Stage 05: prefix cache"  # the server's title; the docstring above is its command-line description
PORT = 8005  # the default port of `python -m 05_prefix_cache`
