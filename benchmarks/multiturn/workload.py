"""The multi-turn workload, shaped like SGLang's ``bench_multiturn``.

``clients`` conversations run ``rounds`` rounds each. Round r's prompt is the conversation so far
(every earlier question and answer) followed by a new question of ``request_length`` tokens; the
engine answers with ``output_length`` tokens. With ``round_barrier`` every client finishes round
r before any starts round r + 1; without it each client moves on as soon as its answer is back.
At most ``max_running`` requests run at once (the engine's batch).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from hicache_core.engine import Engine, Request, RequestResult


@dataclass(frozen=True)
class Workload:
    clients: int = 16
    rounds: int = 4
    request_length: int = 512
    output_length: int = 8
    max_running: int = 4
    round_barrier: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("clients", "rounds", "request_length", "output_length", "max_running"):
            if getattr(self, name) < 1:
                raise ValueError(f"Workload.{name} must be at least 1, got {getattr(self, name)}")

    def questions(self, vocab_size: int) -> list[list[list[int]]]:
        """The new tokens of every round of every client, the same for every tier configuration."""
        rng = random.Random(self.seed)
        return [
            [[rng.randrange(vocab_size) for _ in range(self.request_length)] for _ in range(self.rounds)]
            for _ in range(self.clients)
        ]


@dataclass
class Served:
    """One finished request, with when it ran."""

    client: int
    round: int
    result: RequestResult
    submitted: float
    finished: float
    #: The prompt's first page of tokens (the engine's page size): two prompts share a page only
    #: if they share this one.
    prompt_head: tuple[int, ...] = ()


def run_workload(
    engine: Engine, workload: Workload, questions: list[list[list[int]]], on_round: Callable[[int], None] | None = None
) -> list[Served]:
    """Serve the whole workload on ``engine``; ``on_round(r)`` is called as each round completes."""
    histories: list[list[int]] = [[] for _ in range(workload.clients)]
    served: list[Served] = []

    def request(client: int, round_: int) -> Request:
        return Request(f"c{client}-r{round_}", histories[client] + questions[client][round_], workload.output_length)

    def record(client: int, round_: int, req: Request, result: RequestResult, submitted: float) -> None:
        histories[client] = req.tokens + result.output_ids
        served.append(Served(client, round_, result, submitted, time.perf_counter(), tuple(req.tokens[: engine.config.page_size])))

    if workload.round_barrier:
        for round_ in range(workload.rounds):
            requests = [request(c, round_) for c in range(workload.clients)]
            started = time.perf_counter()
            for client, (req, result) in enumerate(zip(requests, engine.serve(requests))):
                record(client, round_, req, result, started)
            if on_round is not None:
                on_round(round_)
        return served

    pending: dict[str, tuple[int, int, Request, float]] = {}
    completed_rounds = [0] * workload.rounds

    def submit(client: int, round_: int) -> None:
        req = request(client, round_)
        pending[req.rid] = (client, round_, req, time.perf_counter())
        engine.submit(req)

    for client in range(workload.clients):
        submit(client, 0)
    while engine.has_work():
        engine.step()
        for result in engine.take_results():
            client, round_, req, submitted = pending.pop(result.rid)
            record(client, round_, req, result, submitted)
            completed_rounds[round_] += 1
            if completed_rounds[round_] == workload.clients and on_round is not None:
                on_round(round_)
            if round_ + 1 < workload.rounds:
                submit(client, round_ + 1)
    return served
