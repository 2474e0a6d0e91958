"""Stage 10: overlap scheduling. Step N + 1 is launched before step N's tokens are read, so that the device never
waits for Python."""

TITLE = "Stage 10: overlap scheduling"  # the server's title; the docstring above is its command-line description
PORT = 8010  # the default port of `python -m 10_overlap_scheduling`
