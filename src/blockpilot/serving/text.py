"""Output text for one request: incremental detokenization with OpenAI `stop` strings.

`CompletionText` receives a request's output tokens as the decoder commits them and returns the
text that may be sent: everything decoded so far, less what could still change (a trailing
U+FFFD, i.e. a character whose last byte token has not arrived, and a tail that could be the start
of a stop string). The text is cut before the first stop string, which ends the request.
"""

from __future__ import annotations


class CompletionText:
    """Text increments of one request's output.

    Args:
        tokenizer: a Hugging Face tokenizer (`decode(ids, skip_special_tokens=True)`).
        stop: stop strings; the output ends before the first occurrence of any of them.
    """

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.tokens: list[int] = []
        self.sent = ""
        self.stopped = False  # a stop string was found; nothing more will be sent

    def add(self, tokens: list[int], final: bool = False) -> str:
        """Append committed `tokens`; return the text to send now ("" when none).

        With `final` (the request has ended) nothing is held back.
        """
        if self.stopped:
            return ""
        self.tokens += tokens
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = first_stop(text, self.stop)
        if cut is not None:
            self.stopped = True
            text = text[:max(cut, len(self.sent))]
        elif not final:
            text = text.rstrip("\ufffd")
            text = text[:len(text) - held_back(text, self.stop)]
        if len(text) <= len(self.sent):
            return ""
        new, self.sent = text[len(self.sent):], text
        return new


def first_stop(text: str, stop: tuple[str, ...]) -> int | None:
    """Index of the earliest occurrence of any stop string in `text`, or None."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string (text that
    must wait: the next tokens may complete the stop string)."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
