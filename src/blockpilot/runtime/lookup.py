"""Drafting by lookup: copy what followed the last time the context ended the same way.

Greedy answers of a small model repeat themselves and their prompts: code restates the names and
lines of its prompt, lists repeat their scaffolding, chat falls into loops. Where the last `n` tokens
of the context (`min_ngram <= n <= max_ngram`) occurred before, the tokens that followed that earlier
occurrence are a draft that costs no forward pass (prompt lookup decoding; Saxena 2023, and
transformers' `prompt_lookup_num_tokens`). The decode loop uses it *instead of* the drafter's block
on the steps where such a match exists, and the drafter's block elsewhere; the target verifies either
the same way, so outputs do not change (at T > 0 a copied draft is deterministic and is judged by
"sample, then match", which is exact for any deterministic draft, see `runtime.sampling`).

Measured by exact greedy replay (`scripts/lookup_replay.py`) of the stage-12 drafter over the
target's 128-token answers to all 164 HumanEval problems / all 80 MT-Bench first turns, tokens a
step at block 6 (8): the drafter alone 2.693 / 1.925 (2.772 / 1.940), lookup alone 1.884 / 1.610,
lookup where a match of 3+ tokens exists and the drafter elsewhere **3.104 / 2.227 (3.372 / 2.333)**;
a floor of 2 tokens gives 2.914 / 2.261, of 4 tokens 3.096 / 2.187. A lookup step also skips the
drafter's call.
"""

from __future__ import annotations

MIN_NGRAM = 3  # 2-token matches copy too often where the drafter knows better (replay above)
MAX_NGRAM = 4  # the longest match is tried first


class PromptLookup:
    """An incremental n-gram index over one request's tokens (prompt, then what it commits).

    `propose(count)` returns `count` tokens to follow the last token, copied from after the most recent
    earlier occurrence of the longest suffix of `max_ngram` down to `min_ngram` tokens, or None when
    no such suffix occurred before. A copy that runs into the present continues periodically (the
    context is then a loop of that period). Each committed token is indexed once: O(1) a token.
    """

    def __init__(self, tokens, min_ngram: int = MIN_NGRAM, max_ngram: int = MAX_NGRAM):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram (got {min_ngram}, {max_ngram})")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = [int(t) for t in tokens]
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self._indexed = 0  # n-grams ending before this position are in `_ends`

    def extend(self, tokens) -> None:
        self.tokens += [int(t) for t in tokens]

    def propose(self, count: int) -> list[int] | None:
        last = len(self.tokens) - 1
        toks = self.tokens
        for end in range(self._indexed, last):  # index every n-gram that ends before the last token
            for n, ends in self._ends.items():
                if end >= n - 1:
                    ends[tuple(toks[end - n + 1: end + 1])] = end
        self._indexed = max(self._indexed, last)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if last < n - 1:
                continue
            end = self._ends[n].get(tuple(toks[last - n + 1:]))
            if end is not None:
                period = last - end
                return [toks[end + 1 + k % period] for k in range(count)]
        return None
