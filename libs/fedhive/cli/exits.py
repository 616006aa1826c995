"""The exit codes of every `fedhive` command, mapped in one place from the error that ended it.

* 0 ok.
* 1 the job failed (`watch`: it ended other than FINISHED:COMPLETED), or any error without a
  code of its own (FailedPrecondition, AlreadyExists, PocFailed, ...).
* 2 usage: bad arguments or options (typer's own usage errors too), a bad input file
  (InvalidArgument: every violation of a bad job, an ambiguous job-id prefix, ...; a local file
  that cannot be read or written), missing or invalid settings (ConfigError).
* 3 not found: NotFound, BlobNotFound.
* 4 denied: PermissionDenied, Unauthenticated, BlobAccessDenied.
* 5 unreachable: Unavailable (the gateway, or a service behind it; a refused connection),
  RpcTimeout (a deadline passed), Unroutable; a dropped connection.
* 130 interrupted (Ctrl-C, or SIGTERM for `poc` and `demo`).

gRPC errors reach the CLI as these typed errors (`fedhive.sdk.status.from_grpc`); a raw
`grpc.RpcError` is mapped the same way. docs/cli.md has this table.

Imported by every command, so it loads neither grpc nor the job formats: an error of their
classes can only have been raised where they were loaded (`_loaded`).
"""

from __future__ import annotations

import sys
from enum import IntEnum
from typing import Any

import typer

from fedhive import errors


class Exit(IntEnum):
    OK = 0
    FAILED = 1  # the job failed (watch), or an error with no code of its own
    USAGE = 2
    NOT_FOUND = 3
    DENIED = 4
    UNREACHABLE = 5
    INTERRUPTED = 130  # Ctrl-C / SIGTERM


# The error classes with a code of their own; subclasses inherit it (Violations is an
# InvalidArgument). Everything else is FAILED.
BY_ERROR: dict[type[BaseException], Exit] = {
    errors.InvalidArgument: Exit.USAGE,
    errors.ConfigError: Exit.USAGE,
    errors.MalformedMessage: Exit.USAGE,
    errors.NotFound: Exit.NOT_FOUND,
    errors.BlobNotFound: Exit.NOT_FOUND,
    errors.PermissionDenied: Exit.DENIED,
    errors.Unauthenticated: Exit.DENIED,
    errors.BlobAccessDenied: Exit.DENIED,
    errors.Unavailable: Exit.UNREACHABLE,
    errors.RpcTimeout: Exit.UNREACHABLE,
    errors.Unroutable: Exit.UNREACHABLE,
    # local files and connections
    FileNotFoundError: Exit.USAGE,
    FileExistsError: Exit.USAGE,
    IsADirectoryError: Exit.USAGE,
    NotADirectoryError: Exit.USAGE,
    PermissionError: Exit.USAGE,
    ConnectionError: Exit.UNREACHABLE,
    TimeoutError: Exit.UNREACHABLE,
    KeyboardInterrupt: Exit.INTERRUPTED,
}


def _loaded(module: str, name: str) -> Any:
    """The class `module.name` if that module was loaded, else a class nothing is an instance
    of."""
    loaded = sys.modules.get(module)
    return getattr(loaded, name) if loaded is not None else ()


def mapped(err: BaseException) -> bool:
    """Whether `err` is an error the CLI reports in one line (fedhive's, a local file's or
    connection's, a gateway call's), not a bug to show with its traceback."""
    return isinstance(err, (errors.FedhiveError, OSError, _loaded("grpc", "RpcError")))


def _typed(err: BaseException) -> BaseException:
    """A raw `grpc.RpcError` as fedhive's typed error; any other error as it is."""
    if isinstance(err, _loaded("grpc", "RpcError")):
        from fedhive.sdk.status import from_grpc

        return from_grpc(err, target="the gateway")
    return err


def exit_code(err: BaseException) -> Exit:
    """The exit code for `err`: its class's (or nearest base class's) in BY_ERROR, else 1."""
    err = _typed(err)
    for cls in type(err).__mro__:
        if cls in BY_ERROR:
            return BY_ERROR[cls]
    return Exit.FAILED


def message(err: BaseException) -> str:
    """`err` as the one line a command prints on stderr (without the "error: " prefix)."""
    err = _typed(err)
    if isinstance(err, OSError) and err.strerror:
        return f"{err.filename}: {err.strerror}" if err.filename else err.strerror
    return " ".join(str(err).split()) or type(err).__name__


def fail(err: BaseException) -> typer.Exit:
    """Print `err` on stderr (one line; a bad job: one line per violation) and return the
    typer.Exit with its code, for the command to raise."""
    if isinstance(err, _loaded("fedhive.jobs.archive", "Violations")):
        typer.echo("\n".join(err.violations), err=True)
    else:
        typer.echo(f"error: {message(err)}", err=True)
    return typer.Exit(exit_code(err))


def fail_with(text: str, code: Exit = Exit.FAILED) -> typer.Exit:
    """Print `error: text` on stderr and return the typer.Exit with `code`."""
    typer.echo(f"error: {' '.join(text.split())}", err=True)
    return typer.Exit(code)
