"""The history drafter's index: where every short n-gram of a set of token sequences
occurred, so that what followed a row's latest tokens elsewhere can be looked up in
constant time per suffix length (`drafters.history`)."""

from __future__ import annotations

from bisect import insort


class SuffixIndex:
    """Where each n-gram (n <= n_max) of a set of token sequences occurred, and so what
    followed it: hash of the n-gram → sequence id << 32 | index of the next token (a list
    of them, in insertion order, once there are several). Hashed keys and packed ints keep
    a remembered token near 1.3 kB in both indexes together (measured; a hash collision
    only proposes a wrong candidate: verification makes that cost speed, never exactness).

    Sequences grow token by token (`extend`); removed ones (`drop`) are skipped at once
    and purged when they outnumber the live entries. Each key's entries are kept sorted
    (newest sequence last), whatever order rows grew in: what `find` returns depends only
    on which sequences are indexed, so a history rebuilt from its sequences (a resumed
    run's) drafts exactly as the one it was saved from."""

    def __init__(self, n_max: int) -> None:
        self.n_max = n_max
        self.seqs: dict[int, list[int]] = {}
        self.starts: dict[int, int] = {}  # sid -> first index of its n-gram ends
        self.grams: dict[int, int | list[int]] = {}
        self.live_tokens = self.dead_tokens = 0

    def extend(self, sid: int, tokens: list[int], start: int = 0) -> None:
        """Sequence `sid` is now `tokens`; index its n-grams ending at start.. (the new
        ones: `start` = its previous length; 0 indexes it all)."""
        self.seqs[sid] = tokens
        self.starts.setdefault(sid, max(start, 0))
        grams, n_max, base = self.grams, self.n_max, sid << 32
        for t in range(max(start, 0), len(tokens)):
            entry = base | (t + 1)
            ending = tuple(tokens[max(t - n_max + 1, 0) : t + 1])  # the n-grams' suffixes:
            m = len(ending)  # one list slice per token, not one per n-gram (~25 % faster)
            for n in range(1, m + 1):
                key = hash(ending[m - n :])
                found = grams.get(key)
                if found is None:  # most n-grams occur once: a bare int, not a list
                    grams[key] = entry
                elif type(found) is int:
                    grams[key] = [found, entry] if found < entry else [entry, found]
                elif found[-1] < entry:
                    found.append(entry)
                else:  # a row that grew after a newer sibling (rare: not the hot path)
                    insort(found, entry)
        self.live_tokens += max(len(tokens) - max(start, 0), 0)

    def drop(self, sid: int) -> None:
        seq = self.seqs.pop(sid, None)
        if seq is None:
            return
        del self.starts[sid]
        self.live_tokens -= len(seq)
        self.dead_tokens += len(seq)
        if self.dead_tokens > max(self.live_tokens, 4096):
            self._rebuild()

    def _rebuild(self) -> None:
        seqs, starts = self.seqs, self.starts
        self.seqs, self.starts, self.grams = {}, {}, {}
        self.live_tokens = self.dead_tokens = 0
        for sid, tokens in seqs.items():
            self.extend(sid, tokens, starts[sid])

    def find(
        self, suffix: tuple[int, ...], limit: int, skip: set[int] = frozenset()
    ) -> list[tuple[int, list[int], int]]:
        """The latest `limit` occurrences of `suffix` with a known next token (newest
        sequence first, then latest position), as (sequence id, sequence, index of that
        token), skipping the sequences in `skip`."""
        out = []
        entries = self.grams.get(hash(suffix))
        if entries is None:
            return out
        for entry in reversed(entries) if type(entries) is list else (entries,):
            sid, nxt = entry >> 32, entry & 0xFFFFFFFF
            seq = self.seqs.get(sid)
            if seq is None or nxt >= len(seq) or sid in skip:
                continue
            out.append((sid, seq, nxt))
            if len(out) == limit:
                break
        return out
