"""Stage 04: continuous batching. Before every step a scheduler picks the sequences; one forward pass serves them."""

TITLE = "Stage 04: continuous batching"  # the server's title; the docstring above is its command-line description
PORT = 8004  # the default port of `python -m 04_continuous_batching`
