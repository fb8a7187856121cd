"""Options.from_sources: transport options merged with PGQ_* environment, bad input refused."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pg_transport.config import (
    MAX_ATTEMPTS,
    MAX_SECONDS,
    Options,
    env_queue_key,
    unknown_environment,
    warn_unknown_environment,
)
from pg_transport.errors import ConfigurationError

finite_vt = st.floats(min_value=0, max_value=MAX_SECONDS, exclude_min=True, allow_nan=False)


def options(transport_options: dict[str, Any] | None = None, **environ: str) -> Options:
    return Options.from_sources(transport_options, environ)


def refused(transport_options: dict[str, Any] | None = None, **environ: str) -> str:
    with pytest.raises(ConfigurationError) as info:
        options(transport_options, **environ)
    return str(info.value)


# -- defaults -----------------------------------------------------------------


@pytest.mark.parametrize("transport_options", [None, {}])
def test_defaults(transport_options: dict[str, Any] | None) -> None:
    opts = options(transport_options)
    assert opts.schema == "pgq"
    assert opts.visibility_timeout == 30.0
    assert opts.max_attempts == 5
    assert opts.use_notify is True
    assert opts.polling_interval == 1.0
    assert opts.lease_renewal is True
    assert opts.native_delayed_delivery is True
    assert opts.auto_migrate is True
    assert opts.durable_publish is True
    assert opts.durable_acks == "auto"
    assert opts.vacuum_threshold == 10_000
    assert dict(opts.queue_visibility_timeouts) == {}
    assert dict(opts.queue_max_attempts) == {}
    assert opts.visibility_timeout_for("celery") == 30.0
    assert opts.max_attempts_for("celery") == 5


def test_unrelated_environment_is_ignored() -> None:
    opts = options(None, PGQ_URL="pgq://x/y", PGQ_BROKER_URL="pgq://", HOME="/root")
    assert opts == options(None)


def test_kombu_keys_are_accepted_and_ignored() -> None:
    opts = options({"max_retries": 3, "interval_start": 0, "connect_timeout": 5})
    assert opts == options(None)


# -- each option from transport options and from the environment ---------------

# (key, transport option value, expected, environment value, expected from env)
OPTION_CASES: list[tuple[str, Any, Any, str, Any]] = [
    ("schema", "jobs", "jobs", "envjobs", "envjobs"),
    ("visibility_timeout", 12, 12.0, "7.5", 7.5),
    ("max_attempts", 9, 9, "3", 3),
    ("use_notify", False, False, "true", True),
    ("polling_interval", 0.25, 0.25, "0", 0.0),
    ("lease_renewal", False, False, "yes", True),
    ("native_delayed_delivery", False, False, "on", True),
    ("auto_migrate", False, False, "1", True),
    ("durable_publish", False, False, "true", True),
    ("durable_acks", True, "on", "auto", "auto"),
    ("durable_acks", "off", "off", "ON", "on"),
    ("vacuum_threshold", 0, 0, "50000", 50000),
]


@pytest.mark.parametrize(("key", "value", "expected", "env_value", "env_expected"), OPTION_CASES)
def test_option_from_transport_options_and_env(
    key: str, value: Any, expected: Any, env_value: str, env_expected: Any
) -> None:
    from_options = options({key: value})
    assert getattr(from_options, key) == expected
    assert type(getattr(from_options, key)) is type(expected)

    env_name = f"PGQ_{key.upper()}"
    from_env = options(None, **{env_name: env_value})
    assert getattr(from_env, key) == env_expected

    both = options({key: value}, **{env_name: env_value})
    assert getattr(both, key) == env_expected, "the environment wins over transport options"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", True),
        ("TRUE", True),
        (" Yes ", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("No", False),
        ("OFF", False),
    ],
)
def test_boolean_spellings(raw: str, expected: bool) -> None:
    assert options(None, PGQ_USE_NOTIFY=raw).use_notify is expected


@pytest.mark.parametrize(
    ("value", "expected"), [(True, True), (False, False), (1, True), (0, False)]
)
def test_boolean_values(value: Any, expected: bool) -> None:
    assert options({"lease_renewal": value}).lease_renewal is expected


# -- per-queue visibility timeout and attempts ---------------------------------


def test_per_queue_vt_from_transport_options() -> None:
    opts = options({"visibility_timeout": 10, "queue_visibility_timeouts": {"slow": 600}})
    assert opts.visibility_timeout_for("slow") == 600.0
    assert opts.visibility_timeout_for("fast") == 10.0


def test_per_queue_vt_from_env_uses_the_env_key() -> None:
    opts = options(
        {"queue_visibility_timeouts": {"my.queue-1": 60}},
        PGQ_VISIBILITY_TIMEOUT_MY_QUEUE_1="120",
    )
    assert env_queue_key("my.queue-1") == "MY_QUEUE_1"
    assert opts.visibility_timeout_for("my.queue-1") == 120.0, "env wins over the option"
    assert opts.visibility_timeout_for("other") == 30.0


def test_per_queue_vt_env_beats_global_env() -> None:
    opts = options(None, PGQ_VISIBILITY_TIMEOUT="45", PGQ_VISIBILITY_TIMEOUT_CELERY="5")
    assert opts.visibility_timeout_for("celery") == 5.0
    assert opts.visibility_timeout_for("default") == 45.0


def test_per_queue_attempts_from_options_and_env() -> None:
    opts = options(
        {"max_attempts": 4, "queue_max_attempts": {"flaky": 10, "my.queue-1": 2}},
        PGQ_MAX_ATTEMPTS_MY_QUEUE_1="7",
    )
    assert opts.max_attempts_for("flaky") == 10
    assert opts.max_attempts_for("my.queue-1") == 7
    assert opts.max_attempts_for("other") == 4


@given(
    vt=finite_vt,
    queue_vt=finite_vt,
    attempts=st.integers(min_value=1, max_value=MAX_ATTEMPTS),
    queue_attempts=st.integers(min_value=1, max_value=MAX_ATTEMPTS),
    env_attempts=st.integers(min_value=1, max_value=MAX_ATTEMPTS),
)
def test_per_queue_settings_asked_again_are_what_the_sources_say(
    vt: float, queue_vt: float, attempts: int, queue_attempts: int, env_attempts: int
) -> None:
    """The per-queue answers are cached (the transport, its channels and every claim ask
    the options): asked again, in any order, they are still what the sources say, and
    the cache is no option (equality, repr and the documented fields stay the options')."""
    opts = options(
        {
            "visibility_timeout": vt,
            "queue_visibility_timeouts": {"slow": queue_vt},
            "max_attempts": attempts,
            "queue_max_attempts": {"flaky": queue_attempts},
        },
        PGQ_MAX_ATTEMPTS_SLOW=str(env_attempts),
    )
    fresh = options(
        {
            "visibility_timeout": vt,
            "queue_visibility_timeouts": {"slow": queue_vt},
            "max_attempts": attempts,
            "queue_max_attempts": {"flaky": queue_attempts},
        },
        PGQ_MAX_ATTEMPTS_SLOW=str(env_attempts),
    )
    expected = {
        "slow": (queue_vt, env_attempts),
        "flaky": (vt, queue_attempts),
        "other": (vt, attempts),
    }
    for _ in range(2):
        for queue, (want_vt, want_attempts) in expected.items():
            assert opts.max_attempts_for(queue) == want_attempts, queue
            assert opts.visibility_timeout_for(queue) == want_vt, queue
    assert opts == fresh and repr(opts) == repr(fresh)


def test_unicode_queue_name_has_an_env_key() -> None:
    key = env_queue_key("очередь ✓")
    assert re.fullmatch(r"[A-Z0-9_]+", key)
    opts = options(None, **{f"PGQ_VISIBILITY_TIMEOUT_{key}": "3"})
    assert opts.visibility_timeout_for("очередь ✓") == 3.0


@given(st.text(min_size=1))
def test_env_queue_key_only_yields_env_safe_characters(queue: str) -> None:
    key = env_queue_key(queue)
    assert re.fullmatch(r"[A-Z0-9_]*", key)
    assert len(key) == len(queue), "one character of the key per character of the name"
    assert env_queue_key(key) == key, "idempotent: a key is its own key"


@given(finite_vt)
def test_any_positive_vt_round_trips_through_options(vt: float) -> None:
    assert options({"visibility_timeout": vt}).visibility_timeout == vt
    assert options({"queue_visibility_timeouts": {"q": vt}}).visibility_timeout_for("q") == vt


@given(finite_vt)
def test_any_positive_vt_round_trips_through_env(vt: float) -> None:
    assert options(None, PGQ_VISIBILITY_TIMEOUT=repr(vt)).visibility_timeout == vt
    assert options(None, PGQ_VISIBILITY_TIMEOUT_Q=repr(vt)).visibility_timeout_for("q") == vt


@given(st.integers(min_value=1, max_value=MAX_ATTEMPTS))
def test_any_positive_attempts_round_trips(attempts: int) -> None:
    assert options({"max_attempts": attempts}).max_attempts == attempts
    assert options(None, PGQ_MAX_ATTEMPTS_Q=str(attempts)).max_attempts_for("q") == attempts


@given(st.floats(max_value=0, allow_nan=False))
def test_any_non_positive_vt_is_refused(vt: float) -> None:
    message = refused({"visibility_timeout": vt})
    assert "visibility_timeout" in message
    assert repr(vt) in message


# -- errors name the key and the bad value ----------------------------------


@pytest.mark.parametrize(
    ("environ", "name", "value", "problem"),
    [
        ({"PGQ_VISIBILITY_TIMEOUT": "abc"}, "PGQ_VISIBILITY_TIMEOUT", "abc", "not a number"),
        ({"PGQ_VISIBILITY_TIMEOUT": ""}, "PGQ_VISIBILITY_TIMEOUT", "''", "not a number"),
        ({"PGQ_VISIBILITY_TIMEOUT": "-1"}, "PGQ_VISIBILITY_TIMEOUT", "-1", "must be > 0"),
        ({"PGQ_VISIBILITY_TIMEOUT": "0"}, "PGQ_VISIBILITY_TIMEOUT", "'0'", "must be > 0"),
        ({"PGQ_VISIBILITY_TIMEOUT": "nan"}, "PGQ_VISIBILITY_TIMEOUT", "nan", "not a finite"),
        ({"PGQ_VISIBILITY_TIMEOUT": "inf"}, "PGQ_VISIBILITY_TIMEOUT", "inf", "not a finite"),
        ({"PGQ_VISIBILITY_TIMEOUT": "1e300"}, "PGQ_VISIBILITY_TIMEOUT", "1e300", "must be <="),
        (
            {"PGQ_VISIBILITY_TIMEOUT_CELERY": "-1"},
            "PGQ_VISIBILITY_TIMEOUT_CELERY",
            "-1",
            "must be > 0",
        ),
        (
            {"PGQ_VISIBILITY_TIMEOUT_CELERY": "ten"},
            "PGQ_VISIBILITY_TIMEOUT_CELERY",
            "ten",
            "not a number",
        ),
        ({"PGQ_MAX_ATTEMPTS": "0"}, "PGQ_MAX_ATTEMPTS", "'0'", "must be >= 1"),
        ({"PGQ_MAX_ATTEMPTS": "2.5"}, "PGQ_MAX_ATTEMPTS", "2.5", "not a whole number"),
        ({"PGQ_MAX_ATTEMPTS_CELERY": "x"}, "PGQ_MAX_ATTEMPTS_CELERY", "'x'", "not a number"),
        ({"PGQ_POLLING_INTERVAL": "-0.5"}, "PGQ_POLLING_INTERVAL", "-0.5", "must be >= 0"),
        ({"PGQ_USE_NOTIFY": "maybe"}, "PGQ_USE_NOTIFY", "maybe", "not a boolean"),
        ({"PGQ_AUTO_MIGRATE": ""}, "PGQ_AUTO_MIGRATE", "''", "not a boolean"),
        ({"PGQ_SCHEMA": "bad-name"}, "PGQ_SCHEMA", "bad-name", "plain identifier"),
        ({"PGQ_SCHEMA": "pg_jobs"}, "PGQ_SCHEMA", "pg_jobs", "reserved"),
    ],
)
def test_bad_environment_is_refused_naming_variable_and_value(
    environ: dict[str, str], name: str, value: str, problem: str
) -> None:
    message = refused(None, **environ)
    assert name in message
    assert value in message
    assert problem in message


@pytest.mark.parametrize(
    ("transport_options", "names", "problem"),
    [
        ({"visibility_timeout": -5}, ["visibility_timeout", "-5"], "must be > 0"),
        ({"visibility_timeout": 0}, ["visibility_timeout", "=0"], "must be > 0"),
        ({"visibility_timeout": "soon"}, ["visibility_timeout", "soon"], "not a number"),
        ({"visibility_timeout": None}, ["visibility_timeout", "None"], "not a number"),
        ({"visibility_timeout": True}, ["visibility_timeout", "True"], "not a number"),
        ({"visibility_timeout": math.inf}, ["visibility_timeout", "inf"], "not a finite"),
        ({"visibility_timeout": math.nan}, ["visibility_timeout", "nan"], "not a finite"),
        ({"visibility_timeout": 10**400}, ["visibility_timeout", "1000000"], "must be <="),
        (
            {"queue_visibility_timeouts": {"slow": -1}},
            ["queue_visibility_timeouts", "'slow'", "-1"],
            "must be > 0",
        ),
        (
            {"queue_visibility_timeouts": {"slow": 0}},
            ["queue_visibility_timeouts", "'slow'", "=0"],
            "must be > 0",
        ),
        (
            {"queue_visibility_timeouts": [("slow", 5)]},
            ["queue_visibility_timeouts", "'slow'"],
            "must be a mapping",
        ),
        ({"queue_max_attempts": {"q": 0}}, ["queue_max_attempts", "'q'", "=0"], "must be >= 1"),
        ({"max_attempts": 1.5}, ["max_attempts", "1.5"], "not a whole number"),
        ({"max_attempts": 2**40}, ["max_attempts", str(2**40)], "must be <="),
        ({"vacuum_threshold": -1}, ["vacuum_threshold", "-1"], "must be >= 0"),
        ({"vacuum_threshold": "lots"}, ["vacuum_threshold", "lots"], "not a number"),
        ({"use_notify": "sometimes"}, ["use_notify", "sometimes"], "not a boolean"),
        ({"use_notify": 2}, ["use_notify", "=2"], "not a boolean"),
        ({"schema": "my schema"}, ["schema", "my schema"], "plain identifier"),
        ({"schema": "x;drop"}, ["schema", "x;drop"], "plain identifier"),
        ({"schema": "a" * 49}, ["schema", "a" * 49], "at most 48"),
        ({"schema": 5}, ["schema", "=5"], "plain identifier"),
        ({"schema": "1abc"}, ["schema", "1abc"], "plain identifier"),
        ({"visibility_timout": 30}, ["visibility_timout", "30"], "unknown pgq transport option"),
    ],
)
def test_bad_transport_options_are_refused_naming_key_and_value(
    transport_options: dict[str, Any], names: list[str], problem: str
) -> None:
    message = refused(transport_options)
    for name in names:
        assert name in message
    assert problem in message


def test_every_unknown_key_is_named_at_once() -> None:
    message = refused(
        {"sep": ":", "priority_steps": [0, 3], "visibility_timeout": 5, "fanout_prefix": True}
    )
    assert "unknown pgq transport options" in message
    for key in ("'sep'", "'priority_steps'", "'fanout_prefix'"):
        assert key in message.split("known:", 1)[0]
    assert "'visibility_timeout'" not in message.split("known:", 1)[0]


def test_unknown_key_lists_the_known_ones() -> None:
    message = refused({"visiblity_timeout": 30})
    assert "'visiblity_timeout'" in message
    assert "visibility_timeout" in message.split("known:", 1)[1]


@pytest.mark.parametrize(
    "name", ["PGQ_VISIBILITY_TIMEOUT_celery", "PGQ_VISIBILITY_TIMEOUT_", "PGQ_MAX_ATTEMPTS_my.q"]
)
def test_per_queue_env_that_matches_no_queue_is_refused(name: str) -> None:
    message = refused(None, **{name: "5"})
    assert name in message
    assert "matches no queue" in message


def test_per_queue_env_refusal_suggests_the_right_name() -> None:
    message = refused(None, PGQ_VISIBILITY_TIMEOUT_celery="5")
    assert "PGQ_VISIBILITY_TIMEOUT_CELERY" in message


def test_environment_is_validated_even_when_option_is_valid() -> None:
    message = refused({"visibility_timeout": 10}, PGQ_VISIBILITY_TIMEOUT="-3")
    assert "PGQ_VISIBILITY_TIMEOUT" in message
    assert "-3" in message


def test_errors_are_value_errors_too() -> None:
    with pytest.raises(ValueError, match="PGQ_VISIBILITY_TIMEOUT"):
        options(None, PGQ_VISIBILITY_TIMEOUT="abc")


@pytest.mark.parametrize("bad", ["sometimes", "", 2, None])
def test_durable_acks_is_auto_or_a_boolean(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"durable_acks=.* must be auto, true or false"):
        options({"durable_acks": bad})


def test_listen_url_goes_with_use_notify_off() -> None:
    url = "pgq://app@db1:5432/app"
    assert options({"use_notify": False, "listen_url": url}).listen_url == url
    assert options(None, PGQ_USE_NOTIFY="false", PGQ_LISTEN_URL=url).listen_url == url
    assert options({"use_notify": False, "listen_url": ""}).listen_url is None
    assert options(None).listen_url is None
    with pytest.raises(ConfigurationError, match="listen_url is for use_notify=false"):
        options({"listen_url": url})
    with pytest.raises(ConfigurationError, match="listen_url"):
        options({"use_notify": False, "listen_url": "redis://x"})
    with pytest.raises(ConfigurationError, match="listen_url"):
        options({"use_notify": False, "listen_url": 5})


def test_ordering_modes_per_queue_from_options_and_environment() -> None:
    opts = Options.from_sources(
        {"queue_ordering": {"hooks": "Relaxed", "ledger": "strict"}, "follows_timeout": 0},
        {"PGQ_ORDERING_REPORTS_DAILY": "relaxed", "PGQ_FOLLOWS_RETENTION": "60"},
    )
    assert opts.ordering_for("hooks") == "relaxed"
    assert opts.ordering_for("ledger") == "strict"
    assert opts.ordering_for("reports.daily") == "relaxed"
    assert opts.ordering_for("other") is None  # not configured: the queue keeps its mode
    assert (opts.follows_timeout, opts.follows_retention) == (0.0, 60.0)
    with pytest.raises(ConfigurationError, match=r"queue_ordering\['hooks'\].*strict, relaxed"):
        Options.from_sources({"queue_ordering": {"hooks": "fifo"}}, {})
    with pytest.raises(ConfigurationError, match="PGQ_ORDERING_HOOKS"):
        Options.from_sources(None, {"PGQ_ORDERING_HOOKS": "loose"})


def test_a_misspelt_environment_setting_is_named_with_the_closest_one() -> None:
    environ = {
        "PGQ_VISIBILTY_TIMEOUT": "5",
        "PGQ_VISIBILITY_TIMEOUT": "7",
        "PGQ_VISIBILITY_TIMEOUT_REPORTS": "9",
        "PGQ_RESULT_USE_NOTIFY": "false",
        "PGQ_URL": "pgq://x/y",
        "PGQ_TEST_URL": "pgq://x/y",
        "PGQ_NONSENSE_THING": "1",
        "CELERY_X": "1",
    }
    assert unknown_environment(environ) == [
        ("PGQ_NONSENSE_THING", None),
        ("PGQ_VISIBILTY_TIMEOUT", "PGQ_VISIBILITY_TIMEOUT"),
    ]


def test_unknown_environment_is_warned_once_per_process(caplog: pytest.LogCaptureFixture) -> None:
    environ = {"PGQ_POLING_INTERVAL_ONCE": "2"}
    with caplog.at_level("WARNING", logger="pg_transport.config"):
        assert warn_unknown_environment(environ) == ["PGQ_POLING_INTERVAL_ONCE"]
        assert warn_unknown_environment(environ) == []
    (record,) = caplog.records
    assert "PGQ_POLING_INTERVAL_ONCE is not a pgq setting" in record.getMessage()


def test_queue_rate_limits_define_each_queue_s_own_limit() -> None:
    """queue_rate_limits: a rate ("200/s") or a rate and burst, as `pgq limit set
    queue:<name> --rate … --burst …` would write them."""
    from pg_transport.message.limits import Limit, Rate

    given_options = {"queue_rate_limits": {"celery": "200/s", "api": {"rate": "600/m", "burst": 5}}}
    assert options(given_options).queue_limits() == [
        Limit("queue:api", rate=Rate(600, 60.0), burst=5),
        Limit("queue:celery", rate=Rate(200, 1.0), burst=1),
    ]
    assert options().queue_limits() == []


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("ten per second", "pgq option queue_rate_limits['q']='ten per second'"),
        ("0/s", "pgq option queue_rate_limits['q']='0/s'"),
        ("-3/m", "pgq option queue_rate_limits['q']='-3/m'"),
        (0, "pgq option queue_rate_limits['q']=0"),
        ({"rate": "10/s", "burst": 0}, "pgq option queue_rate_limits['q']['burst']=0"),
        ({"rate": "ten"}, "pgq option queue_rate_limits['q']['rate']='ten'"),
        ({"burst": 2}, "pgq option queue_rate_limits['q']={'burst': 2}: give a 'rate'"),
        ({"rate": "10/s", "concurrency": 3}, "'burst' only, not concurrency"),
    ],
)
def test_a_bad_queue_rate_limit_is_refused_naming_the_option(value: Any, named: str) -> None:
    from pg_transport.errors import LimitError

    with pytest.raises(LimitError) as error:
        options({"queue_rate_limits": {"q": value}})
    assert named in str(error.value)


def test_queue_rate_limits_must_name_queues_a_limit_can_have() -> None:
    from pg_transport.errors import LimitError

    with pytest.raises(ConfigurationError, match="queue_rate_limits='200/s' must be a mapping"):
        options({"queue_rate_limits": "200/s"})
    with pytest.raises(LimitError, match=r"queue_rate_limits\['x{200}'\]"):
        options({"queue_rate_limits": {"x" * 200: "1/s"}})
