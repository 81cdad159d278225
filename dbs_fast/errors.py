"""One exception type for bad input: the CLI prints its message and exits with code 2; the service
answers 422 naming `field` (a DBSConfig field or a request field) with `value`."""
from __future__ import annotations

from contextlib import contextmanager


class DBSError(Exception):
    """A user-facing error: bad argument, bad file, unsupported model. Never a bug."""

    exit_code = 2

    def __init__(self, message: str, field: str | None = None, value=None):
        super().__init__(message)
        self.field, self.value = field, value


@contextmanager
def naming(field: str, value):
    """Inside, a DBSError that names no field is about `field` (the input being checked, `value`):
    the service then names it, as a user would look for it."""
    try:
        yield
    except DBSError as e:
        if e.field is None:
            e.field, e.value = field, value
        raise
