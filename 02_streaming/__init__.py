"""Stage 02: an async OpenAI-compatible server that streams each token as it is sampled."""
