"""What stands at a path a user named, in the words every command uses when it is not a file to read; and the
one way an output is opened: following no link, refusing anything but a regular file, never over an input."""

from __future__ import annotations

import errno
import io
import os
import re
import stat
from pathlib import Path
from typing import TextIO

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


class Unwritable(OSError):
    """Why an output path is not written: a symbolic link (the write would land in whatever it names), a FIFO (the
    write would block for good), a device or a folder, or a file the command reads."""


def check_output(path) -> None:
    """Unwritable when something other than a regular file stands at ``path`` (nothing there is fine)."""
    path = Path(path)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    except OSError as err:
        raise Unwritable(f"'{path}' cannot be looked up: {err.strerror or err}") from None
    if stat.S_ISLNK(mode):
        raise Unwritable(f"'{path}' is a symbolic link: an output follows no link (it would overwrite what the link "
                         "names); remove it")
    if not stat.S_ISREG(mode):
        raise Unwritable(f"'{path}' is not a regular file (a folder, a FIFO or a device): remove it, or write "
                         "elsewhere")


def open_output(path, mode: str = "w") -> TextIO:
    """``path`` opened for writing text (``w``: emptied, ``a``: appended to), following no symbolic link and
    refusing anything but a regular file, without blocking on a FIFO (Unwritable saying which)."""
    check_output(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_APPEND if mode == "a" else 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # a link, a FIFO or a folder put there meanwhile
            check_output(path)
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Unwritable(f"'{path}' is not a regular file: remove it, or write elsewhere")
    os.set_blocking(fd, True)
    if mode == "w":
        os.ftruncate(fd, 0)  # only once it is known to be a regular file
    return io.TextIOWrapper(io.FileIO(fd, mode), encoding="utf-8")


def write_output(path, text: str) -> None:
    """``text`` written to ``path`` as :func:`open_output` opens it."""
    with open_output(path) as file:
        file.write(text)


def refuse_inputs(output, inputs, what: str) -> None:
    """Unwritable when ``output`` (a file or folder a command writes) is one of ``inputs`` (files or folders it
    reads) or lies inside one: ``what`` names the option, as in '--out'."""
    out = Path(output).resolve()
    for given in inputs:
        if given is None:
            continue
        source = Path(given).resolve()
        if out == source or source in out.parents and source.is_dir():
            raise Unwritable(f"{what} {output} is {'the' if out == source else 'inside the'} "
                             f"{'folder' if source.is_dir() else 'file'} {given} this command reads; write it "
                             "elsewhere")
