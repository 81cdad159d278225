"""One exception type for bad input: the CLI prints its message and exits with code 2."""


class DBSError(Exception):
    """A user-facing error: bad argument, bad file, unsupported model. Never a bug."""

    exit_code = 2
