"""Output processing: what a step's new tokens mean to their client.

The scheduler decides who runs; this module reads what came out. A step may give a sequence a run
of tokens (its accepted guesses and one of the model's own). Each new token goes through its
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
    """Turns each step's tokens into text for the client and the reason, if any, their sequence ends."""

    def __init__(self, eos_token_ids: set[int]) -> None:
        self.eos_token_ids = eos_token_ids

    def process(self, seq: Sequence, token_ids: list[int], logprobs: list[TokenLogprobs | None],
                prompt_logprobs: list[TokenLogprobs] | None) -> RequestOutput:
        """The output of the run just chosen for ``seq`` (its accepted guesses and one token of the model's own,
        or one token): the tokens it keeps, the text they make safe to send, and ``finish_reason`` if the
        sequence ends in the run. The tokens are read one by one, each deciding whether the sequence ends there
        (EOS, a stop string, max_tokens): what follows the end is neither kept nor counted. ``prompt_logprobs``
        go with the first output of a request that asked for them (echo)."""
        if seq.params.max_tokens == 0:  # only the prompt was to be scored (echo): the token is not used
            return RequestOutput(seq.request_id, [], "", "length", len(seq.prompt_ids), 0, [], prompt_logprobs,
                                 cached_tokens=seq.num_cached_tokens, index=seq.index)
        text, kept = "", 0
        finish_reason: FinishReason | None = None
        for token_id in token_ids:
            ### BEGIN SOLUTION 8.5
            kept += 1
            num_output_tokens = len(seq.output_ids) + kept  # the sequence's output once the scheduler appends these
            if token_id in self.eos_token_ids and not seq.params.ignore_eos:
                text, finish_reason = text + seq.detokenizer.flush(), "stop"
            else:
                text += seq.detokenizer.add(token_id)
                if seq.detokenizer.stopped:
                    finish_reason = "stop"
                elif num_output_tokens == seq.params.max_tokens:
                    text, finish_reason = text + seq.detokenizer.flush(), "length"
            if finish_reason is not None:
                break  # the rest of the run is neither emitted nor counted
            ### END SOLUTION
        return RequestOutput(seq.request_id, token_ids[:kept], text, finish_reason, len(seq.prompt_ids),
                             len(seq.output_ids) + kept, None if logprobs[0] is None else logprobs[:kept],
                             prompt_logprobs, cached_tokens=seq.num_cached_tokens, index=seq.index)
