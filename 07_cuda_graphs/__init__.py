"""Stage 07: CUDA graphs. A decode step runs from static buffers, padded to a bucket; on CUDA it replays a graph."""

TITLE = "Stage 07: CUDA graphs"  # the server's title; the docstring above is its command-line description
PORT = 8007  # the default port of `python -m 07_cuda_graphs`
