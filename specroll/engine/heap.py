"""Keep Python's cyclic garbage collector off the long-lived heap while generating.

The collector runs whenever enough container objects have been made, and its full
passes traverse every tracked object in the process: the model's modules, the trainer,
and a history drafter's store (`drafters.history`), hundreds of thousands of objects in an
RL run. A drafter that keeps Python state per token (the history drafter's suffix
index) makes enough objects to set it off inside the decoding loop: measured at a
60-step run's checkpoint on 2 cores, ~80 collections per generate call, a full pass of
~190 ms every second call (~2 % of the call), where an EAGLE-3 engine triggers one.
Freezing the heap at the start of `Engine.generate` (`gc.freeze`: the objects alive then
move to a generation no pass traverses) leaves the passes inside the loop only what the
loop itself made; unfreezing at the end hands everything back, so cyclic garbage made
before the call is still collected later and nothing leaks. Reference counting, which
frees almost everything, is untouched.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0  # nested or concurrent generate calls: the last one out unfreezes
_froze = False  # whether the outermost call froze (and so may unfreeze) the heap


@contextmanager
def young_heap_only() -> Iterator[None]:
    """Inside the block, garbage collection passes see only objects made in it. A heap
    someone else froze (an application's own `gc.freeze()` at start-up, as vLLM does)
    or a disabled collector is left as it is: `gc.unfreeze` cannot tell their frozen
    objects from ours."""
    global _depth, _froze
    with _lock:
        _depth += 1
        if _depth == 1:
            _froze = gc.isenabled() and gc.get_freeze_count() == 0
            if _froze:
                gc.freeze()
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _froze:
                gc.unfreeze()
                _froze = False
