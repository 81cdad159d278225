"""One exception type for bad input: the CLI prints its message and exits with code 2; the service
answers 400 naming `field` (a DBSConfig field or a request field) with `value`.

A message about one field is a template: `{field}` stands where the field's name goes, and each
door fills in its own name for it (`said_as`): the flag in the CLI, the JSON field over HTTP,
OpenAI's name on its endpoints. A message is written in the CLI's words (the flags); `str()`, what
a Python caller reads, gives it in Python's: the field's name, and each flag the message names as
the field or argument that sets the same option (`config.door_words`)."""
from __future__ import annotations

from contextlib import contextmanager


class DBSError(Exception):
    """A user-facing error: bad argument, bad file, unsupported model. Never a bug."""

    exit_code = 2

    def __init__(self, message: str, field: str | None = None, value=None):
        super().__init__(message)
        self.field, self.value = field, value

    @classmethod
    def about(cls, field: str, rule: str, value) -> "DBSError":
        """`field` breaks `rule` ("must be > 0"): "{field} must be > 0, got 0", named by each door."""
        return cls(f"{{field}} {rule}, got {value!r}", field, value)

    def said_as(self, name: str) -> str:
        """The message with the field called `name` (a door's word for it)."""
        return self.args[0].replace("{field}", name)

    def in_cli(self) -> str:
        """The message as the CLI says it: the field as its flag, the flags as they are."""
        from .config import door_name

        return self.said_as(door_name(self.field, "cli")) if self.field else self.args[0]

    def __str__(self) -> str:
        from .config import door_words  # imported on use: config raises DBSError

        return door_words(self.said_as(f"`{self.field}`") if self.field else self.args[0], "python")


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
