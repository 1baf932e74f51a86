"""This process's fork server, started in an environment we know.

Python's ``multiprocessing`` gives a process one fork server, started by whoever asks first,
in that caller's environment; every child forked from it inherits the modules the server
imported (torch, once: a fresh interpreter spends ~2.5 s of CPU importing torch and us) and
the environment the server *started* in. What a process reads only when it starts (glibc's
malloc tunables) reaches a forked child only through the server's own start, never through the
caller's environment at the fork. So the library starts the server through :func:`start`, which
records that environment, and a caller asks :func:`started_with` before it forks a child that
needs such a variable (``mesh.spawn_local(..., fork=True)``: else it spawns). A forked child
then runs in the caller's environment, standard output and error (:func:`entry`), as a spawned
one would, not the server's.
"""
from __future__ import annotations

import multiprocessing
import os
from multiprocessing import forkserver
from unittest import mock

_STARTED: list[dict[str, str]] = []  # the server's environment, once started here


def start(env: dict[str, str | None] | None = None, preload: list[str] = ()) -> bool:
    """Start this process's fork server, with ``env`` over this process's environment (a
    ``None`` value unsets a variable) and ``preload`` imported; once it runs, nothing. True
    when the server runs in an environment recorded here, False when someone else started it
    (its environment is then unknown)."""
    if _STARTED:
        return True
    # multiprocessing keeps no public record of a running server; a server another caller
    # started keeps its own environment, so it is not recorded as ours
    if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:
        return False
    environ = {**os.environ, **(env or {})}
    environ = {k: v for k, v in environ.items() if v is not None}
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
    with mock.patch.dict(os.environ, environ, clear=True):
        forkserver.ensure_running()
    _STARTED.append(environ)
    return True


def started_with(env: dict[str, str | None]) -> bool:
    """Whether children forked from this process's server (started here) see ``env``'s
    variables at their start: each set to its value, or unset where it is ``None``."""
    return bool(_STARTED) and all(_STARTED[0].get(k) == v for k, v in env.items())


def entry_args(environ: dict[str, str], fn, args: tuple) -> tuple:
    """The arguments of :func:`entry` that run ``fn(rank, *args)`` in a process forked from
    the server with ``environ`` and this process's standard output and error."""
    return environ, _CallersStdio(), fn, args


def entry(rank: int, environ: dict[str, str], stdio: tuple, fn, args: tuple) -> None:
    """A forked process's start: the caller's environment, standard output and error (as a
    spawned process inherits them), not the server's."""
    os.environ.clear()
    os.environ.update(environ)
    for fd, dup in zip((1, 2), stdio):
        os.dup2(dup.detach(), fd)
    fn(rank, *args)


class _CallersStdio:
    """This process's file descriptors 1 and 2, handed to a forked process as multiprocessing
    hands it a pipe: duplicated into it when it starts."""

    def __reduce__(self):
        from multiprocessing.reduction import DupFd
        return tuple, ((DupFd(1), DupFd(2)),)
