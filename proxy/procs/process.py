"""An engine command as a process: the one lifecycle every user of engine processes shares (the embedded
default's ``LlamaServer``, the bench's ``--launch``, ``tune``, the test fixtures' ``ProcessServer``).

``EngineProcess`` starts a command in a session of its own (its own process group: a Ctrl-C in the terminal
reaches enginemeter, never the engine, and ``stop`` reaches every process the engine started), appends its
stdout and stderr to a log file after a ``+ COMMAND`` header line, waits until a readiness check passes, and stops
the group: SIGTERM, SIGKILL after a grace period, then waits until no process of the group is left.

Errors (``LaunchError`` and below) carry the last lines of the log::

    LaunchError              the engine did not become ready
    ├── EngineExited         it exited first (noticed at once: the poll interval is spent waiting on the process)
    └── ReadyTimeout         the check did not pass before the deadline (the process is still running: stop it)

Invariants:
- Nothing waits by sleeping: the wait between readiness checks is a wait on the process's exit, so a death ends
  the wait at once; the async wait runs that blocking wait in a thread, never on the event loop.
- ``stop`` is idempotent and leaves no process of the group behind (zombies aside: they hold nothing). Whatever
  ends a wait — an error, KeyboardInterrupt, a cancelled task — the callers here stop the process before it
  propagates, and an ``atexit`` hook kills the group of any engine still running when the interpreter exits.
- A process group is the engine's identity for cleanup: ``group_members(pgid)`` (``/proc``) tells what is left.
- No engine outlives this process, however it ends (``proxy.procs.leftovers``): each is started with a
  parent-death signal and recorded while it runs; each start first ends what a killed run left behind.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from proxy.procs import leftovers
from proxy.procs.members import group_members
from proxy.redact import private_file, redact_command

#: how much of the log an error message carries
TAIL_LINES = 40


class LaunchError(Exception):
    """An engine did not become ready; the message names it, says why and carries its log's last lines."""

    def __init__(self, message: str, *, log_tail: str = "", returncode: int | None = None) -> None:
        super().__init__(message + (f":\n{log_tail}" if log_tail else ""))
        self.log_tail = log_tail
        self.returncode = returncode


class EngineExited(LaunchError):
    """The engine's process exited before it was ready."""


class ReadyTimeout(LaunchError):
    """The readiness check did not pass before the deadline."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just handed out (free now; a later bind can still lose a race, so callers retry)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    """HTTP status of GET ``url``; ``None`` when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            status: int = r.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


class EngineProcess:
    """One command run as an engine: spawned in its own session, output appended to ``log_path``.

    ``argv`` is run as given (no shell); ``command`` is what the log header and error messages show (default:
    ``argv`` joined as a shell would quote it; the launcher passes the user's verbatim command).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        log_path: Path,
        name: str | None = None,
        command: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
    ) -> None:
        if not argv:
            raise ValueError("an engine command needs a program")
        self.argv = list(argv)
        self.command = command if command is not None else shlex.join(self.argv)
        self.name = name or Path(self.argv[0]).name
        self.log_path = Path(log_path)
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.t_spawn: float | None = None  # time.monotonic() at spawn
        self.ready_s: float | None = None  # seconds from spawn to the first passing readiness check
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._owner = os.getpid()
        self._record: Path | None = None  # proxy.procs.leftovers: this engine's record while it runs

    # ---- what callers read ----------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise LaunchError(f"{self.name}: not started")
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def started(self) -> bool:
        return self._proc is not None

    def log_tail(self, n_lines: int = TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-n_lines:])

    def members(self) -> list[int]:
        """Live processes left in the engine's process group (its pgid is its pid: it leads a new session)."""
        return [] if self._proc is None else group_members(self._proc.pid)

    def __repr__(self) -> str:
        return f"EngineProcess({self.name!r}, pid={self._proc and self._proc.pid}, log={str(self.log_path)!r})"

    # ---- start ----------------------------------------------------------------------------------------

    def spawn(self) -> None:
        """Start the command, after ending what a killed run left (``proxy.procs.leftovers.sweep``); the engine
        dies with this process (parent-death signal, record). A Ctrl-C that arrives while the child is being
        forked is held until this object knows the child's pid, then raised: the caller's cleanup can always reach
        the child. The log is 0600 and its header shows the command with its secrets masked."""
        if self._proc is not None:
            raise LaunchError(f"{self.name}: already started")
        leftovers.sweep()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = private_file(self.log_path).open("ab")  # owned by this object, closed in stop()
        self._log = log
        log.write(f"\n+ {redact_command(self.command)}\n".encode())
        log.flush()
        held: list[int] = []
        previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
        if previous is not None:  # a Python-level handler that can be put back (a handler resets to default at exec)
            signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
        try:
            self._proc = leftovers.on_long_lived_thread(lambda: self._popen(log))
            self.t_spawn = time.monotonic()
            _LIVE.add(self)
            self._record = leftovers.record(self._proc.pid, self.name)
        except OSError as exc:
            self._close_log()
            raise EngineExited(f"{self.name}: cannot run {self.argv[0]!r}: {exc}") from exc
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        if held:
            os.kill(os.getpid(), signal.SIGINT)  # the held Ctrl-C, delivered to the handler it was meant for

    def _popen(self, log: IO[bytes]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own session and process group: stop() signals the group
            env={**os.environ, **self.env} if self.env is not None else None,
            cwd=self.cwd,
            preexec_fn=leftovers.die_with_starter(),  # only prctl runs in the child
        )

    # ---- wait until ready -----------------------------------------------------------------------------

    def wait_ready(self, ready: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> float:
        """Call ``ready`` until it is true; the seconds from spawn to ready. Raises ``EngineExited`` or
        ``ReadyTimeout`` (the process is left running: the caller stops it)."""
        deadline = self._deadline(timeout_s)
        while True:
            if ready():
                return self._mark_ready()
            self._raise_if_done(deadline, timeout_s)
            self._wait_exit(min(interval_s, max(0.0, deadline - time.monotonic())))

    async def wait_ready_async(
        self, ready: Callable[[], Awaitable[bool]], timeout_s: float, interval_s: float = 0.1
    ) -> float:
        """``wait_ready`` for an event loop: ``ready`` is awaited; the wait between checks runs in a thread."""
        deadline = self._deadline(timeout_s)
        while True:
            if await ready():
                return self._mark_ready()
            self._raise_if_done(deadline, timeout_s)
            await asyncio.to_thread(self._wait_exit, min(interval_s, max(0.0, deadline - time.monotonic())))

    def _deadline(self, timeout_s: float) -> float:
        if self._proc is None or self.t_spawn is None:
            raise LaunchError(f"{self.name}: not started")
        return time.monotonic() + timeout_s

    def _mark_ready(self) -> float:
        assert self.t_spawn is not None
        self.ready_s = time.monotonic() - self.t_spawn
        return self.ready_s

    def _raise_if_done(self, deadline: float, timeout_s: float) -> None:
        assert self._proc is not None
        rc = self._proc.poll()
        if rc is not None:
            raise EngineExited(
                f"{self.name}: exited with {rc} before it was ready; log {self.log_path}",
                log_tail=self.log_tail(),
                returncode=rc,
            )
        if time.monotonic() >= deadline:
            raise ReadyTimeout(
                f"{self.name}: not ready within {timeout_s:g} s; log {self.log_path}", log_tail=self.log_tail()
            )

    def _wait_exit(self, timeout_s: float) -> None:
        assert self._proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=timeout_s)

    # ---- stop -----------------------------------------------------------------------------------------

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``, wait until none of it is left; the exit
        code of the engine's own process (None: never started). Idempotent; blocks up to about ``grace_s``."""
        proc = self._proc
        if proc is None:
            return None
        pgid = proc.pid
        if proc.poll() is None or group_members(pgid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            # the leader first (reaped here), then whatever it started: SGLang's and vLLM's workers hold the GPU
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
            while proc.poll() is not None and group_members(pgid) and time.monotonic() < deadline:
                time.sleep(0.05)  # a poll interval: the rest of the group is shutting down
            if proc.poll() is None or group_members(pgid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
                proc.wait()
                kill_deadline = time.monotonic() + 5.0
                while group_members(pgid) and time.monotonic() < kill_deadline:
                    time.sleep(0.02)  # SIGKILL is delivered; the kernel tears the processes down
        _LIVE.discard(self)
        leftovers.forget(self._record)
        self._close_log()
        return proc.returncode

    async def stop_async(self, grace_s: float = 10.0) -> int | None:
        """``stop`` in a thread; shielded, so a second cancellation cannot leave the engine half stopped (the
        thread runs to the end whatever happens to the awaiting task)."""
        return await asyncio.shield(asyncio.to_thread(self.stop, grace_s))

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def _kill_now(self) -> None:
        if self._proc is not None and self._owner == os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            leftovers.forget(self._record)


#: engines started by this interpreter and not stopped yet (held here until ``stop``, so one whose owner dropped
#: it is still killed at exit)
_LIVE: set[EngineProcess] = set()


@atexit.register
def _kill_leftovers() -> None:
    for p in list(_LIVE):
        p._kill_now()
