"""The one error a config raises, and the collector that lets one launch report all of a config's problems."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator


class ConfigError(ValueError):
    """A config the trainer cannot run; the message says what to change."""


_problems: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("config_problems", default=None)


def report(message: str) -> None:
    """A problem: noted when a :func:`collecting` block is open (checking goes on), else raised at once."""
    problems = _problems.get()
    if problems is None:
        raise ConfigError(message)
    problems.append(message)


@contextlib.contextmanager
def collecting(problems: list[str]) -> Iterator[None]:
    """Within the block, :func:`report` notes problems in ``problems``; a ConfigError raised outright is noted
    too and ends the block. A check that fails in another way once a problem was noted is taken as that
    problem's consequence (a later check met the bad value) and ends the block quietly."""
    token = _problems.set(problems)
    try:
        yield
    except ConfigError as err:
        problems.append(str(err))
    except (ArithmeticError, TypeError, ValueError, IndexError, KeyError):
        if not problems:
            raise
    finally:
        _problems.reset(token)


def raise_all(problems: list[str]) -> None:
    """One ConfigError holding every problem (the first one's words alone when there is one)."""
    unique = list(dict.fromkeys(problems))
    if len(unique) == 1:
        raise ConfigError(unique[0])
    if unique:
        raise ConfigError(f"{len(unique)} problems:\n" + "\n".join(f"  - {p}" for p in unique))
