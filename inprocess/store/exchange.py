"""The exchange of ranks' states and grouping keys through the store, which the newer
generation's rank assignments use."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ..exception import StoreError

#: the fields of a state that :meth:`ExchangeMixin.send_state` sends (with ``mode``)
_STATE_FIELDS = (
    "rank",
    "world_size",
    "active_world_size",
    "initial_rank",
    "initial_world_size",
    "iteration",
    "active_rank",
)


class ExchangeMixin:
    """Publishes and gathers per-rank states and keys: a part of
    :class:`~inprocess.store.StoreMixin` (it writes and reads through
    :class:`~inprocess.store.records.RecordsMixin`)."""

    def send_state(self, state: Any, rank: int) -> None:
        """Publishes rank ``rank``'s state for :meth:`get_states`: its plain fields (rank,
        world sizes, initial rank, iteration, mode, active rank), not the store or the
        exception. The exchange the newer generation's rank assignments use."""
        fields = {name: getattr(state, name) for name in _STATE_FIELDS}
        fields["mode"] = state.mode.value
        self.put(f"inprocess/exchange/state/{rank}", json.dumps(fields))

    def get_states(self, ranks: Iterable[int]) -> list[Any]:
        """The states that ``ranks`` sent (:meth:`send_state`), in that order, as
        :class:`inprocess.state.State`; waits for them at most the store's timeout."""
        from ..state import Mode, State

        states = []
        for text in self._gathered("state", ranks):
            fields = json.loads(text)
            fields["mode"] = Mode(fields["mode"])
            states.append(State(**fields))
        return states

    def send_key(self, key: Any, rank: int) -> None:
        """Publishes rank ``rank``'s grouping key (JSON: a string, a number, a list of
        them; anything else as its ``str``) for :meth:`get_keys`."""
        self.put(f"inprocess/exchange/key/{rank}", json.dumps(key, default=str))

    def get_keys(self, ranks: Iterable[int]) -> list[Any]:
        """The keys that ``ranks`` sent (:meth:`send_key`), in that order; waits for them
        at most the store's timeout."""
        return [json.loads(text) for text in self._gathered("key", ranks)]

    def _gathered(self, kind: str, ranks: Iterable[int]) -> list[str]:
        keys = [f"inprocess/exchange/{kind}/{rank}" for rank in ranks]
        if not keys:
            return []
        values = []
        # multi_get waits until every key exists (at most the store's timeout).
        for key, raw in zip(keys, self.multi_get(keys), strict=True):
            found = self.decode_entries(key, raw)
            if not found:
                raise StoreError(f"{key!r} holds no authentic record")
            values.append(found[0])
        return values
