"""SIGTERM (docker stop, systemd, timeout) unwinds like Ctrl-C in both command lines.

Its default action ends the process where it stands: a conversion into the cache, or an
artifact being written, leaves a staging directory of the output's size beside it. Raising
SystemExit instead runs every ``finally`` on the way out. A leaf: ``lite`` and ``runtime``
both install it, and both groups of commands are ``Group``s.
"""

from __future__ import annotations

import signal

import click

_terminated = False


def unwind_on_sigterm() -> None:
    signal.signal(signal.SIGTERM, _exit)


def terminated() -> bool:
    """Whether SIGTERM arrived: its SystemExit may surface inside a C extension, which can
    turn it into an error of its own, and the caller should then exit as the signal asked."""
    return _terminated


def _exit(signum: int, frame: object) -> None:
    global _terminated
    _terminated = True
    raise SystemExit(128 + signum)


class Group(click.Group):
    """Ctrl-C exits 130 as a shell reports it, beside SIGTERM's 143: click's own Abort
    exits 1, a user error's status, so a script could not tell an interrupt from a failure."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("\nAborted!", err=True)
            raise SystemExit(128 + signal.SIGINT) from None
