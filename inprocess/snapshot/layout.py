"""What a snapshot holds: a state dict split into a skeleton and its tensors.

``state`` maps names to objects with ``state_dict()``/``load_state_dict()``,
tensors, or plain picklable values. :func:`capture` walks it once: every tensor
(at any depth of dicts, lists and tuples) becomes a :class:`TensorRef`
placeholder in the *skeleton*, and is returned in a flat list, in order, key by
key (so each key's tensors are contiguous in a snapshot's buffer). The skeleton
is pickled per key: small, and comparable byte for byte.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """A tensor's place in the skeleton: its index in the flat list and its layout."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str


def entry_kind(value: Any) -> str:
    """How a state entry is captured and loaded: ``object``, ``tensor`` or ``value``."""
    if isinstance(value, torch.Tensor):
        return "tensor"
    if callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    ):
        return "object"
    return "value"


def check_state(state: Any, argument: str = "state") -> None:
    """A state must be a dict with str keys."""
    if not isinstance(state, Mapping):
        raise TypeError(
            f"{argument} must be a dict of name -> object with state_dict()/load_state_dict(), "
            f"tensor, or picklable value; got {type(state).__name__}"
        )
    bad = [k for k in state if not isinstance(k, str)]
    if bad:
        raise TypeError(f"{argument} must have str keys, got {bad!r}")


def capture(state: Mapping[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The skeleton of ``state`` (per key) and its tensors, in order."""
    check_state(state)
    tensors: list[torch.Tensor] = []
    skeleton: dict[str, Any] = {}
    for key, value in state.items():
        kind = entry_kind(value)
        if kind == "object":
            value = value.state_dict()
        skeleton[key] = (kind, _strip(value, tensors))
    return skeleton, tensors


def _strip(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor) and value.layout == torch.strided:
        t = value.detach()
        tensors.append(t)
        return TensorRef(len(tensors) - 1, tuple(t.shape), t.dtype, str(t.device))
    if isinstance(value, dict):
        # the dict's own type (OrderedDict of a module's state_dict) is kept
        out = _same_type_dict(value)
        for k, v in value.items():
            out[k] = _strip(v, tensors)
        return out
    if isinstance(value, list):
        return [_strip(v, tensors) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_strip(v, tensors) for v in value)
    return value


def _same_type_dict(value: dict[Any, Any]) -> dict[Any, Any]:
    try:
        out = type(value)()
    except Exception:
        return {}
    # a module's state_dict carries _metadata (versions used by load_state_dict)
    metadata = getattr(value, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata  # type: ignore[attr-defined]
    return out


def fill(skeleton_value: Any, tensors: list[torch.Tensor]) -> Any:
    """The skeleton with its placeholders replaced by ``tensors``."""
    if isinstance(skeleton_value, TensorRef):
        return tensors[skeleton_value.index]
    if isinstance(skeleton_value, dict):
        out = _same_type_dict(skeleton_value)
        for k, v in skeleton_value.items():
            out[k] = fill(v, tensors)
        return out
    if isinstance(skeleton_value, list):
        return [fill(v, tensors) for v in skeleton_value]
    if isinstance(skeleton_value, tuple) and not hasattr(skeleton_value, "_fields"):
        return tuple(fill(v, tensors) for v in skeleton_value)
    return skeleton_value


def refs(skeleton_value: Any) -> list[TensorRef]:
    """The placeholders of a skeleton, in order."""
    found: list[TensorRef] = []

    def walk(v: Any) -> None:
        if isinstance(v, TensorRef):
            found.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(skeleton_value)
    return found


def load(state: dict[str, Any], skeleton: dict[str, Any], tensors: list[torch.Tensor]) -> None:
    """Loads a snapshot into the live ``state``.

    Objects get ``load_state_dict``; tensors are copied into in place; a plain
    dict or list is updated in place; any other value replaces the entry of
    ``state`` (read it back from there). ``tensors`` must not be buffers the
    snapshot store reuses (an optimizer keeps what it is given).
    """
    missing = [k for k in skeleton if k not in state]
    extra = [k for k in state if k not in skeleton]
    if missing or extra:
        raise KeyError(
            f"the snapshot's keys {sorted(skeleton)} differ from the state's {sorted(state)} "
            f"(missing from the state: {missing}, not in the snapshot: {extra})"
        )
    for key, (kind, value) in skeleton.items():
        restored = fill(value, tensors)
        live = state[key]
        if kind == "object":
            live.load_state_dict(restored)
        elif kind == "tensor":
            if isinstance(live, torch.Tensor) and live.shape == restored.shape:
                with torch.no_grad():
                    live.copy_(restored)
            else:
                state[key] = restored
        elif isinstance(live, dict) and isinstance(restored, dict):
            live.clear()
            live.update(restored)
        elif isinstance(live, list) and isinstance(restored, list):
            live[:] = restored
        else:
            state[key] = restored
