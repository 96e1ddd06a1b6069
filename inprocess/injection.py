"""Which parameters of a wrapped function receive its ``CallWrapper``.

A parameter receives it when annotated with the class (``CallWrapper``,
``Optional[CallWrapper]``, ``CallWrapper | None``), as an object or as a string
(a module with ``from __future__ import annotations``). The class is passed in
(:func:`inprocess.wrap.call_wrapper_parameters`): this module knows only its name.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable
from typing import Any

_ANNOTATION_PATTERNS = [
    re.compile(r"^(?:[\w.]+\.)?CallWrapper$"),
    re.compile(r"^(?:typing\.)?Optional\[(?:[\w.]+\.)?CallWrapper\]$"),
    re.compile(r"^(?:[\w.]+\.)?CallWrapper\|None$"),
    re.compile(r"^None\|(?:[\w.]+\.)?CallWrapper$"),
    re.compile(r"^(?:typing\.)?Union\[(?:[\w.]+\.)?CallWrapper,None\]$"),
    re.compile(r"^(?:typing\.)?Union\[None,(?:[\w.]+\.)?CallWrapper\]$"),
]


def is_call_wrapper_annotation(annotation: Any, cls: type) -> bool:
    """Whether ``annotation`` (resolved, or a string that did not resolve) is ``cls``,
    optionally ``None``."""
    if annotation is inspect.Parameter.empty:
        return False
    if isinstance(annotation, str):
        text = annotation.replace(" ", "").strip("'\"")
        return any(p.match(text) for p in _ANNOTATION_PATTERNS)
    if annotation is cls:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        args = set(typing.get_args(annotation))
        return args == {cls, type(None)}
    return False


def resolve(annotation: Any, fn: Callable[..., Any], cls: type) -> Any:
    """Evaluates a string annotation in ``fn``'s globals; the string itself if that fails."""
    if not isinstance(annotation, str):
        return annotation
    namespace = dict(getattr(inspect.unwrap(fn), "__globals__", {}))
    namespace.setdefault("CallWrapper", cls)
    namespace.setdefault("typing", typing)
    namespace.setdefault("Optional", typing.Optional)
    namespace.setdefault("Union", typing.Union)
    try:
        return eval(annotation, namespace)  # what typing.get_type_hints does, per parameter
    except Exception:
        return annotation


def parameters_of_type(fn: Callable[..., Any], cls: type) -> list[str]:
    """Names of ``fn``'s parameters annotated ``cls`` (``cls`` being ``CallWrapper``)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [
        name
        for name, param in signature.parameters.items()
        if param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
        and is_call_wrapper_annotation(resolve(param.annotation, fn, cls), cls)
    ]
