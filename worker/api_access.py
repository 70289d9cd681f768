"""The CLI as a client of the HTTP API: what a person does (submit, decide, cancel, drain,
apply) and the runs and cluster they read go through /v1 under their token, the same door as
programs. Who they are comes from the token (FORGELINE_TOKEN, else the local stack's), never
from a flag; where the API is from FORGELINE_API_URL, else the local stack's."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from forgeline.client import ApiError, Client
from infra.settings import Settings
from infra.tokens import caller_token
from worker.cli_common import CliError, ExitCode

T = TypeVar("T")


def api_client(settings: Settings) -> Client:
    return Client(settings.api_url, caller_token(settings.home))


def exit_code(err: ApiError) -> ExitCode:
    """The exit code for a refusal of the API, by its HTTP status."""
    if err.status == 0 or err.status in (502, 503, 504):
        return ExitCode.DOWN  # the API, or Temporal behind it, did not answer
    if err.status in (401, 403, 409):
        return ExitCode.REFUSED
    if err.status == 404:
        return ExitCode.NOT_FOUND
    if err.status >= 500:
        return ExitCode.BUG
    return ExitCode.BAD_INPUT


def call(action: Callable[[], T]) -> T:
    """`action()`, with the API's refusal as the CLI's one-line error and its exit code."""
    try:
        return action()
    except ApiError as err:
        where = f"{err.field}: " if err.field and not err.message.startswith(err.field) else ""
        raise CliError(f"{where}{err}", exit_code(err)) from None
