"""Background payload writer: serialisation, checksums and I/O overlap the target's forward passes.

A bounded queue gives back-pressure (the capture loop blocks instead of piling up activations in
memory when storage is slower than compute). The first error in a writer thread is re-raised in
the caller's thread on its next ``submit`` or at ``close``; ``close`` always flushes what was
already queued, so an interrupted run keeps every complete sample for the resume.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any

from specdraft.hidden_states.backends.base import HiddenStateBackend
from specdraft.hidden_states.payload import HiddenStatePayload

_STOP = object()


class AsyncWriter:
    """``submit(key, payload)`` from the producer; ``close()`` (or ``with``) to flush and join."""

    def __init__(
        self,
        backend: HiddenStateBackend,
        *,
        max_pending: int = 8,
        num_threads: int = 1,
    ):
        if max_pending < 1 or num_threads < 1:
            raise ValueError("max_pending and num_threads must be >= 1")
        self.backend = backend
        self.bytes_written = 0
        self.samples_written = 0
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"specdraft-writer-{i}", daemon=True) for i in range(num_threads)]
        for t in self._threads:
            t.start()

    def submit(self, key: str, payload: HiddenStatePayload) -> None:
        """Queue one payload (blocks while ``max_pending`` are waiting); raises a writer's error."""
        if self._closed:
            raise RuntimeError("submit() after close()")
        self._raise_if_failed()
        while True:
            try:
                self._queue.put((key, payload), timeout=0.1)
                return
            except queue.Full:
                self._raise_if_failed()  # a failed writer keeps draining; report its error now

    def close(self) -> None:
        """Flush the queue, stop the threads, then raise the first writer error if there was one."""
        if not self._closed:
            self._closed = True
            for _ in self._threads:
                self._queue.put(_STOP)
            for t in self._threads:
                t.join()
        self._raise_if_failed()

    def __enter__(self) -> AsyncWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(Exception):  # the producer failed: still flush complete samples, but its error wins
            self.close()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if self._error is not None:
                continue  # drain without writing after a failure; the error is reported once
            key, payload = item
            try:
                nbytes = self.backend.put(key, payload)
                with self._lock:
                    self.bytes_written += nbytes
                    self.samples_written += 1
            except BaseException as exc:  # noqa: BLE001 - handed to the producer thread
                with self._lock:
                    if self._error is None:
                        self._error = exc
