"""Output processing: what a step's new token means to its client.

The scheduler decides who runs; this module reads what came out. Each new token goes through its
sequence's detokenizer (whole characters, stop strings held back), and the request's rules decide
whether the sequence ends with it, and why: its end-of-sequence token, a stop string in the text,
``max_tokens``. The answer is the ``RequestOutput`` its client receives.

It reads the sequence and feeds the sequence's detokenizer; it changes nothing else. The scheduler,
the one owner of sequences, appends the tokens the output kept and finishes the sequence if the
output says it ended. vLLM splits its engine the same way: its ``OutputProcessor`` detokenizes and
checks stop strings, apart from the scheduler that keeps the batch.
"""

from __future__ import annotations

from .sampler import TokenLogprobs
from .sequence import FinishReason, RequestOutput, Sequence


class OutputProcessor:
    """Turns each step's token into text for the client and the reason, if any, its sequence ends."""

    def __init__(self, eos_token_ids: set[int]) -> None:
        self.eos_token_ids = eos_token_ids

    def process(self, seq: Sequence, token_ids: list[int], logprobs: list[TokenLogprobs | None],
                prompt_logprobs: list[TokenLogprobs] | None) -> RequestOutput:
        """The output of the token just sampled for ``seq`` (``token_ids`` holds one): the text it makes safe
        to send, and ``finish_reason`` if the sequence ends here. ``prompt_logprobs`` go with the first output
        of a request that asked for them (echo)."""
        (token_id,), (token_logprobs,) = token_ids, logprobs
        if seq.params.max_tokens == 0:  # only the prompt was to be scored (echo): the token is not used
            return RequestOutput(seq.request_id, [], "", "length", len(seq.prompt_ids), 0, [], prompt_logprobs,
                                 cached_tokens=seq.num_cached_tokens, index=seq.index)
        num_output_tokens = len(seq.output_ids) + 1  # the sequence's output once the scheduler appends this one
        finish_reason: FinishReason | None = None
        ### BEGIN SOLUTION 4.4
        if token_id in self.eos_token_ids and not seq.params.ignore_eos:
            text, finish_reason = seq.detokenizer.flush(), "stop"
        else:
            text = seq.detokenizer.add(token_id)
            if seq.detokenizer.stopped:
                finish_reason = "stop"
            elif num_output_tokens == seq.params.max_tokens:
                text, finish_reason = text + seq.detokenizer.flush(), "length"
        ### END SOLUTION
        return RequestOutput(seq.request_id, [token_id], text, finish_reason, len(seq.prompt_ids), num_output_tokens,
                             None if token_logprobs is None else [token_logprobs], prompt_logprobs,
                             cached_tokens=seq.num_cached_tokens, index=seq.index)
