"""One interposer on torch.distributed's communication functions, for everything that observes a
collective or a send: the op log (oplog.Recorder) and the rehearsal's recorder
(clustermodel/recorder.py) register a handler each, and neither patches torch.distributed itself.

The functions of WRAPPED are patched once, when the first handler registers, and put back when the
last one leaves; no call site changes. A call of one of them names its call site once (the
project's line that made it) and goes through the handlers, the newest first:

    handler(name, site, proceed, args, kwargs)

- name: the torch.distributed function called ("all_gather_into_tensor", "isend", ...);
- site: "file.py:line function" of the caller;
- proceed(*args, **kwargs): the next handler, or the function itself after the last one.

A handler may record and call proceed, call it later or in another order (the op log's injected
faults hold a collective back), or not call it at all (the rehearsal's fake mode, which returns a
completed work instead); the caller gets what the first handler returns. A handler runs below this
file's frame, never between the caller and it, so naming the call site skips this file alone.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch.distributed as dist

HERE = str(Path(__file__).resolve().parents[1])  # the repository: frames under it are the project's

COLLECTIVES = {  # torch.distributed function -> op name (all_gather_single, reduce_scatter_single: torch 2.13's)
    "all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
    "broadcast": "broadcast", "all_to_all_single": "all_to_all", "barrier": "barrier",
}
POINT_TO_POINT = {"isend": "send", "irecv": "recv", "send": "send", "recv": "recv"}
OBJECTS = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
BATCH = "batch_isend_irecv"
WRAPPED = (*COLLECTIVES, *POINT_TO_POINT, BATCH, *OBJECTS)

HANDLERS: list = []  # the registered handlers, the newest first; the functions are patched while it has any


def register(handler) -> None:
    """Put `handler` in front of every wrapped function (patching them, if it is the first)."""
    if not HANDLERS:
        _patch()
    HANDLERS.insert(0, handler)


def unregister(handler) -> None:
    """Take `handler` out (nothing if it is not in); the last one out puts the functions back."""
    if handler in HANDLERS:
        HANDLERS.remove(handler)
        if not HANDLERS:
            _unpatch()


def _patch() -> None:
    for name in WRAPPED:
        original = getattr(dist, name, None)
        if original is not None:
            setattr(dist, name, _interposed(name, original))


def _unpatch() -> None:
    for name in WRAPPED:
        wrapper = getattr(dist, name, None)
        if wrapper is not None:
            setattr(dist, name, wrapper.__wrapped__)


def _interposed(name: str, original):
    """`original` with the handlers in front (functools.wraps keeps it as __wrapped__)."""
    @functools.wraps(original)
    def call(*args, **kwargs):
        handlers = tuple(HANDLERS)  # (a handler that leaves during the call stays in its chain)
        if not handlers:  # a wrapper kept by someone since the last handler left
            return original(*args, **kwargs)
        site = call_site()
        return handlers[0](name, site, _chain(handlers, 1, name, site, original), args, kwargs)
    return call


def _chain(handlers: tuple, index: int, name: str, site: str, original):
    """The callable that runs handlers[index:], in order, then `original`."""
    if index == len(handlers):
        return original

    def proceed(*args, **kwargs):
        return handlers[index](name, site, _chain(handlers, index + 1, name, site, original), args, kwargs)
    return proceed


def call_site() -> str:
    """The first frame of the project outside this file: the line that called torch.distributed."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        file = _SITE_FILES.get(code)
        if file is None:  # once per code object: a Path per op would cost more than the walk
            name = code.co_filename
            file = _SITE_FILES[code] = Path(name).name if name.startswith(HERE) and name != __file__ else ""
        if file:
            return f"{file}:{frame.f_lineno} {code.co_name}"
        frame = frame.f_back
    return "?"


_SITE_FILES: dict = {}  # code object -> its file's name if it is the project's (not this file), else ""
