"""Output processing in the engine core: where a step's new tokens end their sequence.

The scheduler decides who runs; this module reads what came out. A step may give a sequence a run
of tokens (its accepted guesses and one of the model's own). Each new token is checked against the
request's rules that need no text: its end-of-sequence token, and ``max_tokens``. The answer is the
``RequestOutput`` the core sends: the tokens kept, and ``finish_reason`` if the sequence ends.

Text is not made here. The API process detokenizes each output and looks for the request's stop
strings (``AsyncEngine``), so that no per-token string work sits on the core's loop; when a stop string
ends a sample, it asks the core to drop it. vLLM splits its engine the same way: its ``OutputProcessor``,
in the API process, detokenizes and checks stop strings, apart from the engine core that keeps the batch.

It reads the sequence; it changes nothing. The scheduler, the one owner of sequences, appends the
tokens the output kept and finishes the sequence if the output says it ended.
"""

from __future__ import annotations

from .sampler import TokenLogprobs
from .sequence import FinishReason, RequestOutput, Sequence


class OutputProcessor:
    """Decides, token by token, whether each step's run of tokens ends its sequence, and why."""

    def __init__(self, eos_token_ids: set[int]) -> None:
        self.eos_token_ids = eos_token_ids

    def process(self, seq: Sequence, token_ids: list[int], logprobs: list[TokenLogprobs | None],
                prompt_logprobs: list[TokenLogprobs] | None) -> RequestOutput:
        """The output of the run just chosen for ``seq`` (its accepted guesses and one token of the model's own,
        or one token): the tokens it keeps and ``finish_reason`` if the sequence ends in the run (EOS,
        max_tokens): what follows the end is neither kept nor counted. Its text is left to the API process.
        ``prompt_logprobs`` go with the first output of a request that asked for them (echo)."""
        if seq.params.max_tokens == 0:  # only the prompt was to be scored (echo): the token is not used
            return RequestOutput(seq.request_id, [], "", "length", len(seq.prompt_ids), 0, [], prompt_logprobs,
                                 cached_tokens=seq.num_cached_tokens, index=seq.index)
        kept = 0
        finish_reason: FinishReason | None = None
        for token_id in token_ids:
            kept += 1
            if token_id in self.eos_token_ids and not seq.params.ignore_eos:
                finish_reason = "stop"
            elif len(seq.output_ids) + kept == seq.params.max_tokens:
                finish_reason = "length"
            if finish_reason is not None:
                break  # the rest of the run is neither emitted nor counted
        return RequestOutput(seq.request_id, token_ids[:kept], "", finish_reason, len(seq.prompt_ids),
                             len(seq.output_ids) + kept, None if logprobs[0] is None else logprobs[:kept],
                             prompt_logprobs, cached_tokens=seq.num_cached_tokens, index=seq.index)
