"""A running request's own sliding-window KV: only what its window still reads, and what the cache keeps.

A sliding-window layer at position ``p`` reads the KV of positions ``[p - context, p]`` only
(``context = window - 1``). So a request does not hold SWA KV for every position it computes:
it holds the pages its next chunk's window reaches, and gives back (to its own spare pages, for
the positions after) every page that falls out of the window, except the pages the cache will
keep: the window before each *boundary* where a later request may resume (the branch point, the
end of the prompt's whole pages, the end of the request's pages). A long prompt is therefore
prefilled in chunks of ``chunk`` tokens.

:meth:`RequestWindow.peak` counts, pass by pass (chunks, then one position per decode step), the
most pages the request ever holds, which the runner reserves up front: a request never waits
for SWA memory once it runs, and its SWA memory does not grow with its length. With ``chunk``
of about a window it is a few windows (the working window and chunk, plus the kept windows),
whatever the prompt's length.

Positions are absolute; pages are ``position // page_size``. Pages before ``start`` (the resume
point) are the tree's, read as ``prefix`` (the window before ``start``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class RequestWindow:
    """The SWA pages of one request from its resume point ``start`` (page-aligned) on."""

    def __init__(
        self, page_size: int, context: int, chunk: int, start: int, prompt: int, total: int, boundaries: set[int]
    ) -> None:
        self.page_size = page_size
        self.context = context
        self.chunk = chunk
        self.start = start
        self.prompt = prompt
        self.total = total
        self.boundaries = {b for b in boundaries if start < b <= total}
        ps = page_size
        #: Pages kept for the cache: the window before each boundary.
        self.kept = {p for b in self.boundaries for p in range(max(start, b - context) // ps, b // ps)}
        self.pages: dict[int, torch.Tensor] = {}
        self.spare: list[torch.Tensor] = []

    def first(self, position: int) -> int:
        """The first position a sliding-window query at ``position`` reads."""
        return max(0, position - self.context)

    def passes(self, since: int, until: int) -> Iterator[tuple[int, int]]:
        """The forward passes of the run that begin in ``[since, until)``: the prompt from ``start``
        in chunks of ``chunk``, then one position per decode step."""
        chunk = self.chunk
        first = self.start + max(0, -(-(since - self.start) // chunk)) * chunk  # the first chunk from since
        for begin in range(first, min(self.prompt, until), chunk):
            yield begin, min(begin + chunk, self.prompt)
        for position in range(max(self.prompt, since), min(self.total, until)):
            yield position, position + 1

    def peak(self) -> int:
        """The most pages held at once over the whole run (what to reserve).

        During a pass the request holds the pages the pass reads (``_needed``: a run of pages
        up to its end) and the kept pages before them: every page before the run was read by an
        earlier pass, and only kept ones outlive it. So the count is arithmetic, one step per pass.
        """
        kept = sorted(self.kept)
        most = below = 0
        for begin, end in self.passes(self.start, self.total):
            needed = self._needed(begin, end)
            while below < len(kept) and kept[below] < needed.start:
                below += 1
            most = max(most, len(needed) + below)
        return most

    def give(self, slots: torch.Tensor) -> None:
        """Reserved slots (whole pages) to hold the request's SWA KV in."""
        self.spare.extend(slots.split(self.page_size))

    def hold(self, begin: int, end: int) -> None:
        """Take spare pages for the positions a pass over ``[begin, end)`` reads that it does not hold yet."""
        for page in self._needed(begin, end):
            if page not in self.pages:
                assert self.spare, "RequestWindow.peak reserved too few pages"
                self.pages[page] = self.spare.pop()

    def slots(self, begin: int, end: int, prefix: torch.Tensor, prefix_base: int) -> torch.Tensor:
        """Device slots of positions ``[first(begin), end)`` for a pass over ``[begin, end)``
        (``hold`` first); ``prefix`` holds ``[prefix_base, start)``."""
        self.hold(begin, end)
        first = self.first(begin)
        ps, parts = self.page_size, []
        if first < self.start:
            parts.append(prefix[first - prefix_base :])
        own_from = max(first, self.start)
        if own_from < end:
            own = torch.cat([self.pages[p] for p in range(own_from // ps, -(-end // ps))])
            parts.append(own[own_from - own_from // ps * ps : end - own_from // ps * ps])
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def advance(self, end: int) -> None:
        """Positions before ``end`` are computed: give back the pages no later window reads and
        the cache does not keep."""
        for page in [p for p in self.pages if self._released(p, end)]:
            self.spare.append(self.pages.pop(page))

    def take(self, begin: int, end: int) -> torch.Tensor | None:
        """The slots of positions ``[begin, end)`` (whole pages) if all are held; they leave the request."""
        pages = range(begin // self.page_size, end // self.page_size)
        if not all(p in self.pages for p in pages):
            return None
        return torch.cat([self.pages.pop(p) for p in pages])

    def leftover(self) -> torch.Tensor:
        """Every slot the request still holds (for the caller to free)."""
        parts = [*self.pages.values(), *self.spare]
        self.pages.clear()
        self.spare.clear()
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def _needed(self, begin: int, end: int) -> range:
        ps = self.page_size
        return range(max(self.first(begin), self.start) // ps, -(-end // ps))

    def _released(self, page: int, end: int) -> bool:
        return (page + 1) * self.page_size <= self.first(end) and page not in self.kept
