"""Stage 02: an async OpenAI-compatible server that streams each token as it is sampled."""

TITLE = "Stage 02: streaming server"  # the server's title; the docstring above is its command-line description
PORT = 8002  # the default port of `python -m 02_streaming`
