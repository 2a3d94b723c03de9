"""The captured step: the device step of a decoding iteration, replayed as a CUDA graph.

On a GPU a decode iteration of a small or memory-bound model is bound by kernel launches:
a 30-layer forward, the verifier and the bookkeeping are a few hundred kernels of a few
microseconds each. A CUDA graph launches them all at once. What a graph needs is what
this module provides for the engine's one device function (`Stepper._run`): a key
(`engine.step.StepKey`) that fixes every shape and host value it uses, and inputs
(`StepInputs`) at fixed addresses per key for what changes per iteration.

* The batch is padded to a bucket (`BUCKETS`): rows past the live ones (`n_live`, a
  one-element buffer) draft nothing, emit nothing and move nothing.
* The key axis of attention is a key bucket (`key_bucket`: a power of two at least the
  deepest row's position + k + 1, at most the cache), masked per row as before; the
  host knows the positions (`HostRows.pos`), so sizing it reads nothing back, and a
  short context does not pay attention over the whole cache.
* Drafts, their q, their lengths and a tree's parents come in through buffers sized for
  the bucket and depth (a tree: its k nodes, however many its fullest row filled);
  positions, seeds, sampling settings and the tokens so far are the slots' tensors,
  which live at fixed addresses (the engine keeps its slots from call to call while
  they fit: `Engine._slots`).
* Sampling hints (`spec.sampling.Hints`) are part of the key: a graph holds the
  processors its rows need and no others.

Along a rollout the batch shrinks and the positions grow, so the (bucket, key bucket)
pairs a call visits are a path of at most a few dozen per depth. A key runs eagerly the
first time (a real iteration, which also warms the kernels), is captured the second time
(capture records without running) and replayed, and is replayed from then on. Graphs
live as long as the engine's slots and cache (an RL run's calls are alike: captured
once), share one memory pool, and are bounded in number (`MAX_GRAPHS`); capture time
and pool memory go to `SpecStats`.

What a graph holds: the target forward, the verification (a chain, or a tree of k nodes
walked masked) and the recording of every decoding iteration, and for the drafters that
propose on the device alone (`Drafter.in_step`) the proposal too: EAGLE-3 and MTP
(`FeatureDrafter.propose`: the pending pairs fed k + 1 wide, then the k draft forwards)
and the draft model (`DraftModelDrafter.propose`: two tokens fed, then its k forwards).
The n-gram drafter matches within the key bucket's width. A draft that lags further
(speculation was off) is fed eagerly first (`Drafter.prepare`). The history and combined
drafters build their trees on the host and propose before the step (their tensors go
in through the inputs); commits run after it. A drafter that makes its tensors anew
bumps its `epoch`, which is part of the key: no captured step is invalidated by hand.

`CAPTURE_ON` names the device types that take this path when `EngineConfig.cuda_graphs`
is on. The tests add the CPU to it: there capture records the step's ATen operations as
it runs and replay runs them again without the step's Python (`engine.replay`), as a CUDA
graph replays its kernels, so a host value frozen at capture fails a CPU test too.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Hashable

import torch

from specroll.engine.replay import record
from specroll.engine.step import StepInputs

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
"""Batch sizes a step is padded to (the last bucket that fits the cache's slots)."""
MIN_KEYS = 128
"""The shortest key axis of a step (`key_bucket`)."""
MAX_GRAPHS = 64
"""Most graphs held at once; keys past it run eagerly."""
CAPTURE_ON = ("cuda",)
"""Device types that run the captured step when graphs are on (tests add "cpu")."""


def key_bucket(need: int, max_len: int) -> int:
    """The key axis of a step whose rows need `need` key positions: the smallest power of
    two from `MIN_KEYS` that holds them, within the cache's `max_len`."""
    keys = MIN_KEYS
    while keys < need:
        keys *= 2
    return min(keys, max_len)


def bucket(B: int, slots: int) -> int:
    """The smallest bucket that holds B rows, within the cache's `slots`."""
    for b in BUCKETS:
        if b >= B:
            return min(b, slots)
    return slots


class Graphs:
    """The step's graphs over one set of slots and one cache, by key (module docstring)."""

    def __init__(self, device: torch.device, slots: object, cache: object, weights: object) -> None:
        self.device = device
        self._held = (slots, cache, weights)  # what every capture holds the tensors of
        self.cuda = device.type == "cuda"
        self.inputs: dict[Hashable, StepInputs] = {}
        self._runs: dict[Hashable, Callable[[], tuple]] = {}  # captured: replay → outputs
        self._seen: set[Hashable] = set()
        self._pool = None
        self.capture_s = 0.0
        """Seconds spent capturing."""
        self.pool_bytes = 0
        """Device memory the captures took (the shared pool's growth)."""
        self.failed: dict[Hashable, str] = {}
        """Keys whose capture failed (they run eagerly), with the error."""

    def __len__(self) -> int:
        return len(self._runs)

    def holds(self, slots: object, cache: object, weights: object) -> bool:
        """Whether these graphs were captured over `slots` and `cache` (the very objects:
        new ones are new tensors, which no capture reads) and `weights` (a version)."""
        s, c, w = self._held
        return s is slots and c is cache and w == weights

    def buffers(self, key: Hashable, make: Callable[[], StepInputs]) -> StepInputs:
        """The step inputs of `key` (made the first time): fixed addresses per key."""
        if key not in self.inputs:
            self.inputs[key] = make()
        return self.inputs[key]

    def run(self, key: Hashable, step: Callable[[], tuple]) -> tuple:
        """step() for `key`: eagerly the first time, then captured and replayed. A key
        whose capture fails stays eager (`failed` says why; the first failure warns):
        capture records without running, so the step then runs as it would have."""
        replay = self._runs.get(key)
        if replay is not None:
            return replay()
        if key not in self._seen or key in self.failed or len(self._runs) >= MAX_GRAPHS:
            self._seen.add(key)
            return step()
        t = time.perf_counter()
        try:
            replay, out = self._capture(step)
        except Exception as e:  # any capture failure leaves the key eager
            self.failed[key] = f"{type(e).__name__}: {str(e).strip()[:300]}"
            if len(self.failed) == 1:
                warnings.warn(
                    f"CUDA graph capture failed; this step shape runs eagerly: {self.failed[key]}",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return step()
        finally:
            self.capture_s += time.perf_counter() - t
        self._runs[key] = replay
        return replay() if out is None else out

    def _capture(self, step: Callable[[], tuple]) -> tuple[Callable[[], tuple], tuple | None]:
        """(the replay of step, what capturing it returned: None where capture records
        without running)."""
        if not self.cuda:  # the stand-in: ATen operations recorded as they run
            rec = record(step)
            return rec, rec.outputs_tree()
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = step()  # recorded, not run: the replay below runs it
        self._pool = graph.pool()
        self.pool_bytes += torch.cuda.memory_reserved(self.device) - before

        def run() -> tuple:
            graph.replay()
            return out

        return run, None
