"""Stage 09: tensor parallelism. One model split across N processes, each holding a slice of every layer."""

TITLE = "Stage 09: tensor parallelism"  # the server's title; the docstring above is its command-line description
PORT = 8009  # the default port of `python -m 09_tensor_parallel`
