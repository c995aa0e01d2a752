"""Master-Mirror storage of agents at rest, outside vLLM's pool (`store_gib`): the worker's
`SessionStore` (torch). The scheduler's index of it is `scheduler/store_index.py`.

vLLM 0.32 cannot map one block into two requests' tables at different positions, so an agent that
is running holds dense KV in the pool. Between its turns it need not: when an agent's request
finishes, its KV (prompt and output) is copied here in Master-Mirror form, and when its next
request finds its history gone from vLLM's prefix cache, the claim reads it back from here
instead of recomputing it.

One master copy of each shared piece, keyed by the piece (its tokens and namespace, wherever it
sits), made from the first agent saved that holds it; per agent (an entry, named by the request
that saved it), which piece sits at which of its positions, its own rows (what no piece covers:
private text, its output) and, per layer, the rows of its pieces that differ from the master
re-rotated to its positions (the tokens its mirror pass recomputed, the check layers, another
master's encoding). A restore re-rotates the master rows and overlays the diff rows: bit for bit
the KV the agent held, so a restore is exact (a piece the agent computed whole, rather than
copied, differs from its master in every row and is kept whole).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


class RestoreError(RuntimeError):
    """Reading an agent's KV back from the session store failed (the pass that read it fails, and
    vLLM computes its claims)."""


# keys [N, H, D] cached at positions src [N] -> as computed at positions dst [N]
Rotate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class MasterPiece:
    """A shared piece's K/V in every layer ([n, L, H, D] each: token-major, so one re-rotation
    moves all layers), computed at `positions` [n]."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    holders: int = 0
    round_serial: int = 0  # the round whose pass captured it (0: the first agent saved holding it)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


@dataclass
class StoredSession:
    """One agent's KV at positions [0, length): `refs` (piece key, start, length) read from masters;
    `own_positions` [m] with `own_keys`/`own_values` [m, L, H, D]; `diff_index` [d, 2] (position,
    layer) inside refs with `diff_keys`/`diff_values` [d, H, D] overriding the masters'."""

    length: int
    refs: list[tuple[bytes, int, int]]
    own_positions: torch.Tensor
    own_keys: torch.Tensor
    own_values: torch.Tensor
    diff_index: torch.Tensor
    diff_keys: torch.Tensor
    diff_values: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Its own bytes (the masters it reads are counted once, by the store)."""
        return self.own_keys.nbytes + self.own_values.nbytes + self.diff_keys.nbytes + self.diff_values.nbytes


class SessionStore:
    """Agents' KV at rest in the worker's memory; `rotate` moves keys between positions with the
    model's RoPE (any number of heads: all layers' heads at once)."""

    def __init__(self, num_layers: int, rotate: Rotate, min_piece_tokens: int = 4):
        self.num_layers = num_layers
        self.rotate = rotate
        self.min_piece_tokens = min_piece_tokens
        self.masters: dict[bytes, MasterPiece] = {}
        self.sessions: dict[str, StoredSession] = {}
        self.closed_rounds: set[int] = set()
        self.nbytes = 0  # masters' and sessions' bytes, kept as they come and go

    def _moved(self, master: MasterPiece, rows: slice, at: torch.Tensor) -> torch.Tensor:
        """The master's keys of `rows`, every layer, re-rotated to positions `at`."""
        return self._rotate(master.keys[rows], master.positions[rows], at)

    def capture(self, key: bytes, read: Callable[[int], tuple[torch.Tensor, torch.Tensor]], start: int, end: int,
                round_serial: int) -> None:
        """Keep the KV a master computed for a piece (`read(layer)`: its rows [start, end)) as the
        piece's master, as the mirrors of its round copy it: their saves then differ from it only
        where they recomputed (a master taken from a mirror would differ everywhere, by the
        rounding of a second re-rotation). Unread by any entry, it goes when its round closes."""
        if key in self.masters or round_serial in self.closed_rounds:  # (a pass that ended after its round)
            return
        layers = [read(index) for index in range(self.num_layers)]
        self.masters[key] = MasterPiece(torch.stack([k for k, _ in layers], dim=1), torch.stack([v for _, v in layers], dim=1),
                                        torch.arange(start, end), round_serial=round_serial)
        self.nbytes += self.masters[key].nbytes

    def close_round(self, round_serial: int) -> int:
        """The round's members are all saved (or never will be): its captured masters no entry
        reads go. The bytes freed."""
        self.closed_rounds.add(round_serial)
        unread = [key for key, m in self.masters.items() if m.round_serial == round_serial and m.holders == 0]
        freed = sum(self.masters.pop(key).nbytes for key in unread)
        self.nbytes -= freed
        return freed

    def save(self, entry: str, read: Callable[[int], tuple[torch.Tensor, torch.Tensor]], length: int,
             pieces: Sequence[tuple[bytes, int, int]]) -> int:
        """Store an agent's KV: `read(layer)` gives its rows [0, length) ([length, H, D] keys and
        values); `pieces` (key, start, end) are its prompt's pieces. Returns the bytes it added.

        Every (position, layer) row that differs from the master re-rotated to the agent's
        positions is kept, so the agent is read back bit for bit: a restore is exact, and the
        scheduler issues it as such. A piece copied from a master differs only in the rows the
        pass recomputed; one the agent computed whole (its first holder could not be pinned, its
        claim was refused) differs in every row and costs its full size."""
        before = self.nbytes
        self.drop(entry)
        layers = [read(index) for index in range(self.num_layers)]
        keys = torch.stack([k for k, _ in layers], dim=1)  # [length, L, H, D]
        values = torch.stack([v for _, v in layers], dim=1)
        del layers
        covered = torch.zeros(length, dtype=torch.bool)
        changed = torch.zeros(length, self.num_layers, dtype=torch.bool)  # (position, layer) unlike the master
        refs = []
        for key, start, end in pieces:
            end = min(end, length)
            if end - start < self.min_piece_tokens or covered[start:end].any():
                continue
            master = self.masters.get(key)
            if master is None:  # the first agent saved that holds this piece is its master
                master = self.masters[key] = MasterPiece(keys[start:end].clone(), values[start:end].clone(),
                                                         torch.arange(start, end))
                self.nbytes += master.nbytes
            elif len(master.positions) != end - start:  # a key collision would be a wrong block: never reuse it
                continue
            else:
                moved = self._moved(master, slice(None), torch.arange(start, end))
                changed[start:end] = ((moved != keys[start:end]).flatten(2).any(2)
                                      | (master.values != values[start:end]).flatten(2).any(2))
            master.holders += 1
            refs.append((key, start, end - start))
            covered[start:end] = True
        own = (~covered).nonzero().flatten()
        diff = changed.nonzero()  # [d, 2]: position, layer
        self.sessions[entry] = StoredSession(length, refs, own, keys[own], values[own], diff,
                                             keys[diff[:, 0], diff[:, 1]], values[diff[:, 0], diff[:, 1]])
        self.nbytes += self.sessions[entry].nbytes
        return self.nbytes - before

    def rows(self, entry: str, start: int, end: int, at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """An agent's keys and values at its positions [start, end), every layer ([n, L, H, D]
        each), as it held them; with `at` ([n] positions), its keys as computed there instead,
        each row rotated once from where it was computed (a master's row from the master's
        position): a piece that moved is then what a mirror copying the master holds, and saved
        again it differs from its master only where recomputed."""
        session = self.sessions[entry]
        if not 0 <= start <= end <= session.length:
            raise IndexError(f"rows [{start}, {end}) outside the stored {session.length}")
        here = torch.arange(start, end)
        at = here if at is None else at
        moved = not torch.equal(at, here)
        shape = session.own_keys.shape[1:]
        keys = session.own_keys.new_empty((end - start, *shape))
        values = session.own_values.new_empty((end - start, *shape))
        own = session.own_positions
        mine = (own >= start) & (own < end)
        if moved:
            keys[own[mine] - start] = self._rotate(session.own_keys[mine], own[mine], at[own[mine] - start])
        else:
            keys[own[mine] - start] = session.own_keys[mine]
        values[own[mine] - start] = session.own_values[mine]
        for key, piece, n in session.refs:
            lo, hi = max(piece, start), min(piece + n, end)
            if lo >= hi:
                continue
            master = self.masters[key]
            keys[lo - start:hi - start] = self._moved(master, slice(lo - piece, hi - piece), at[lo - start:hi - start])
            values[lo - start:hi - start] = master.values[lo - piece:hi - piece]
        position, layer = session.diff_index[:, 0], session.diff_index[:, 1]
        mine = (position >= start) & (position < end)
        diff_keys = session.diff_keys[mine]
        if moved:
            diff_keys = self._rotate(diff_keys[:, None], position[mine], at[position[mine] - start])[:, 0]
        keys[position[mine] - start, layer[mine]] = diff_keys
        values[position[mine] - start, layer[mine]] = session.diff_values[mine]
        return keys, values

    def _rotate(self, keys: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """Rows [n, L, H, D] held at positions `src`, as computed at `dst`."""
        if not len(keys):
            return keys
        n, layers, heads, dim = keys.shape
        return self.rotate(keys.reshape(n, layers * heads, dim), src, dst).view(n, layers, heads, dim)

    def drop(self, entry: str) -> int:
        """Forget an agent's entry (and every master no entry reads any more); the bytes freed."""
        session = self.sessions.pop(entry, None)
        if session is None:
            return 0
        freed = session.nbytes
        for key, _, _ in session.refs:
            master = self.masters[key]
            master.holders -= 1
            if master.holders == 0:
                freed += self.masters.pop(key).nbytes
        self.nbytes -= freed
        return freed
