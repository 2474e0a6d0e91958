"""Stage 12: the gateway. Many stage 11 servers as one endpoint on Ray Serve: routing by model, by difficulty and
by prefix, and autoscaling on queue depth."""

TITLE = "Stage 12: the gateway"  # the server's title; the docstring above is its command-line description
PORT = 8012  # the default port of `python -m 12_gateway`
