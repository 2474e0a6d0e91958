"""Stage 11: the gateway. Many stage 10 servers as one endpoint on Ray Serve: routing by model, by difficulty and
by prefix, and autoscaling on queue depth."""

TITLE = "Stage 11: the gateway"  # the server's title; the docstring above is its command-line description
PORT = 8011  # the default port of `python -m 11_gateway`
