"""The notebook's client's bookkeeping of one request a cell sends (ipyparallel's ``Client._send`` and
``Client.create_message_futures``, kept as they keep it, with lighter futures); each entry is listed in
``nbdist.compat.PRIVATE_APIS``."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Collection
from concurrent.futures import Future
from typing import Any


@functools.cache
def lean_future() -> Any:
    """``LeanFuture``, made the first time it is asked for (this package imports nothing heavy at import time)."""
    from ipyparallel.client.futures import MessageFuture

    sent: Future[Any] = Future()  # the tracker of every request that is not tracked: sent, with no zmq tracker
    sent.set_result(None)

    class LeanFuture(MessageFuture):  # type: ignore[misc]
        """ipyparallel's ``MessageFuture`` for a request that is not tracked, with one lock instead of three: no
        ``Event`` of its own (``wait`` waits on its Future's condition) and no tracker Future of its own (one shared,
        done, as ipyparallel sets an untracked request's). A cell makes two a rank (its reply and its output): at 256
        ranks, 1,024 condition variables and their locks fewer a cell."""

        def __init__(self, msg_id: str, header: Any) -> None:
            Future.__init__(self)
            self.msg_id, self.header = msg_id, header
            self.track, self._tracker, self.tracker = False, None, sent
            self.iopub_callbacks: list[Any] = []

        def wait(self, timeout: float | None = None) -> bool:
            with self._condition:
                if not self.done():
                    self._condition.wait(timeout)
            return self.done()

    return LeanFuture


def awaited(
    client: Any, msg_id: str, header: Any, uuid: str, label: str | None = None, known: Collection[str] | None = None
) -> Any:
    """The client's bookkeeping of a request to the engine ``uuid`` that a reply will answer, as ``Client._send`` keeps
    it: outstanding (and, while the engine is registered, among that engine's: a dead engine's request fails with
    EngineError), its reply and output futures as ``create_message_futures`` makes them (``lean_future``'s), and their
    cleanup once both are in. Returns the reply's future. ``known``: the registered engines' uuids (``registered``),
    read once for a cell's requests (ipyparallel looks through its dict's values for each: at 1,024 ranks, 7 ms a
    cell)."""
    from ipyparallel import util

    client.outstanding.add(msg_id)
    if uuid in (client._engines.values() if known is None else known):
        client._outstanding_dict[uuid].add(msg_id)
    lean = lean_future()
    reply, output = lean(msg_id, header), lean(msg_id, header)
    client._futures[msg_id] = reply
    client._output_futures[msg_id] = output
    output.metadata = client.metadata[msg_id]
    output.metadata["submitted"] = util.utcnow()
    output.metadata["label"] = label
    reply.output = output
    # forgotten once both are done (``Client._send``'s ``multi_future``, without a Future of its own)
    _Countdown.follow([reply, output], functools.partial(forget, client, msg_id))
    return reply


def registered(client: Any) -> set[str]:
    """The uuids of the engines registered with the client now (``awaited``'s ``known``)."""
    return set(client._engines.values())


def async_result(client: Any, futures: list[Any], targets: Any) -> Any:
    """ipyparallel's ``AsyncResult`` of a cell's requests (``awaited``'s futures), as ``view.execute`` returns it
    (``lean_result``)."""
    return lean_result()(client, futures, fname="execute", targets=targets, owner=True)


@functools.cache
def lean_result() -> Any:
    """``LeanResult``, made the first time it is asked for."""
    from ipyparallel.client.asyncresult import AsyncResult

    class LeanResult(AsyncResult):  # type: ignore[misc]
        """ipyparallel's ``AsyncResult``, following its requests' futures with a count each (``_Countdown``) instead
        of ``multi_future``'s set and callback a future: three callbacks fewer a rank. The same results (the first
        rank's error in rank order, as ``multi_future`` sets it), output and ``ready()``. Its requests are untracked
        (``awaited``): each is sent once handed to the IO thread, so it is sent from the start."""

        def _init_futures(self) -> None:
            children = self._children
            self._result_future: Future[Any] = Future()
            self._sent_future: Future[Any] = Future()
            self._output_future: Future[Any] = Future()

            def results() -> None:
                try:
                    self._result_future.set_result([f.result() for f in children])
                except Exception as exc:
                    self._result_future.set_exception(exc)

            def outputs() -> None:
                self._output_future.set_result([None] * (len(children) + 1))

            self._sent_future.add_done_callback(self._handle_sent)
            self._sent_future.set_result([f.tracker.result() for f in children])
            _Countdown.follow(children, results)
            _Countdown.follow([self._result_future] + [f.output for f in children], outputs)
            self._result_future.add_done_callback(self._resolve_result)
            self._output_future.add_done_callback(self._resolve_output)
            self.add_done_callback(self._finalize_result)

    return LeanResult


class _Countdown:
    """Call ``then`` once every one of some futures is done (on the thread that finished the last)."""

    __slots__ = ("ended", "left", "then")

    def __init__(self, left: int, then: Callable[[], None]) -> None:
        self.left, self.then, self.ended = left, then, itertools.count(1)  # next(): atomic, whatever thread ends one

    @classmethod
    def follow(cls, futures: list[Any], then: Callable[[], None]) -> None:
        count = cls(len(futures), then)
        for f in futures:
            f.add_done_callback(count.one)  # one already done is called at once

    def one(self, future: Any) -> None:
        if next(self.ended) == self.left:  # the last
            self.then()


def forget(client: Any, msg_id: str, done: Any = None) -> None:
    """Out of the client's caches, as ``Client._send``'s cleanup does for a direct request."""
    for cache in (client.results, client._futures, client._output_futures, client.metadata):
        cache.pop(msg_id, None)
