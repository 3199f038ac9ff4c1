"""Where the user's code is, for messages that name the line a random op ran at, and
what is on the Python stack above a random op (torch's modules, torch's RNG replays)."""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import torch

# torch's and compile_rng's own folders: their frames are the machinery between the
# user's line and the op (contextlib's too: the ``with`` blocks compile_rng opens)
_LIBRARIES = (Path(torch.__file__).resolve().parent, Path(__file__).resolve().parent.parent)


def user_line() -> str:
    """``file:line`` of the innermost frame outside torch, compile_rng and ``contextlib``
    (the user's), or ``"?"`` when the whole stack is theirs."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if not any(library in path.parents for library in _LIBRARIES) and "contextlib" not in frame.filename:
            return f"{frame.filename}:{frame.lineno}"
    return "?"


def stack_frames() -> Iterator[FrameType]:
    """The frames on this thread's Python stack, innermost first. Match their code by
    ``id``: hashing a code object hashes its constants, and Dynamo's generated code
    holds unhashable ones (dicts)."""
    frame = inspect.currentframe()
    while frame is not None:
        yield frame
        frame = frame.f_back
