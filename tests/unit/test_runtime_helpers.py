"""The shared runtime helpers: backoff, owner ids, redaction, signal-driven stop, and the
redacting settings/error path every `kb` command uses."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import Field

from services.runtime import redaction
from services.runtime.backoff import Backoff
from services.runtime.commands.cli_support import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    error_line,
    fail,
    load_settings,
)
from services.runtime.errors import BadInput, ConfigError, DatabaseUnavailable
from services.runtime.identity import owner_id
from services.runtime.redaction import environment_secrets, redact
from services.runtime.settings import RuntimeSettings
from services.runtime.signals import run_until_signalled, stop_on_signals


def test_backoff_doubles_from_base_up_to_the_cap() -> None:
    backoff = Backoff(base_seconds=2, cap_seconds=60, jitter=0)
    assert [backoff.delay(n) for n in range(1, 9)] == [2, 4, 8, 16, 32, 60, 60, 60]
    assert backoff.delay(10_000) == 60  # no overflow however long the streak


def test_backoff_jitter_only_shortens_and_spreads() -> None:
    backoff = Backoff(base_seconds=10, cap_seconds=1000, jitter=0.2)
    rng = random.Random(7)
    delays = [backoff.delay(3, rng) for _ in range(200)]
    assert all(32 <= d <= 40 for d in delays)
    assert len({round(d, 6) for d in delays}) > 100


@pytest.mark.parametrize(
    ("base", "cap", "jitter"), [(0, 1, 0), (2, 1, 0), (1, 2, -0.1), (1, 2, 1.5)]
)
def test_backoff_refuses_what_cannot_work(base: float, cap: float, jitter: float) -> None:
    with pytest.raises(ValueError, match="backoff"):
        Backoff(base, cap, jitter)


def test_owner_ids_are_host_pid_random_and_never_repeat() -> None:
    first, second = owner_id(), owner_id()
    host, pid, suffix = first.rsplit(":", 2)
    assert host
    assert pid == str(os.getpid())
    assert len(suffix) == 8
    assert first != second


def test_redaction_masks_credentials_by_shape() -> None:
    text = redact(
        "POST failed: Authorization: Bearer sk-abc.def token=xyz123 "
        "postgresql://kb:hunter2@db/kb api_key='k-9' password: p@ss",
        secrets=(),
    )
    for secret in ("sk-abc.def", "xyz123", "hunter2", "k-9", "p@ss"):
        assert secret not in text
    assert "postgresql://kb:***@db/kb" in text


def test_redaction_masks_the_environments_secrets_wherever_they_appear() -> None:
    environ = {
        "DATABASE_URL": "postgresql://kb:s3cret%2Fpw@db:5432/kb",
        "KB_EMBEDDING_API_KEY": "sk-live-1234567890",
        "KAFKA_SASL_PASSWORD": "kafkapw99",
        "KB_LOG_LEVEL": "info",  # not a secret: never masked
    }
    secrets = environment_secrets(environ)
    assert {"s3cret%2Fpw", "s3cret/pw", "sk-live-1234567890", "kafkapw99"} <= secrets
    assert "info" not in secrets
    text = redact(
        "could not connect with password s3cret/pw; provider said key sk-live-1234567890 "
        "is revoked; sasl kafkapw99; level info",
        secrets=secrets,
    )
    for secret in ("s3cret/pw", "sk-live-1234567890", "kafkapw99"):
        assert secret not in text
    assert "level info" in text


# One credential of each shape the patterns know, alone in a line: redaction first checks
# whether a text could hold any of them, and a shape that check misses would go unmasked.
_EACH_SHAPE = (
    ("Authorization: BEARER sk-abc.def", "sk-abc.def"),
    ("key kb.acme.AbCdEfGhIjKlMnOpQr given", "AbCdEfGhIjKlMnOpQr"),
    ("operator kbop.AbCdEfGhIjKlMnOpQr given", "AbCdEfGhIjKlMnOpQr"),
    ("jwt eyJhbGciOi.eyJzdWIi.c2lnbmF0dXJl here", "c2lnbmF0dXJl"),
    ("ApiKey=k-9 sent", "k-9"),
    ("api-key: k-9 sent", "k-9"),
    ("TOKEN=xyz123", "xyz123"),
    ("client_secret='s-1'", "s-1"),
    ("Password: p@ss", "p@ss"),
    ("passwd=p@ss", "p@ss"),
    ("PWD=p@ss", "p@ss"),
    ("credentials: c-3", "c-3"),
    ("AMQP://guest:hunter2@broker/", "hunter2"),
    # Matched case-blind by the patterns' rules: the long s is an s, the Kelvin sign a k.
    ("client_\u017fecret=s-2", "s-2"),
    ("api\u212aey=k-10", "k-10"),
)


@pytest.mark.parametrize(("text", "secret"), _EACH_SHAPE)
def test_redaction_masks_each_shape_of_credential_alone(text: str, secret: str) -> None:
    masked = redact(text, secrets=())
    assert secret not in masked
    assert "***" in masked


def test_redaction_leaves_text_without_credentials_as_it_was() -> None:
    for text in ("task_id=3f1c6a2e-6c1b-4a57", "tenant-1", "owner host-12 kb", "eyJ alone", ""):
        assert redact(text, secrets=()) == text


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from([text for text, _ in _EACH_SHAPE] + [" ", "=", ":", "@", "/", "."])
        | st.text(max_size=12),
        max_size=8,
    )
)
def test_redaction_masks_what_every_pattern_run_on_the_text_masks(parts: list[str]) -> None:
    text = "".join(parts)
    expected = text
    for pattern in redaction._PATTERNS:
        expected = pattern.sub(
            lambda m: m.group(1) + "***" + (m.group(2) if m.lastindex == 2 else ""), expected
        )
    assert redact(text, secrets=()) == expected


class _Strict(RuntimeSettings):
    strict_limit: int = Field(default=1, ge=1)


def test_settings_errors_name_the_setting_never_its_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DATABASE_URL", "mysql://kb:s3cretpw@db/kb")
    monkeypatch.setenv("KB_STRICT_LIMIT", "0")
    with pytest.raises(ConfigError) as raised:
        load_settings(_Strict)
    message = raised.value.message
    assert "DATABASE_URL" in message
    assert "strict_limit" in message
    assert "s3cretpw" not in message
    assert "mysql://" not in message  # no input value at all
    assert raised.value.__cause__ is None  # pydantic's str (with the values) is not chained


def test_every_error_line_is_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql://kb:s3cretpw@db/kb")
    line = error_line(DatabaseUnavailable("cannot reach postgresql://kb:s3cretpw@db/kb"))
    assert "s3cretpw" not in line
    assert line.endswith("[DATABASE_UNAVAILABLE]")
    assert "s3cretpw" not in error_line(RuntimeError("dsn had password s3cretpw in it"))


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (BadInput("no"), EXIT_BAD_INPUT),
        (ConfigError("no"), EXIT_BAD_INPUT),
        (DatabaseUnavailable("down"), EXIT_FAILURE),
        (RuntimeError("a bug"), EXIT_FAILURE),
    ],
)
def test_fail_prints_one_redacted_report_and_exits_with_its_code(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: Exception,
    code: int,
) -> None:
    monkeypatch.setenv("KB_EMBEDDING_API_KEY", "sk-live-1234567890")
    error.args = (f"{error.args[0]} sk-live-1234567890",)
    if hasattr(error, "message"):
        error.message = error.args[0]
    with pytest.raises(SystemExit) as exited:
        fail(error)
    assert exited.value.code == code
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "sk-live-1234567890" not in captured.err
    assert captured.err.strip().splitlines()[-1].startswith("error: ")


async def test_a_signal_sets_the_stop_event_and_handlers_are_restored() -> None:
    loop = asyncio.get_running_loop()
    called: list[str] = []

    async def main(stop: asyncio.Event) -> str:
        loop.call_soon(os.kill, os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), 5)
        return "stopped"

    assert await run_until_signalled(main) == "stopped"
    with stop_on_signals(on_signal=lambda: called.append("told")) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.wait_for(stop.wait(), 5)
    assert called == ["told"]
    # Outside the block the loop no longer handles them: the default handling is back.
    assert not loop.remove_signal_handler(signal.SIGTERM)
    assert not loop.remove_signal_handler(signal.SIGINT)


def test_the_start_up_heap_is_frozen_after_its_garbage_is_collected() -> None:
    import gc
    import weakref

    from services.runtime.heap import freeze_start_up_heap

    class Node:
        other: object = None

    kept = Node()
    garbage = Node()
    garbage.other = garbage  # a cycle only a collection frees
    gone = weakref.ref(garbage)
    del garbage
    try:
        frozen = freeze_start_up_heap()
        # What lives on is left out of every later collection; the cycle was freed first.
        assert gone() is None
        assert frozen == gc.get_freeze_count() > 0
        assert not any(obj is kept for obj in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(obj is kept for obj in gc.get_objects())


def test_young_collections_wait_for_more_objects_and_the_older_rules_stay() -> None:
    import gc

    from services.runtime.heap import YOUNG_COLLECTION_THRESHOLD, collect_young_less_often

    before = gc.get_threshold()
    try:
        collect_young_less_often()
        assert gc.get_threshold() == (YOUNG_COLLECTION_THRESHOLD, *before[1:])
        assert before[0] < YOUNG_COLLECTION_THRESHOLD
    finally:
        gc.set_threshold(*before)
