"""Proposers: cheap guesses of a sequence's next k tokens, for the model to check in one pass.

A guess costs far less than a step of the model, and a wrong one costs only the row that checked it:
verification (``speculative.py``) keeps the tokens the model would have produced anyway (near-ties of
float32 rounding aside). Two proposers, one interface (``propose(seqs, ks)``: up to ``ks[i]`` tokens
for ``seqs[i]``):

* **n-gram prompt lookup.** No model: the sequence's last n tokens occurred earlier in its prompt or
  output? Guess that what followed them then follows them again. Strong when the answer repeats the
  prompt (fix one line of this code, edit this list), useless on open chat. ``ngram_propose`` says it
  in a few lines and scans the whole history; the proposer keeps an index per sequence instead
  (``NgramIndex``), updated with the tokens each step appended, so that a guess is a few dictionary
  lookups however long the sequence (a scan costs about 0.6 ms at 2,000 tokens: 19 ms a step at 64
  sequences of 1,000 tokens, three times a GPU's whole step).
* **A draft model.** A smaller model with the same tokenizer runs k decode steps of its own, over its
  own paged KV cache. With no ``--draft-model``, the draft is the target's first layers with its final
  norm and head (a *layer-skip* draft: nothing more to ship or to load). Its cache is a second tensor
  with the target's number of blocks, addressed through the *same* block tables: a block a sequence
  holds holds both models' K/V for the same positions, so allocation, freeing, preemption and the
  prefix cache need no second bookkeeping.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from common.weights import load_tokenizer

from .block_manager import token_slots
from .kv_cache import KVCache
from .model import LlamaForCausalLM
from .model_runner import ModelRunner, StepInput, captures_graphs
from .sampler import apply_penalties, logits_to_probs
from .sequence import Sequence
from .speculative import Proposal, draw

log = logging.getLogger("llm-course")

# --- n-gram prompt lookup ---------------------------------------------------------------------------------


def ngram_propose(token_ids: list[int], k: int, n_max: int = 4, n_min: int = 2) -> list[int]:
    """Find the most recent earlier occurrence of the last n tokens (n from ``n_max`` down to ``n_min``) and
    propose the (up to) ``k`` tokens that followed it; [] when no suffix of ``n_min`` tokens or more recurs."""
    length = len(token_ids)
    ### BEGIN SOLUTION 8.1
    for n in range(min(n_max, length - 1), n_min - 1, -1):  # the longest match is the likeliest to go on
        suffix = token_ids[length - n :]
        for start in range(length - n - 1, -1, -1):  # backwards: the most recent occurrence first
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + k]
    return []
    ### END SOLUTION


@dataclass
class NgramIndex:
    """Where each n-gram of one sequence's tokens (n from ``n_min`` to ``n_max``) last ended: what
    ``ngram_propose`` searches for, kept up to date instead of searched for.

    It holds the n-grams that end within the first ``length`` tokens; ``add`` takes the next token, O(n_max).
    Only the sequence's own tokens go in (accepted ones: a rejected guess is never in ``token_ids``), and they
    never change, not even when it is preempted: the index is never rebuilt."""

    n_min: int
    n_max: int
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> where its latest occurrence ends
    recent: list[int] = field(default_factory=list)  # the last n_max tokens added
    length: int = 0  # tokens added

    def add(self, token: int) -> None:
        """The next token: every n-gram that ends with it now ends here at its latest."""
        self.recent = [*self.recent[1 - self.n_max :], token]
        self.length += 1
        for n in range(self.n_min, len(self.recent) + 1):
            self.ends[tuple(self.recent[-n:])] = self.length

    def latest_end(self, tokens: list[int], longest: int) -> int | None:
        """Where the latest indexed occurrence of the longest suffix of ``tokens`` (``longest`` down to n_min
        tokens) that has one ends; None when none has."""
        for n in range(longest, self.n_min - 1, -1):  # the longest match is the likeliest to go on
            end = self.ends.get(tuple(tokens[-n:]))
            if end is not None:
                return end
        return None


class NgramProposer:
    """``ngram_propose`` for every sequence, through each one's ``NgramIndex`` (on the sequence, made at its first
    proposal): the same guesses, for a few dictionary lookups and O(n_max) work per token appended since."""

    def __init__(self, n_max: int = 4, n_min: int = 2) -> None:
        assert 1 <= n_min <= n_max
        self.n_max, self.n_min = n_max, n_min

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [Proposal(self.propose_one(seq, k)) for seq, k in zip(seqs, ks, strict=True)]

    def propose_one(self, seq: Sequence, k: int) -> list[int]:
        """What ``ngram_propose(seq.token_ids, k)`` returns. The earlier occurrences of a suffix are those that end
        before the last token: the index takes every token but the last, and looks the suffix up."""
        if seq.ngram_index is None:
            seq.ngram_index = NgramIndex(self.n_min, self.n_max)
        index = seq.ngram_index
        assert (index.n_min, index.n_max) == (self.n_min, self.n_max), "the index was built for other n"
        length = seq.num_tokens
        assert index.length < length, "a sequence's tokens only ever grow"
        new = seq.tokens(index.length, length)  # what it appended since the last proposal
        for token in new[:-1]:
            index.add(token)
        end = index.latest_end([*index.recent, new[-1]], longest=min(self.n_max, length - 1))
        return [] if end is None else seq.tokens(end, end + k)


# --- a draft model ------------------------------------------------------------------------------------------


def layer_skip_draft(target: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """The target's first ``num_layers`` layers, then its final norm and head: a draft that shares every weight."""
    assert 1 <= num_layers <= target.config.num_layers, f"a draft of {num_layers} of {target.config.num_layers} layers"
    with torch.device("meta"):  # the modules are replaced by the target's own just below
        draft = LlamaForCausalLM(replace(target.config, num_layers=num_layers))
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.layers = nn.ModuleList(target.model.layers[:num_layers])
    draft.model.norm = target.model.norm
    draft.model.rotary_emb = target.model.rotary_emb
    draft.lm_head = target.lm_head
    return draft


def load_draft(path: str, target: LlamaForCausalLM, target_vocab: dict[str, int], dtype: torch.dtype,
               device: torch.device) -> LlamaForCausalLM:
    """A separate draft model from a local Hugging Face folder; its tokenizer must be the target's."""
    if load_tokenizer(path).get_vocab() != target_vocab:
        raise ValueError(f"--draft-model {path} has another tokenizer than the model: its guesses would be "
                         "other tokens")
    draft = LlamaForCausalLM.from_pretrained(Path(path), dtype=dtype, device=device)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"--draft-model {path} has {draft.config.vocab_size} logits per row, the model "
                         f"{target.config.vocab_size}")
    return draft


class DraftProposer:
    """k decode steps of a draft model, batched over the sequences that guess.

    Each sequence counts the tokens whose K/V are in the draft's cache (``num_draft_computed_tokens``). Before
    guessing, the draft *catches up* on the rest: the last token, the token before it after a fully accepted
    run, or the whole prompt the first time (``max_catch_up`` tokens a step in all: a sequence further behind
    guesses nothing until it has caught up). Its guesses' K/V are written past the accepted tokens
    and simply overwritten later, as the target's are.

    Its runner is a ``ModelRunner`` of its own: its steps of one token a sequence (every guess after the first,
    and a catch-up of the last token alone) run from static buffers, replaying graphs captured at start-up on
    CUDA (as the target's do, unless ``enforce_eager``); its catch-up steps of several tokens run eagerly."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int, device: torch.device,
                 max_num_seqs: int, max_model_len: int, max_catch_up: int, enforce_eager: bool = False) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.runner = ModelRunner(model, kv_cache, block_size, device, max_num_seqs, max_model_len)
        self.max_catch_up = max_catch_up
        if captures_graphs(device, enforce_eager):
            self.runner.capture()
            log.info("captured the draft's decode step for batch sizes %s in %.1f s (%.0f MiB)", self.runner.sizes,
                     self.runner.capture_seconds, self.runner.graph_memory_bytes / 2**20)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in seqs]
        # First pass: every sequence's catch-up tokens, within max_catch_up in all; those that are caught up get
        # their first guess from its logits.
        rows, catching_up, room = [], [], self.max_catch_up
        for i, seq in enumerate(seqs):
            start = seq.num_draft_computed_tokens
            end = min(seq.num_tokens, start + room)
            if end > start:
                rows.append((seq, seq.tokens(start, end), start))
                catching_up.append(i)
                seq.num_draft_computed_tokens = end
                room -= end - start
        if not rows:
            return proposals
        logits = self.runner.execute(self._step(rows))[0]  # [len(rows), V]: each sequence's last row
        caught_up = [row for row, i in enumerate(catching_up)
                     if seqs[i].num_draft_computed_tokens == seqs[i].num_tokens]
        guessing, logits = [catching_up[row] for row in caught_up], logits[self._indices(caught_up)]
        # Then one decode step per further guess, over the sequences that still want one. The guesses stay on the
        # device: each step's tokens are the last step's guesses, and the CPU reads them all once, at the end.
        guessed: dict[int, list[torch.Tensor]] = {i: [] for i in guessing}  # each sequence's guesses, [] each
        while guessing:
            tokens = self._guess([seqs[i] for i in guessing], [proposals[i] for i in guessing],
                                 [guessed[i] for i in guessing], logits)  # [len(guessing)] int64, on the device
            for row, i in enumerate(guessing):
                guessed[i].append(tokens[row : row + 1])
            still = [row for row, i in enumerate(guessing) if len(guessed[i]) < ks[i]]
            guessing = [guessing[row] for row in still]
            if guessing:
                rows = [(seqs[i], [0], seqs[i].num_tokens + len(guessed[i]) - 1) for i in guessing]  # 0: a placeholder
                for i in guessing:
                    seqs[i].num_draft_computed_tokens += 1  # its newest guess, now in the draft's cache
                step_ids = tokens if len(still) == len(tokens) else tokens[self._indices(still)]
                logits = self.runner.execute(self._step(rows), input_ids=step_ids)[0]
        order = [i for i in guessed if guessed[i]]
        if order:  # the one read of the proposal: every guess of every sequence
            flat = torch.cat([torch.cat(guessed[i]) for i in order]).tolist()
            for i in order:
                proposals[i].token_ids, flat = flat[: len(guessed[i])], flat[len(guessed[i]):]
        return proposals

    def _indices(self, rows: list[int]) -> torch.Tensor:
        """``rows`` as an index tensor on the draft's device, copied without blocking (a Python list as an index
        would be copied with a wait)."""
        return self.runner._to_device(torch.tensor(rows, dtype=torch.int64))

    def _guess(self, seqs: list[Sequence], proposals: list[Proposal], guessed: list[list[torch.Tensor]],
               logits: torch.Tensor) -> torch.Tensor:
        """One more guess for each sequence from the draft's logits [n, V], processed exactly as the model's will be
        (penalties see the guesses so far), as a tensor [n] on the device: greedy rows take the argmax, all at once;
        a sampling request draws its own from q (the sampler's exponential race, from its own generator) and keeps
        q for the acceptance test. Only a penalized sequence's earlier guesses are read back, for its penalties."""
        tokens = logits.argmax(dim=-1)  # [n]
        for row, (seq, proposal) in enumerate(zip(seqs, proposals, strict=True)):
            if seq.params.greedy and not seq.params.penalized:
                continue
            history = torch.cat(guessed[row]).tolist() if seq.params.penalized and guessed[row] else []
            row_logits = apply_penalties(logits[row : row + 1], [seq.params], [seq.output_ids + history])  # [1, V]
            if seq.params.greedy:
                tokens[row] = torch.argmax(row_logits)
                continue
            q = logits_to_probs(row_logits, [seq.params])  # [1, V]
            tokens[row] = draw(q[0], seq.generator)
            proposal.probs = q if proposal.probs is None else torch.cat([proposal.probs, q])
        return tokens

    def _step(self, rows: list[tuple[Sequence, list[int], int]]) -> StepInput:
        """A draft step: for each (sequence, tokens, first position), those tokens through the sequence's own
        block table into the draft's cache, and the logits of its last row."""
        step = StepInput([], [], [], [0], [], [], [], [], [])
        for seq, tokens, start in rows:
            end = start + len(tokens)
            step.input_ids += tokens
            step.positions += range(start, end)
            step.slot_mapping += token_slots(seq.block_table, self.block_size, start, end)
            step.query_start_loc.append(step.query_start_loc[-1] + len(tokens))
            step.seq_lens.append(end)
            step.logits_indices.append(step.query_start_loc[-1] - 1)
            step.num_prompt_logits.append(0)
            step.block_tables.append(seq.block_table.copy())  # ragged: padded where it becomes a tensor
        return step
