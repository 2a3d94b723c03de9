"""The process user reward functions run in, and the trainer's handle on it.

Reward functions are user code: an exception, an endless loop, a crash or a stray
`print` must not take the trainer with it. They run in one persistent child process
(`python -m specroll.tasks.reward_worker`, which imports only the light `specroll.tasks`),
fed JSON lines on its stdin and answering on a private copy of its stdout (the user's
prints go to stderr). Each call has `timeout_s`: a function that does not answer in time
gets its process killed (the next call starts a fresh one) and the step fails, naming
the function and the record. Nothing here knows about training: the caller turns a
`CallError` into its message.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import specroll
from specroll.tasks import reward_refs

LOAD_TIMEOUT_S = 120.0
"""How long the worker may take to start and import the user's modules."""


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
    """The child process that runs user reward functions `refs`, started on first use."""

    def __init__(self, refs: list[reward_refs.Ref], timeout_s: float) -> None:
        self.refs, self.timeout_s = refs, timeout_s
        self.proc: subprocess.Popen | None = None
        self._buf = b""

    def start(self) -> None:
        """Start the process and import the functions; CallError(-1) if one fails."""
        if self.proc is not None:
            return
        env = dict(os.environ)
        root = str(Path(specroll.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specroll.tasks.reward_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._buf = b""
        self._send({"op": "load", "refs": [r.text for r in self.refs]})
        reply = self._read(LOAD_TIMEOUT_S, -1, "loading the reward functions")
        if "error" in reply:
            self.close()
            raise CallError(-1, reply["error"], reply.get("traceback", ""))

    def call(self, calls: list[tuple[int, str, str, dict]]) -> list[float | dict[str, float]]:
        """Values of calls (function index, prompt, completion, record), in order."""
        if not calls:
            return []
        self.start()
        self._send({"op": "call", "calls": calls})
        out = []
        for i in range(len(calls)):
            reply = self._read(self.timeout_s, i, f"within reward.timeout_s={self.timeout_s}")
            if "error" in reply:
                raise CallError(i, reply["error"], reply.get("traceback", ""))
            out.append(reply["value"])
        return out

    def close(self) -> None:
        """Stop the process (killed: it may be stuck in user code)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                f.close()
            self.proc = None

    def _send(self, msg: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(msg, default=str) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            code = self.proc.wait()
            self.close()
            raise CallError(0, f"the reward worker process had exited (code {code})") from None

    def _read(self, timeout_s: float, index: int, doing: str) -> dict:
        """The next reply line; on a timeout or the process's death, CallError (and the
        process is gone)."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            ready, _, _ = select.select([fd], [], [], timeout_s)
            if not ready:
                self.close()
                raise CallError(index, f"did not return {doing} s (stopped)")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                code = self.proc.wait()
                self.close()
                raise CallError(index, f"the reward worker process died (exit code {code})")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)


# ---------------------------------------------------------------------- the child


def _user_traceback(e: BaseException) -> str:
    """The traceback from the user's frames on (the worker's own call frame dropped)."""
    tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
    return "".join(traceback.format_exception(type(e), e, tb))


def _load(texts: list[str]) -> tuple[list, dict]:
    """The user's functions, or ([], an error reply naming the one that failed)."""
    fns: list = []
    for i, text in enumerate(texts):
        try:
            fns.append(reward_refs.load(reward_refs.parse(text), i))
        except BaseException as e:  # the module's own SystemExit too
            return [], {
                "error": f"cannot load {text!r}: {type(e).__name__}: {e}",
                "traceback": _user_traceback(e),
            }
    return fns, {"ok": True}


def _run(fn, prompt: str, completion: str, record: dict) -> dict:
    """One call's reply: its checked value, or what went wrong (with the traceback)."""
    try:
        raw = fn(prompt, completion, record)
    except BaseException as e:  # the user's SystemExit too: a failed call
        return {"error": f"raised {type(e).__name__}: {e}", "traceback": _user_traceback(e)}
    try:
        return {"value": reward_refs.check_value(raw)}
    except (TypeError, ValueError) as e:
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
            fns, answer = _load(msg["refs"])
            reply(answer)
            continue
        for f, prompt, completion, record in msg["calls"]:
            answer = _run(fns[f], prompt, completion, record)
            reply(answer)
            if "error" in answer:
                break


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    channel = os.fdopen(os.dup(1), "w")  # the protocol's own copy of stdout
    os.dup2(2, 1)  # anything the user's code prints goes to stderr
    sys.stdout = sys.stderr
    sys.path.insert(0, os.getcwd())  # 'package.module:fn' as `python -m` would find it
    _serve(channel)


if __name__ == "__main__":
    main()
