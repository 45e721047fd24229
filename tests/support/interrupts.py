"""Interrupting code where CPython would run a signal handler.

A signal handler's exception (``KeyboardInterrupt``, a SIGALRM timeout,
Celery's soft time limit) is raised in the main thread at the next point
where the interpreter looks for pending signals. In CPython 3.11 and 3.12
those points are: right after a call returns, at a backward jump, and as a
frame starts or resumes after a plain ``yield`` (not after ``yield from``
or ``await``). :func:`interrupt_at` arms a tracer that raises
:class:`Interrupt` at the ``n``-th such point inside chosen source files,
so a test can walk ``n`` = 1, 2, ... through every one of them. A frame's
start is seen through the tracer's ``call`` event (no ``opcode`` event is
sent for it), the rest through ``opcode`` events.

A tracer sees an instruction just before it runs, so "right after a call"
is raised at the next instruction; where that instruction lies in another
``try`` region than the call (a ``return f()`` inside ``try``/``finally``
continues in an inlined copy of the ``finally``), the real exception would
belong to the call's region, which a tracer cannot reproduce: such points
are not counted.
"""

from __future__ import annotations

import ctypes
import datetime
import dis
import functools
import gc
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any

from .sizes import FULL

_AFTER = frozenset(("CALL", "CALL_FUNCTION_EX"))
_AT = frozenset(("JUMP_BACKWARD",))


#: The blocking lock's core, every module of it (``dblock.lock.Locker`` and
#: the parts it is assembled from): what a walk through acquire or release
#: must visit. A part split off into a module of its own belongs here.
LOCK_FILES = (
    "dblock/lock.py",
    "dblock/_lockbase.py",
    "dblock/_held.py",
    "dblock/_alone.py",
    "dblock/_handoff.py",
    "dblock/_lifecycle.py",
    "dblock/_drive.py",
    "dblock/_driver.py",
    "dblock/kinds/exclusive.py",
)


#: A walk at smoke size (the default) visits every STRIDE-th point, which of
#: them set by OFFSET: it changes each day, so successive runs of the suite
#: cover every point in turn. ``DBLOCK_FULL=1`` visits every point (as a
#: release, or a change to what the walks guard, should); a failure names its
#: point, and ``DBLOCK_WALK_OFFSET=K`` runs that day's selection again.
STRIDE = 1 if FULL else max(1, int(os.environ.get("DBLOCK_WALK_STRIDE") or 3))
OFFSET = int(os.environ.get("DBLOCK_WALK_OFFSET") or datetime.date.today().toordinal()) % STRIDE


def next_point(n: int) -> int:
    """The point a walk visits after point ``n`` (0: its first). Points are
    counted from 1 in the order the code reaches them, so a point that never
    fires ends the walk whatever the stride: none after it fires either."""
    n += 1
    while (n - 1) % STRIDE != OFFSET:
        n += 1
    return n


class Interrupt(Exception):
    """What a signal handler raises (a SIGALRM timeout, say)."""


@functools.cache
def _regions(code: CodeType) -> tuple[tuple[int, int, int], ...]:
    return tuple((e.start, e.end, e.target) for e in dis.Bytecode(code).exception_entries)


def _region(code: CodeType, offset: int) -> int | None:
    for start, end, target in _regions(code):
        if start <= offset < end:
            return target
    return None


class Armed:
    """What :func:`interrupt_at` saw: the points passed, and where it raised."""

    def __init__(self) -> None:
        self.points = 0
        self.where: str | None = None

    def start(self) -> None:
        """Set the tracer on this thread (see :func:`arm`)."""


@contextmanager
def interrupt_at(n: int, *files: str) -> Iterator[Armed]:
    """Raise :class:`Interrupt` at the ``n``-th point (see the module's
    docstring) in a frame of any of ``files`` (path endings) on this thread."""
    # The cyclic garbage collector runs weak-reference callbacks and
    # finalizers of objects an earlier walk step left in cycles (a handle
    # held by a traceback) at whatever allocation it likes: a point counted
    # in one step could then be one of those, not of the code walked, and
    # CPython swallows what is raised there. Collect first, and not during.
    # (A callback a plain ``del`` runs still runs: reference counting.)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    armed = arm(n, *files)
    armed.start()
    try:
        yield armed
    finally:
        sys.settrace(None)
        if enabled:
            gc.enable()


def arm(n: int, *files: str, note: str | None = None) -> Armed:
    """What :func:`interrupt_at` does, without a ``with``: ``armed.start()``
    sets the tracer (an ``atexit`` hook, say), ``sys.settrace(None)`` ends it.
    ``note``: a file the point it raised at is written to, as it raises (for
    a process that cannot report otherwise, at its exit)."""
    armed = Armed()
    last: dict[int, int] = {}  # frame id -> offset of its previous instruction

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event != "opcode":
            return local
        code = frame.f_code
        offset = frame.f_lasti
        op = dis.opname[code.co_code[offset]]
        previous = last.get(id(frame))
        last[id(frame)] = offset
        if op in _AT or (op == "RESUME" and code.co_code[offset + 1] < 2):
            eligible = True
        elif previous is not None and dis.opname[code.co_code[previous]] in _AFTER:
            eligible = _region(code, previous) == _region(code, offset)
        else:
            eligible = False
        if eligible:
            armed.points += 1
            if armed.points == n:
                armed.where = (
                    f"{code.co_name} ({code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})"
                )
                _note(note, armed.where)
                raise Interrupt  # (tracing ends here: CPython unsets a tracer that raises)
        return local

    def start(frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        last.pop(id(frame), None)  # (a new frame may have a dead one's id)
        if frame.f_code.co_filename.endswith(files):
            # A frame starting, or resuming after a plain ``yield``, is a
            # point too (its RESUME checks for signals), and the ``call``
            # event is the only place a tracer sees it: no ``opcode`` event
            # is sent for that RESUME. Raised here, the exception leaves the
            # frame before its first line, as a handler's would.
            code = frame.f_code
            offset = frame.f_lasti
            resume = offset >= 0 and dis.opname[code.co_code[offset]] == "RESUME"
            if resume and code.co_code[offset + 1] < 2:
                armed.points += 1
                if armed.points == n:
                    armed.where = (
                        f"{code.co_name} starts "
                        f"({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})"
                    )
                    _note(note, armed.where)
                    raise Interrupt
            frame.f_trace_opcodes = True
            return local
        return None

    armed.start = lambda: sys.settrace(start)  # type: ignore[method-assign]
    return armed


def _note(path: str | None, where: str | None) -> None:
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(where or "")


def raise_in(thread: threading.Thread, exc: type[BaseException]) -> None:
    """Raise ``exc`` in ``thread`` at its next bytecode, as a signal handler's
    exception would be raised in the thread that runs handlers.

    ``PyThreadState_SetAsyncExc`` finds its target by thread id and stops at
    the first match, newest first; in CPython 3.11 a thread being started
    carries its creator's id until it runs. Fired while ``thread`` starts a
    thread of its own (dblock starting its listener, say), the exception
    kills the newborn before it reports it started, and ``thread`` waits in
    ``Thread.start()`` forever. Every thread being started sits in
    ``threading._limbo`` for all of that window, and entering it takes
    ``_active_limbo_lock``: fired under that lock with nothing in limbo, the
    id can only be ``thread``'s."""
    ident = thread.ident
    assert ident is not None, "not started"
    deadline = time.monotonic() + 10.0
    while True:
        with threading._active_limbo_lock:  # type: ignore[attr-defined]
            if not threading._limbo:  # type: ignore[attr-defined]
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(ident), ctypes.py_object(exc)
                )
                return
        assert time.monotonic() < deadline, "a thread stayed in the middle of starting"
        time.sleep(0.001)
