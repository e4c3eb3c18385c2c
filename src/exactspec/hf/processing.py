"""Transformers' logits processors as the settings that make p and q (the same-processing rule).

`generate()` draws each token from softmax(processors(prefix, logits)), or takes its argmax when
greedy, where `prefix` is the row as `generate()` holds it: the prompt row as given (left padding
included) followed by the tokens generated so far. That is the **processed target's** law, and
exactspec keeps it exactly by applying the same processor list to the target's logits (p) and to
the draft's (q) at every position of a block, each with the prefix that position follows: the
row's committed tokens, then the drafts before it.

Processors are written for Transformers' loop: one call per step over the whole batch, all rows
of one length. In a round, rows have committed different numbers of tokens, so the rows that share
a length are processed together, laid out in a batch of the original size at their own indices:
per-row parameters (the repetition penalty's `prompt_ignore_length`, the batch id that
`prefix_allowed_tokens_fn` receives) stay right. The other slots hold a copy of a group row and
their output is dropped.

Nothing here imports transformers: a processor is any callable (input_ids[B, t], scores[B, V]) →
scores[B, V].
"""
from __future__ import annotations

import torch

from exactspec.sampling import probs_from_logits

# Processors that keep state from one call to the next (a cache, a call counter, a running
# context): exactspec calls a processor once per position of a block, for drafts that may be
# rejected, so no such state can follow the sequence that is finally kept.
STATEFUL_PROCESSORS = {
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "ClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "SynthIDTextWatermarkLogitsProcessor": "watermarking_config",
    "WhisperNoSpeechDetection": "no_speech_threshold",
    "WhisperTimeStampLogitsProcessor": "return_timestamps",
    "DiaEOSDelayPatternLogitsProcessor": "delay_pattern",
}


def check_processors(processors) -> None:
    """Raise ValueError naming a processor (and the setting that adds it) that keeps state."""
    for processor in processors:
        name = type(processor).__name__
        if name in STATEFUL_PROCESSORS:
            raise ValueError(f"logits processor {name} (from {STATEFUL_PROCESSORS[name]}) keeps state "
                             "between calls, so it cannot score drafts that may be rejected: "
                             "exactspec cannot keep its output exact")


def in_full_batch(rows: torch.Tensor, values: torch.Tensor, batch_size: int) -> torch.Tensor:
    """values[g, ...] of batch rows `rows` placed at those indices of a [batch_size, ...] tensor;
    the other slots hold copies of values[0] (their results are to be dropped)."""
    full = values[:1].expand(batch_size, *values.shape[1:]).clone()  # [B, ...]
    full[rows] = values
    return full


class Processing:
    """The decoding settings of one `generate()` call: Transformers' prepared processor list
    (penalties, bans, and the warpers temperature / top-k / top-p when sampling), then softmax,
    or the argmax (a one-hot, lowest index on ties) when greedy.

    It reads the tokens before each position (`needs_prefix`), so the engine binds it to each
    round's rows with `after(rows, committed)` and calls the bound object's
    `probs(logits, drafts=...)`.
    """

    needs_prefix = True

    def __init__(self, processors, *, greedy: bool, batch_size: int):
        check_processors(processors)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        self.processors, self.greedy, self.batch_size = processors, bool(greedy), batch_size

    def probs(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        raise ValueError("Processing needs each row's prefix: bind it with .after(rows, committed)")

    def after(self, rows: torch.Tensor, committed: list[torch.Tensor], **tokens) -> "AtPrefix":
        """Bound to one round: rows[b] the batch index of each active row, committed[b] its tokens
        so far (the prompt row as given, left padding included, then its new tokens), as
        `generate()` holds it (`tokens`: the engine's prompts= and generated=, not read)."""
        return AtPrefix(self, rows, committed)

    def process(self, rows: torch.Tensor, prefix: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Processed scores[g, V] of batch rows `rows` (all of one length), prefix[g, t]."""
        ids = in_full_batch(rows, prefix, self.batch_size)  # [B, t]
        full = in_full_batch(rows, scores, self.batch_size)  # [B, V]
        return self.processors(ids, full)[rows]  # [g, V]

    def distribution(self, scores: torch.Tensor) -> torch.Tensor:
        """Processed scores → probabilities: a one-hot at the argmax when greedy, else softmax."""
        return probs_from_logits(scores, temperature=0.0 if self.greedy else 1.0)


class AtPrefix:
    """`Processing` bound to one round's rows, grouped by how many tokens they have committed."""

    def __init__(self, processing: Processing, rows: torch.Tensor, committed: list[torch.Tensor]):
        self.processing = processing
        by_length: dict[int, list[int]] = {}
        for i, tokens in enumerate(committed):
            by_length.setdefault(len(tokens), []).append(i)
        self.groups = [(torch.tensor(members), rows[members],  # positions in the round, batch rows
                        torch.stack([committed[i] for i in members]))  # [g, c]
                       for members in by_length.values()]

    def probs(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """logits[b, n, V] (or [b, V], n = 1) → probabilities of the same shape. With k =
        drafts.size(1) ≥ n − 1, position j follows the committed tokens and drafts[:, : k − n + 1 + j]:
        the last position follows every draft given (the target scores γ'+1 positions after γ'
        drafts; a draft model scores one position after the drafts it has drawn so far)."""
        if drafts is None:
            raise ValueError("drafts is required: processors read the drafts before each position "
                             "(pass an empty [b, 0] tensor for the first)")
        single = logits.dim() == 2
        scores = (logits.unsqueeze(1) if single else logits).float()  # [b, n, V], float32 as in generate()
        n, k = scores.size(1), drafts.size(1)
        if k < n - 1:
            raise ValueError(f"drafts must hold at least n - 1 = {n - 1} tokens per row, got {k}")
        drafts = drafts.to(scores.device)
        processed = torch.empty_like(scores)  # [b, n, V]
        for j in range(n):
            before = k - n + 1 + j  # drafts before position j
            for members, rows, committed in self.groups:
                members, rows = members.to(scores.device), rows.to(scores.device)
                prefix = torch.cat([committed.to(scores.device), drafts[members, :before]], dim=1)  # [g, c + before]
                processed[members, j] = self.processing.process(rows, prefix, scores[members, j])
        probs = self.processing.distribution(processed)  # [b, n, V]
        return probs[:, 0] if single else probs
