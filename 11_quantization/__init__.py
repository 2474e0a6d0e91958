"""Stage 11: quantized weights. The linear layers kept and multiplied in 4-bit blocks (the model file's own) or
8 bits a weight, so that a decode step reads a fraction of the bytes."""

TITLE = "Stage 11: quantized weights"  # the server's title; the docstring above is its command-line description
PORT = 8011  # the default port of `python -m 11_quantization`
