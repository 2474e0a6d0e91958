"""Stage 01: the simplest LLM server. A Flask app and a hand-written prefill + decode loop."""
