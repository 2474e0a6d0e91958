"""Any stage's sampler through one row at a time, so that one set of sampler tests covers every stage.

Stages before continuous batching (01 to 03) sample one sequence: ``sample(logits [V], params, generator)``.
With it (04 on) the sampler takes a batch: ``sample(logits [B, V], [params], [generators])``. With
speculative decoding (08 on) verification chooses every token: a row without guesses is ``verify``'s run of
one. ``OneRow`` calls whichever the stage has with a single row and returns that row's answer."""

from __future__ import annotations

from typing import Any

import torch

from .conftest import stage
from .stages import has


class OneRow:
    def __init__(self, folder: str) -> None:
        self.module = stage(folder, "sampler")
        self.batched = has(folder, "batching")  # the sampler takes a batch of rows, a generator each
        self.verifies = has(folder, "speculation")  # verification chooses every token, with or without guesses
        self.speculative = stage(folder, "speculative") if self.verifies else None

    def __getattr__(self, name: str) -> Any:  # SamplingParams, make_generator, MIN_TEMPERATURE, ...
        return getattr(self.module, name)

    def logits_to_probs(self, logits: torch.Tensor, params: Any) -> torch.Tensor:
        if self.batched:
            return self.module.logits_to_probs(logits[None], [params])[0]
        return self.module.logits_to_probs(logits, params)

    def apply_top_p(self, logits: torch.Tensor, top_p: float) -> torch.Tensor:
        if self.batched:
            return self.module.apply_top_p(logits[None], torch.tensor([top_p]))[0]
        return self.module.apply_top_p(logits, top_p)

    def sample(self, logits: torch.Tensor, params: Any, generator: torch.Generator,
               output_ids: list[int] | None = None) -> int:
        if self.verifies:  # a row with no guesses: verification draws its one token
            return self.speculative.verify(logits[None], [params], [[]], [None], [output_ids or []], [generator])[0][0]
        if self.batched:
            return self.module.sample(logits[None], [params], [generator], [output_ids or []])[0]
        if output_ids is None:  # stage 01's sampler has no penalties, hence no output ids
            return self.module.sample(logits, params, generator)
        return self.module.sample(logits, params, generator, output_ids)

    def apply_penalties(self, logits: torch.Tensor, output_ids: list[int], params: Any) -> torch.Tensor:
        if self.batched:
            return self.module.apply_penalties(logits[None], [params], [output_ids])[0]
        return self.module.apply_penalties(logits, output_ids, params)

    def compute_logprobs(self, logits: torch.Tensor, token_ids: list[int], k: int) -> list:
        if self.batched:
            return self.module.compute_logprobs(logits, token_ids, [k] * len(token_ids))
        return self.module.compute_logprobs(logits, token_ids, k)
