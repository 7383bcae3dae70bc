"""Load options shared by the CLI commands and the server's wiring (no click commands here).

Contract: `parse_config_options(items, option)` reads repeatable `KEY=VALUE` items as OpenVINO
properties (a malformed item is a click.BadParameter naming the option); `parse_block_size(text)`
reads `--block-size` (an integer, "auto" or None); `sigint_to_main_thread_only()` is a context
manager that blocks SIGINT while OpenVINO starts its worker threads, so Ctrl-C reaches the main thread.
"""
from __future__ import annotations

import contextlib
import signal

import click


def parse_config_options(items, option: str = "--config") -> dict:
    """`KEY=VALUE` strings (a repeatable CLI option) as a dict of OpenVINO properties."""
    config = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint=option)
        config[key.strip()] = value.strip()
    return config


def parse_block_size(text: str | None) -> int | str | None:
    if text is None or text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--block-size must be an integer or 'auto', got {text!r}") from None


@contextlib.contextmanager
def sigint_to_main_thread_only():
    """Block SIGINT while OpenVINO creates its worker threads, so they inherit the blocked mask.

    Why: the kernel may deliver Ctrl-C to any thread that does not block it. When an OpenVINO
    worker gets it, Python only sets a flag, and the main thread, asleep in readline's select()
    at the `>>>` prompt, never wakes up: Ctrl-C seems to do nothing. With every worker blocking
    SIGINT, the signal always lands on the main thread.
    """
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX: nothing to do
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

