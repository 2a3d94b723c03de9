"""The process reward functions run in, and the trainer's handle on it.

Reward functions read the policy's text, and the user's are user code: an exception, an
endless loop, a crash, a stray `print`, a thread left running or a runaway allocation must
not take the trainer with it, nor stall it. Every function of `reward.functions`, the
built-ins too, runs in one persistent child process (`python -m
specroll.tasks.reward_worker`, which imports only the light `specroll.tasks`), fed JSON
lines on its stdin and answering on a private copy of its stdout (the user's prints go to
stderr). Each call has `timeout_s`: a function that does not answer in time gets its
process killed (the next call starts a fresh one) and the step fails, naming the function
and the record. While the trainer waits it asks its `stop` callback every POLL_S, so a
stop request (Ctrl-C, SIGTERM) ends the wait in well under a second.

The child never outlives the trainer: it exits when its stdin closes (whatever threads
the user's module left running), when its parent dies (PR_SET_PDEATHSIG on Linux, and a
watchdog thread everywhere), and the trainer kills it when the handle is closed, garbage
collected or the interpreter exits. Its address space is bounded (MEMORY_LIMIT_GB).
Nothing here knows about training: the caller turns a `CallError` into its message.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import specroll
from specroll.tasks import reward_refs

MAX_TIMEOUT_S = 3600.0
"""The largest `reward.timeout_s`: an hour for one completion is no bound at all."""
IMPORT_MIN_S = 30.0
"""Each reward module may take reward.timeout_s to import, and at least this (its own
imports, torch for one, can take seconds on a cold disk)."""
POLL_S = 0.2
"""How often the trainer, waiting on the worker, asks whether to stop."""
CLOSE_GRACE_S = 1.0
"""How long a closed worker has to exit on its own before it is killed."""
PARENT_POLL_S = 0.5
"""How often the worker's watchdog checks that the trainer is alive."""
MEMORY_LIMIT_GB = 8
"""The worker's address space, in GiB (RLIMIT_AS): a reward function that allocates
more gets a MemoryError, reported as its failure, instead of exhausting the machine."""
_PR_SET_PDEATHSIG = 1


@dataclass
class CallError(Exception):
    """A call that did not return a valid reward: which call, what happened, the
    user's traceback (empty when there is none, as for a timeout)."""

    index: int
    """The call's position in the batch (-1: loading the functions)."""
    summary: str
    details: str = ""

    def __str__(self) -> str:
        return self.summary


class RewardWorker:
    """The child process that runs reward functions `refs`, started on first use."""

    def __init__(self, refs: list[reward_refs.Ref], timeout_s: float) -> None:
        self.refs, self.timeout_s = refs, min(float(timeout_s), MAX_TIMEOUT_S)
        self.proc: subprocess.Popen | None = None
        self._loaded = False
        self._buf = b""
        self._finalizer: weakref.finalize | None = None

    def start(self, wait: bool = True) -> None:
        """Start the process and have it import the functions; with `wait`, until they
        are imported (CallError(-1) if one fails), else the first call waits."""
        if self.proc is None:
            env = dict(os.environ)
            root = str(Path(specroll.__file__).resolve().parent.parent)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
            # PR_SET_PDEATHSIG fires when the thread that started the child ends: only
            # the main thread lives as long as the process
            main = threading.current_thread() is threading.main_thread()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "specroll.tasks.reward_worker", "1" if main else "0"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
            )
            self._finalizer = weakref.finalize(self, _kill, self.proc, os.getpid())
            self._buf, self._loaded = b"", False
            self._send({"op": "load", "refs": [r.text for r in self.refs]}, -1)
        if wait and not self._loaded:
            self._await_load()

    def call(
        self,
        samples: list[tuple[str, str, dict]],
        calls: list[tuple[int, int]],
        stop: Callable[[], None] | None = None,
    ) -> list[float | dict[str, float]]:
        """Values of `calls` (function index, sample index), in order. `stop` is called
        while waiting: what it raises abandons the batch (the process is killed)."""
        if not calls:
            return []
        try:
            self.start(wait=False)
            if not self._loaded:
                self._await_load(stop)
            self._send({"op": "call", "samples": samples, "calls": calls}, 0)
            out = []
            for i in range(len(calls)):
                what = f"did not return within reward.timeout_s={self.timeout_s} s (stopped)"
                reply = self._read(self.timeout_s, i, what, stop)
                if "error" in reply:
                    raise CallError(i, reply["error"], reply.get("traceback", ""))
                out.append(reply["value"])
            return out
        except CallError:
            raise
        except BaseException:  # a stop request, a second signal: the batch is abandoned
            self.kill()
            raise

    def close(self) -> None:
        """Stop the process: its stdin closed, it exits; killed if it is still running
        after CLOSE_GRACE_S (stuck in user code)."""
        proc = self._detach()
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            try:
                proc.wait(CLOSE_GRACE_S)
            except subprocess.TimeoutExpired:
                _kill(proc)
            proc.stdout.close()

    def kill(self) -> None:
        """Stop the process at once (a timeout, a stop request, a broken protocol)."""
        proc = self._detach()
        if proc is not None:
            _kill(proc)
            for f in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError):
                    f.close()

    def _detach(self) -> subprocess.Popen | None:
        proc, self.proc = self.proc, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        return proc

    def _await_load(self, stop: Callable[[], None] | None = None) -> None:
        """Wait for the imports, each within max(reward.timeout_s, IMPORT_MIN_S); the
        worker says which function it imports before each."""
        bound = max(self.timeout_s, IMPORT_MIN_S)
        current = 0
        while True:
            ref = self.refs[current].text
            what = (
                f"importing {ref!r} did not finish within {bound:g} s (reward.timeout_s, at "
                f"least {IMPORT_MIN_S:g} s for an import): a reward module must not wait or "
                f"loop when it is imported"
            )
            reply = self._read(bound, -1, what, stop)
            if "loading" in reply:
                current = reply["loading"]
                continue
            if "error" in reply:
                self.kill()
                raise CallError(-1, reply["error"], reply.get("traceback", ""))
            self._loaded = True
            return

    def _send(self, msg: dict, index: int) -> None:
        try:
            self.proc.stdin.write((json.dumps(msg, default=str) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            code = self.proc.wait()
            self.kill()
            raise CallError(index, f"the reward worker process had exited (code {code})") from None

    def _read(
        self, timeout_s: float, index: int, timed_out: str, stop: Callable[[], None] | None
    ) -> dict:
        """The next reply line; on a timeout or the process's death, CallError (and the
        process is gone). `stop` is called every POLL_S while waiting."""
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise CallError(index, timed_out)
            ready, _, _ = select.select([fd], [], [], min(left, POLL_S) if stop else left)
            if stop is not None:
                stop()
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                code = self.proc.wait()
                self.kill()
                raise CallError(index, f"the reward worker process died (exit code {code})")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)


def _kill(proc: subprocess.Popen, owner: int | None = None) -> None:
    """Kill and reap a worker (also what garbage collection and interpreter exit do; not
    in a forked copy of the trainer, whose exit must leave the trainer's worker alone)."""
    if owner is not None and os.getpid() != owner:
        return
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            proc.kill()
        proc.wait()


# ---------------------------------------------------------------------- the child


def _user_traceback(e: BaseException) -> str:
    """The traceback from the user's frames on (the worker's own call frame dropped)."""
    tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
    return "".join(traceback.format_exception(type(e), e, tb))


def _out_of_memory() -> str:
    return f"raised MemoryError: more than the reward worker's {MEMORY_LIMIT_GB} GiB"


def _load(texts: list[str], reply: Callable[[dict], None]) -> list:
    """The functions, each announced before it is imported; [] after an error reply
    naming the one that failed."""
    fns: list = []
    for i, text in enumerate(texts):
        reply({"loading": i})
        try:
            fns.append(reward_refs.load(reward_refs.parse(text), i))
        except MemoryError:
            reply({"error": f"cannot load {text!r}: {_out_of_memory()}"})
            return []
        except BaseException as e:  # the module's own SystemExit too
            reply(
                {
                    "error": f"cannot load {text!r}: {type(e).__name__}: {e}",
                    "traceback": _user_traceback(e),
                }
            )
            return []
    reply({"ok": True})
    return fns


def _run(fn, prompt: str, completion: str, record: dict) -> dict:
    """One call's reply: its checked value, or what went wrong (with the traceback)."""
    try:
        raw = fn(prompt, completion, record)
    except MemoryError:
        return {"error": _out_of_memory()}
    except BaseException as e:  # the user's SystemExit too: a failed call
        return {"error": f"raised {type(e).__name__}: {e}", "traceback": _user_traceback(e)}
    try:
        return {"value": reward_refs.check_value(raw)}
    except Exception as e:
        return {"error": str(e)}


def _serve(channel) -> None:
    """Answer load and call requests from stdin until it closes; a batch of calls stops at
    its first error."""
    fns: list = []

    def reply(msg: dict) -> None:
        channel.write(json.dumps(msg) + "\n")
        channel.flush()

    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "load":
            fns = _load(msg["refs"], reply)
            continue
        samples = msg["samples"]
        for f, i in msg["calls"]:
            answer = _run(fns[f], *samples[i])
            reply(answer)
            if "error" in answer:
                break


def _bind_to_parent(pdeathsig: bool) -> None:
    """Exit when the trainer dies: at once by the kernel (Linux, child of the main
    thread), else within PARENT_POLL_S by a watchdog thread (the main thread may be stuck
    in user code)."""
    parent = os.getppid()
    if pdeathsig and sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _limit_memory() -> None:
    """At most MEMORY_LIMIT_GB of address space (or the hard limit already set)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = MEMORY_LIMIT_GB << 30
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, ValueError, OSError):  # not POSIX, or not allowed: no bound
        pass


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    _bind_to_parent(sys.argv[1:] == ["1"])
    _limit_memory()
    channel = os.fdopen(os.dup(1), "w")  # the protocol's own copy of stdout
    os.dup2(2, 1)  # anything the user's code prints goes to stderr
    sys.stdout = sys.stderr
    sys.path.insert(0, os.getcwd())  # 'package.module:fn' as `python -m` would find it
    code = 0
    try:
        _serve(channel)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        # threads the user's modules started must not keep the process alive
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
