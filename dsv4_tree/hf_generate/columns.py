"""The new tokens of a batch in transformers' layout, and a streamer fed as they are accepted.

transformers' loop appends one column per step, [batch] tokens, a finished row getting
`pad_token_id`, and hands each column to `streamer.put` as it is made; generation ends when
every row has finished. Rows here advance by whole accepted paths at their own pace, so a
column is put once every row has a token there (or has finished): the streamer sees exactly
the columns of the returned `sequences[:, input_len:]`, in order, each once."""
from __future__ import annotations

import torch

from ..errors import InputError


class Columns:
    """hooks.emitted of generate_batch (and the row lengths TreeAcceptor needs)."""

    def __init__(self, width: int, batch: int, pad: int | None, streamer=None):
        self.width = width  # input_ids.shape[1]: every row's padded prompt
        self.rows = [[] for _ in range(batch)]  # new tokens per row
        self.done = [False] * batch
        self.pad = pad
        self.streamer = streamer
        self.sent = 0  # columns put to the streamer

    def seq_len(self, index: int) -> int:
        """Row `index`'s input_ids length in transformers' loop now."""
        return self.width + len(self.rows[index])

    def emitted(self, index: int, tokens: list, done: bool) -> None:
        self.rows[index].extend(tokens)
        self.done[index] = self.done[index] or done
        if self.streamer is not None:
            self._flush()

    def _column(self, c: int) -> list | None:
        col = []
        for row, done in zip(self.rows, self.done):
            if c < len(row):
                col.append(row[c])
            elif done:
                col.append(self._pad())
            else:
                return None
        return col

    def _flush(self) -> None:
        end = max(len(r) for r in self.rows)
        while self.sent < end:
            col = self._column(self.sent)
            if col is None:
                return
            self.streamer.put(torch.tensor(col))
            self.sent += 1

    def _pad(self) -> int:
        if self.pad is None:
            # transformers sets pad_token_id to eos_token_id[0] when there is an EOS; a row can
            # only finish early on an EOS, so this cannot happen through generate
            raise InputError("rows finished at different lengths and pad_token_id is None")
        return self.pad

    def finish(self) -> torch.Tensor:
        """The new tokens, [batch, longest row], finished rows padded; the streamer ended."""
        end = max(len(r) for r in self.rows)
        out = torch.tensor([r + [self._pad()] * (end - len(r)) if len(r) < end else r for r in self.rows],
                           dtype=torch.long).reshape(len(self.rows), end)
        if self.streamer is not None:
            self._flush()
            self.streamer.end()
        return out
