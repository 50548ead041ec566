"""What stands at a path a user named, in the words every command uses when it is not a file to read."""

from __future__ import annotations

import re
from pathlib import Path

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def not_a_file(path) -> str | None:
    """None when ``path`` is a regular file; otherwise why it cannot be read as one. A folder, a FIFO (whose read
    would block) or a device such as ``/dev/zero`` (whose read never ends) is not a regular file."""
    path = Path(path)
    try:
        if path.is_file():
            return None
        exists = path.exists()
    except OSError as err:  # a name the system refuses (too long, say) names no file
        return f"cannot be looked up: {err.strerror or err}"
    return "is not a regular file (a folder, a FIFO or a device)" if exists else "does not exist"


def is_url(text: str) -> bool:
    """``http://...`` and the like: a name this package does not download (as a path it would read as ``http:/``)."""
    return bool(_URL.match(text))
