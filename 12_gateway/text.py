"""Text to token ids: a prompt, or a conversation rendered with the model's chat template.

Functions of the tokenizer alone, in a module of their own: the API process tokenizes with them, and it has no
engine (``messages.py`` says why). The other direction, token ids to text, is ``detokenizer.py``'s."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


def encode(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    return tokenizer(prompt).input_ids


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """Render the conversation with the model's chat template, ready for the assistant's turn."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids  # the template has them
