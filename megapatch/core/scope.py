"""A context variable set for the length of a block, on the calling thread (and its autograd
thread through the copied context), then put back as it was."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator


@contextlib.contextmanager
def scoped(variable: contextvars.ContextVar, value: Any) -> Iterator[None]:
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)
