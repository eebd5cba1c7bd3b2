"""A next-token answer's alternatives: each a token and its log-probability, in the two columns
the IPC door sends (`TopScores`), or as rows of the batch's table read back from the device
(`TopTable`, whose row indexed is a `TopRow` until read). Part of the messages (protocol)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class TokenScore(NamedTuple):
    """A token and its log-probability: a tuple, since a next-token answer holds k of them per
    prompt and a frozen dataclass costs about three times as much to make."""

    token_id: int
    logprob: float


class TopScores(Sequence):
    """A next-token answer's alternatives, most likely first, in the two columns the IPC door sends
    (`ids`, `logprobs`); indexed or iterated, TokenScores made only when read (a TokenScore per
    alternative, made by the engine and taken apart by the codec, cost 1.5 µs a prompt)."""

    __slots__ = ("ids", "logprobs")

    def __init__(self, ids: list[int], logprobs: list[float]):
        self.ids, self.logprobs = ids, logprobs

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return list(map(TokenScore, self.ids[i], self.logprobs[i]))
        return TokenScore(self.ids[i], self.logprobs[i])

    def __iter__(self):
        return map(TokenScore, self.ids, self.logprobs)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"


class TopTable(Sequence):
    """A batch's top-k as read back: `table` (2, B, k_max) float32, values then ids (exact below 2**24), and each
    row's k. A row indexed is a TopRow, read (every row into lists, once) only when looked at: the IPC door sends
    a front end the rows' bytes instead (`packed`), 0.2 µs a prompt against 1.3 for reading every row and
    encoding the lists."""

    __slots__ = ("table", "top_ks", "_rows")

    def __init__(self, table: np.ndarray, top_ks: Sequence[int]):
        self.table, self.top_ks, self._rows = table, top_ks, None

    def __len__(self) -> int:
        return self.table.shape[1]

    def __getitem__(self, row: int) -> TopRow:
        if not -len(self) <= row < len(self):
            raise IndexError(row)
        return TopRow(self, row % len(self))

    def rows(self) -> list[TopScores]:
        """Every row as its TopScores, read once."""
        if self._rows is None:
            self._rows = read_rows(self.table, self.top_ks)
        return self._rows

    def failed_rows(self) -> frozenset[int]:
        """Rows whose best value is not finite (a NaN or +inf logit makes its log_softmax NaN)."""
        return frozenset(np.flatnonzero(~np.isfinite(self.table[0, :, 0])).tolist())

    def packed(self, rows: list[int]) -> tuple[bytes, list[int]]:
        """These rows as (2, len(rows), k_max) float32 bytes, and their k ([]: all k_max); `take`: 2-3x the
        speed of [:, rows] for a list of rows."""
        k_max = self.table.shape[2]
        top_ks = [self.top_ks[row] for row in rows]
        return self.table.take(rows, axis=1).tobytes(), [] if all(k == k_max for k in top_ks) else top_ks


def read_rows(table: np.ndarray, top_ks: Sequence[int]) -> list[TopScores]:
    """(2, B, k_max) float32, values then ids -> each row's TopScores, cut to its k."""
    return cut_rows(table[1].astype(np.int64).tolist(), table[0].tolist(), top_ks, table.shape[2])


def cut_rows(ids: list[list[int]], values: list[list[float]], top_ks: Sequence[int], k_max: int) -> list[TopScores]:
    """Rows of k_max ids and values -> each row's TopScores, cut to its k."""
    if all(k == k_max for k in top_ks):  # every row asked for as many: no slicing
        return list(map(TopScores, ids, values))
    return [TopScores(row_ids[:k], row_values[:k]) for row_ids, row_values, k in zip(ids, values, top_ks)]


class TopRow(TopScores):
    """A row of a TopTable, its TopScores once looked at (ids, logprobs, iterated): a batch's
    NextTokenBatch answers carry these, so the IPC door sends their rows' bytes (Result's columns)
    where reading each row into lists first cost 0.8 µs a prompt. TopScores' reads, on the row."""

    __slots__ = ("table", "row")

    def __init__(self, table: TopTable, row: int):  # TopScores' slots stay unset: ids and logprobs are read
        self.table, self.row = table, row

    def read(self) -> TopScores:
        return self.table.rows()[self.row]

    @property
    def ids(self) -> list[int]:
        return self.read().ids

    @property
    def logprobs(self) -> list[float]:
        return self.read().logprobs
