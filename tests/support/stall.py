"""Hold one server thread of a PRIVATE MariaDB right after it drew an
``AUTO_INCREMENT`` value, while every other thread of the server runs on.

This is what a loaded machine does now and then by itself: the thread running
an ``INSERT`` is descheduled between InnoDB's draw of the value (in
``handler::update_auto_increment``) and its write of the row. Here gdb makes
it happen on cue: it attaches in non-stop mode, breaks in
``handler::update_auto_increment`` (an exported symbol of ``mariadbd``, no
debug symbols needed), lets that one thread return from it and keeps it
stopped there until :meth:`AutoIncrementStall.release`.

Never point it at a shared server: it stops threads of the process it attaches to.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["AutoIncrementStall", "unavailable"]

_SYMBOL = "handler::update_auto_increment"

# Runs inside gdb up to the stall; then gdb sits in its event loop (reading
# commands from our pipe), so the other threads of the server, new ones
# included, run on while the held one stays stopped.
_SCRIPT = """\
set pagination off
set confirm off
set non-stop on
set print thread-events off
attach {pid}
python
import os
d = {dir!r}
def mark(name):
    open(os.path.join(d, name), "w").close()
bp = gdb.Breakpoint({symbol!r}, internal=True)
hit = []
def on_stop(event):
    if isinstance(event, gdb.BreakpointEvent) and bp in event.breakpoints:
        hit.append(gdb.selected_thread())
gdb.events.stop.connect(on_stop)
mark("armed")
while not hit:
    gdb.execute("continue -a")  # returns at any thread's stop, the attach's included
bp.delete()
hit[0].switch()
gdb.execute("finish")  # that thread only: the value is drawn, the row not yet written
mark("stalled")
end
"""


def unavailable() -> str | None:
    """Why a stall cannot be made on this machine, or None if it can."""
    if shutil.which("gdb") is None:
        return "gdb is not installed"
    server = shutil.which("mariadbd") or "/usr/sbin/mariadbd"
    try:
        symbols = subprocess.run(
            ["nm", "-D", "-C", server], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot read the symbols of {server}: {exc}"
    if f"{_SYMBOL}()" not in symbols:
        return f"{server} does not export {_SYMBOL}"
    return None


class AutoIncrementStall:
    """``with AutoIncrementStall(pid): ...``: the next statement of the server
    ``pid`` that draws an ``AUTO_INCREMENT`` value stops right after the draw."""

    def __init__(self, pid: int) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="dblock-stall-"))
        script = self._dir / "stall.gdb"
        script.write_text(_SCRIPT.format(pid=pid, dir=str(self._dir), symbol=_SYMBOL))
        self._log = self._dir / "gdb.log"
        with open(self._log, "wb") as log:
            self._gdb = subprocess.Popen(
                ["gdb", "-q", "-nx", "-x", str(script)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._released = False
        self._wait("armed", 60)

    def _wait(self, marker: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not (self._dir / marker).exists():
            if self._gdb.poll() is not None or time.monotonic() > deadline:
                self.release()
                raise RuntimeError(f"gdb never reached {marker!r}: {self._log.read_text()[-2000:]}")
            time.sleep(0.005)

    def wait_stalled(self, timeout: float = 30.0) -> None:
        """Until a thread drew a value and is held before writing its row."""
        self._wait("stalled", timeout)

    def release(self) -> None:
        """Let the held thread go on: gdb detaches from the server (which
        resumes every thread it stopped) and quits."""
        if self._released:
            return
        self._released = True
        assert self._gdb.stdin is not None
        try:
            self._gdb.stdin.write(b"detach\nquit\n")
            self._gdb.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self._gdb.wait(60)
        except subprocess.TimeoutExpired:
            self._gdb.kill()  # a killed gdb detaches too (the kernel ends its ptrace)
            self._gdb.wait(30)

    def close(self) -> None:
        self.release()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> AutoIncrementStall:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
