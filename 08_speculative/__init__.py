"""Stage 08: speculative decoding. A proposer guesses the next k tokens; the model checks them all in one pass."""

TITLE = "Stage 08: speculative decoding"  # the server's title; the docstring above is its command-line description
PORT = 8008  # the default port of `python -m 08_speculative`
