"""Prompts the correctness tests share: plain text, code, a list, non-Latin text and chat turns."""

TEXT_PROMPTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "1. Apples\n2.",
    "日本の首都は",
]
CHAT_PROMPTS = [
    "Translate to Chinese: I love my cat.",
    "What is the capital of France?",
]
EMOJI_PROMPT = "Write three emoji that describe happiness, nothing else."
