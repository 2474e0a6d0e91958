"""Stage 01: the simplest LLM server. A Flask app and a hand-written prefill + decode loop."""

PORT = 8001  # the default port of `python -m 01_naive`
