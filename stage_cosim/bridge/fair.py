"""Fair shares between clients: a round-robin job queue, a parsing gate and a parsing meter.

A "client" is a key the server gives (one connection). Without these, whoever sends most takes
everything: four clients sending expensive documents keep both parsing threads busy, and two
clients' long jobs hold every worker.

* :class:`FairQueue` — jobs wait per client; a free worker takes the next client's oldest job,
  round-robin, skipping clients that already run their cap of jobs.
* :class:`FairGate` — at most ``permits`` parses at once and one per client; waiting clients get
  the permits round-robin, so an honest client waits for at most one parse of each other client.
* :class:`ParseMeter` — a token bucket of parsing seconds per client: the CPU time each parse
  took is charged after it; a client whose bucket is empty is refused until it refills.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from typing import AsyncIterator, Generic, Hashable, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Items queued per key; :meth:`get` takes them round-robin over the keys running fewer than
    ``cap`` items (each taken item counts until :meth:`done`). Lives on one asyncio loop."""

    def __init__(self, cap: int) -> None:
        self.cap = max(1, cap)
        self._pending: collections.OrderedDict[Hashable, collections.deque[T]] = collections.OrderedDict()
        self._running: collections.Counter[Hashable] = collections.Counter()
        self._waiters: list[asyncio.Future] = []

    def put_nowait(self, key: Hashable, item: T) -> None:
        self._pending.setdefault(key, collections.deque()).append(item)
        self._wake()

    def qsize(self) -> int:
        return sum(len(q) for q in self._pending.values())

    def running(self, key: Hashable) -> int:
        return self._running[key]

    def take_nowait(self) -> tuple[Hashable, T] | None:
        """The next (key, item) in round-robin order, or None when every waiting key is at its cap."""
        for key in self._pending:
            if self._running[key] >= self.cap:
                continue
            items = self._pending[key]
            item = items.popleft()
            if items:
                self._pending.move_to_end(key)      # its next item waits for the other keys' turn
            else:
                del self._pending[key]
            self._running[key] += 1
            return key, item
        return None

    async def get(self) -> tuple[Hashable, T]:
        while True:
            taken = self.take_nowait()
            if taken is not None:
                return taken
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def done(self, key: Hashable) -> None:
        """An item of ``key`` taken earlier has finished: the key may run another."""
        self._running[key] -= 1
        if self._running[key] <= 0:
            del self._running[key]
        self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


class FairGate:
    """``permits`` holders at once, one per key; waiting keys are served round-robin."""

    def __init__(self, permits: int) -> None:
        self._free = max(1, permits)
        self._busy: set[Hashable] = set()
        self._waiting: collections.OrderedDict[Hashable, collections.deque[asyncio.Future]] = \
            collections.OrderedDict()

    @contextlib.asynccontextmanager
    async def slot(self, key: Hashable) -> AsyncIterator[None]:
        granted = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, collections.deque()).append(granted)
        self._dispatch()
        try:
            await granted
        except BaseException:
            if granted.done() and not granted.cancelled():
                self._release(key)                  # granted, then cancelled before using it
            else:
                queue = self._waiting.get(key)
                if queue is not None and granted in queue:
                    queue.remove(granted)
                    if not queue:
                        del self._waiting[key]
            raise
        try:
            yield
        finally:
            self._release(key)

    def _release(self, key: Hashable) -> None:
        self._busy.discard(key)
        self._free += 1
        self._dispatch()

    def _dispatch(self) -> None:
        while self._free > 0:
            key = next((k for k in self._waiting if k not in self._busy), None)
            if key is None:
                return
            queue = self._waiting[key]
            granted = queue.popleft()
            if queue:
                self._waiting.move_to_end(key)
            else:
                del self._waiting[key]
            if granted.done():                      # its caller gave up while waiting
                continue
            self._busy.add(key)
            self._free -= 1
            granted.set_result(None)


class ParseMeter:
    """A bucket of ``budget_s`` parsing seconds per key, refilled at ``refill`` seconds per second.

    Thread-safe: parses run in threads and charge what they used. Keys whose bucket is full are
    forgotten (a full bucket is what a new key gets), so the table holds only recent clients."""

    def __init__(self, budget_s: float, refill: float, clock=time.monotonic) -> None:
        self.budget_s, self.refill = budget_s, refill
        self._clock = clock
        self._lock = threading.Lock()
        self._level: dict[Hashable, tuple[float, float]] = {}       # key -> (seconds left, as of)

    def _current(self, key: Hashable, now: float) -> float:
        left, at = self._level.get(key, (self.budget_s, now))
        return min(self.budget_s, left + (now - at) * self.refill)

    def wait_s(self, key: Hashable) -> float:
        """0 when ``key`` may parse now, else the seconds until its bucket is positive again."""
        with self._lock:
            now = self._clock()
            left = self._current(key, now)
            if left >= self.budget_s:
                self._level.pop(key, None)
            return 0.0 if left > 0 else (-left + 1e-3) / self.refill

    def charge(self, key: Hashable, seconds: float) -> None:
        with self._lock:
            now = self._clock()
            self._level[key] = (self._current(key, now) - max(0.0, seconds), now)
