"""The library's logger: lock names (and other text) logged one line each.

Every message of django-dlock goes to the ``django_dlock`` logger with the
lock name, the owner or the error as an argument (never formatted into the
message). A name can hold any character but NUL, so a name with a newline
or another control character could end the line and forge the next one.
:class:`EscapeControlCharacters` is installed on that logger when the
package is imported: a text argument (or an exception) whose text is not
printable is logged as its ``repr()`` (quoted, ``\\n`` escaped); a name that is
printable text is logged as it is.
"""

from __future__ import annotations

import logging

__all__ = ["EscapeControlCharacters", "logger"]

logger = logging.getLogger("django_dlock")


def escaped(value: object) -> object:
    """``value``, or the ``repr()`` of its text if that is not printable."""
    if isinstance(value, str):
        return value if value.isprintable() else repr(value)
    if isinstance(value, BaseException):
        text = str(value)
        return value if text.isprintable() else repr(text)
    return value


class EscapeControlCharacters(logging.Filter):
    """Escapes the text arguments of a record that hold control characters."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and args:
            record.args = tuple(escaped(arg) for arg in args)
        return True


if not any(isinstance(f, EscapeControlCharacters) for f in logger.filters):
    logger.addFilter(EscapeControlCharacters())
