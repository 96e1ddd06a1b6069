"""Sealed records and once-keys on a store: the primitives of the store's protocol.

Every value the protocol acts on is a sealed record (:func:`inprocess.security.seal`,
under the job's secret and the key's full name); :class:`RecordsMixin` writes them
and reads the authentic ones only.
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import protocol as P
from ..security import open_records, reject, seal
from .helpers import key_path

#: the expectation of :meth:`RecordsMixin.get_or`'s compare-and-set: no value of ours
#: (a sealed record starts with a newline) and no counter is ever this text; one
#: byte, as it travels twice with every read
_ABSENT = "\x00"


class RecordsMixin:
    """Reads and writes of sealed records, once-keys and counters: a part of
    :class:`~inprocess.store.StoreMixin` (on a ``torch.distributed.Store``, whose
    ``set``, ``get``, ``add``, ``compare_set`` and ``append`` it uses)."""

    # ------------------------------------------------------------------ primitives

    def get_or(self, key: str, default: str = "") -> str:
        """Raw value of ``key``, or ``default`` when absent, without blocking.

        One round trip: a compare-and-set that expects a value nobody writes
        (:data:`_ABSENT`) changes nothing and answers with the value there, or
        with the expectation itself when the key is absent (every torch store
        does so). ``check`` then ``get`` would take two.
        """
        value = self.compare_set(key, _ABSENT, _ABSENT)
        text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
        return default if text == _ABSENT else text

    # ------------------------------------------------------------------ sealed records

    def full_key(self, key: str) -> str:
        """The full name of ``key`` in the store (what its records are sealed with).

        Not ``path``: torch's ``FileStore`` has a ``path`` property (its file),
        which would hide the method there."""
        return key_path(self, key)

    def put(self, key: str, value: str) -> None:
        """Sets ``key`` to one sealed record of ``value``."""
        self.set(key, seal(self.full_key(key), value))

    def add_entry(self, key: str, value: str) -> None:
        """Appends one sealed record of ``value`` to the list at ``key``."""
        self.append(key, seal(self.full_key(key), value))

    def add_entries(self, key: str, values: Sequence[str]) -> None:
        """Appends sealed records of ``values`` to the list at ``key``, in one operation."""
        name = self.full_key(key)
        self.append(key, "".join(seal(name, value) for value in values))

    def decode_entries(self, key: str, raw: bytes | str | None) -> list[str]:
        """The authentic records of a raw value read from ``key``."""
        return open_records(self.full_key(key), raw)

    def entries(self, key: str) -> list[str]:
        """The authentic records at ``key`` in order (repeats once); ``[]`` when absent."""
        return self.decode_entries(key, self.get_or(key))

    def read(self, key: str) -> str | None:
        """The first authentic record at ``key``, or ``None``."""
        found = self.entries(key)
        return found[0] if found else None

    def identities(self, key: str) -> list[str]:
        """The well-formed identities listed at ``key``, in order, each once."""
        found = []
        for entry in self.entries(key):
            if P.valid_identity(entry):
                found.append(entry)
            else:
                reject(self.full_key(key), "a malformed identity")
        return found

    def set_once(self, key: str, value: str) -> tuple[bool, str]:
        """Makes non-empty ``value`` the value of once-key ``key`` unless one stands.

        Returns ``(won, current)``: whether this call's value stands, and the
        value that does. ``value`` must be unique to the caller for ``won`` to be
        exact. The first authentic record appended wins: appends are ordered by
        the store, so every reader agrees on it, and a stranger's record never
        counts.
        """
        if not value:
            raise ValueError("set_once needs a non-empty value")
        record = seal(self.full_key(key), value)
        # One round trip when the key is new (the common case): the record is
        # then its first. Else the first authentic record there stands; only
        # if there is none (a stranger wrote the key first) is ours appended.
        current = P.first_or_none(self.decode_entries(key, self.compare_set(key, "", record)))
        if current is None:
            self.append(key, record)
            current = P.first_or_none(self.decode_entries(key, self.get(key))) or ""
        return current == value, current

    def counter(self, key: str) -> int:
        return int(self.add(key, 0))

    # ------------------------------------------------------------------ identity=value lists

    def all_arrived(self, key: str, members: Sequence[str]) -> dict[str, str] | None:
        """The authentic arrivals (``identity=value`` records) at list ``key`` once every one of
        ``members`` has one; ``None`` before. Used where a counter only wakes the reader."""
        arrivals = self.by_identity(key)
        return arrivals if all(m in arrivals for m in members) else None

    def by_identity(self, key: str, raw: bytes | str | None = None) -> dict[str, str]:
        """The authentic ``identity=value`` records at ``key`` (or in ``raw`` read from it),
        the first value of each identity."""
        found: dict[str, str] = {}
        entries = self.entries(key) if raw is None else self.decode_entries(key, raw)
        for entry in entries:
            identity, _, value = entry.partition("=")
            if P.valid_name(identity):
                found.setdefault(identity, value)
            else:
                reject(self.full_key(key), "a malformed identity")
        return found

