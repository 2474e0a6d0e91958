"""Stage 10: the gateway. Many stage 09 servers as one endpoint on Ray Serve: routing by model, by difficulty and
by prefix, and autoscaling on queue depth."""

TITLE = "Stage 10: the gateway"  # the server's title; the docstring above is its command-line description
PORT = 8010  # the default port of `python -m 10_gateway`
