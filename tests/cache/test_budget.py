"""Cache sizes: parsing, resolution against a device, the shared ledger, settings precedence."""

from __future__ import annotations

import threading

import pytest

from gpuload.cache.budget import (
    BudgetLedger,
    CacheSettingError,
    SizeSpec,
    available_budget,
    default_reserve,
    parse_size,
    resolve_budget,
    resolve_reserve,
)
from gpuload.cache.settings import CacheSettings
from gpuload.device import MemoryInfo

GiB = 2**30
CARD = MemoryInfo(free=70 * GiB, total=80 * GiB)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("12GiB", 12 * 2**30),
        ("500MB", 500 * 10**6),
        ("1.5 GB", 1_500_000_000),
        ("1.5 gib", int(1.5 * 2**30)),
        ("64KiB", 65536),
        ("2tb", 2 * 10**12),
        ("1TiB", 2**40),
        ("100B", 100),
        ("4096", 4096),
        (4096, 4096),
    ],
)
def test_parse_absolute_sizes(text, expected):
    spec = parse_size(text)
    assert spec.kind == "bytes" and spec.amount == expected


@pytest.mark.parametrize("value", [0, "0", None, "off", "OFF", " 0 GiB ", 0.0, "0%"])
def test_parse_off(value):
    assert parse_size(value).kind == "off"


@pytest.mark.parametrize("value, fraction", [(0.8, 0.8), (1.0, 1.0), ("0.25", 0.25), ("50%", 0.5)])
def test_parse_fractions(value, fraction):
    spec = parse_size(value)
    assert spec.kind == "fraction" and spec.amount == pytest.approx(fraction)


def test_parse_auto_case_insensitive():
    assert parse_size("AUTO").kind == "auto"


@pytest.mark.parametrize("value, text", [("1536", "1.50 KiB"), ("2TiB", "2.00 TiB"), ("4096TiB", "4096.00 TiB"),
                                         (100, "100 B"), ("40%", "0.4 of free memory"), ("auto", "auto"),
                                         ("off", "off")])
def test_a_parsed_size_reads_back_as_a_person_writes_it(value, text):
    assert str(parse_size(value)) == text


@pytest.mark.parametrize("value", ["12 parsecs", "lots", "1.5", 1.5, -3, True, "-1GiB", [1], "150%", "half%"])
def test_parse_errors_name_setting_value_and_source(value):
    with pytest.raises(CacheSettingError) as caught:
        parse_size(value, setting="cache_size", source="environment variable GPULOAD_CACHE_SIZE")
    message = str(caught.value)
    assert message.startswith(f"cache_size={value!r}")
    assert "GPULOAD_CACHE_SIZE" in message
    assert isinstance(caught.value, ValueError)


def test_resolve_budget_kinds():
    reserve = default_reserve(CARD.total)
    assert reserve == 8 * GiB  # 10% of 80 GiB beats the 2 GiB floor
    assert default_reserve(8 * GiB) == 2 * GiB
    assert resolve_budget(parse_size("auto"), CARD, reserve) == 62 * GiB
    assert resolve_budget(parse_size(0.5), CARD, reserve) == 35 * GiB
    assert resolve_budget(parse_size("40GiB"), CARD, reserve) == 40 * GiB
    assert resolve_budget(parse_size("off"), CARD, reserve) == 0
    assert resolve_budget(parse_size("auto"), MemoryInfo(1 * GiB, 80 * GiB), reserve) == 0


def test_budget_larger_than_card_says_free_and_total():
    with pytest.raises(CacheSettingError) as caught:
        resolve_budget(parse_size("200GiB"), CARD, 8 * GiB, source="keyword cache_size=", device_name="cuda:0")
    message = str(caught.value)
    assert "200GiB" in message and "cuda:0" in message
    assert "70.00 GiB free" in message and "80.00 GiB total" in message


def test_resolve_reserve():
    assert resolve_reserve(parse_size("auto"), CARD) == 8 * GiB
    assert resolve_reserve(parse_size("3GiB"), CARD) == 3 * GiB
    assert resolve_reserve(parse_size(0.25), CARD) == 20 * GiB  # a fraction of the total
    assert resolve_reserve(parse_size(0), CARD) == 0
    with pytest.raises(CacheSettingError, match="larger than"):
        resolve_reserve(parse_size("100GiB"), CARD, source="default")


def test_ledger_two_owners_share_one_budget():
    ledger = BudgetLedger()
    spec = parse_size("40GiB")
    train = available_budget(spec, 8 * GiB, CARD, device="cuda:0", owner="train", ledger=ledger)
    assert train == 40 * GiB
    assert ledger.reserve(30 * GiB, "train", device="cuda:0", limit=train) == 30 * GiB
    val = available_budget(spec, 8 * GiB, CARD, device="cuda:0", owner="val", ledger=ledger)
    assert val == 10 * GiB
    # val asks for more than is left; the limit cuts it
    assert ledger.reserve(25 * GiB, "val", device="cuda:0", limit=40 * GiB) == 10 * GiB
    assert ledger.reserved("cuda:0") == 40 * GiB
    assert ledger.reserved("cuda") == 40 * GiB  # cuda means cuda:0
    assert ledger.reserved("cuda:1") == 0
    assert ledger.release("train") == 30 * GiB
    assert ledger.owners("cuda:0") == {"val": 10 * GiB}
    assert ledger.release("train") == 0  # idempotent


def test_ledger_auto_counts_allocated_bytes_once():
    ledger = BudgetLedger()
    auto = parse_size("auto")
    ledger.reserve(30 * GiB, "train", device="cuda:0")
    ledger.set_used("train", 30 * GiB, device="cuda:0")
    # train's 30 GiB are allocated, so the driver reports 30 GiB less free
    after = MemoryInfo(free=CARD.free - 30 * GiB, total=CARD.total)
    assert available_budget(auto, 8 * GiB, after, device="cuda:0", ledger=ledger) == 32 * GiB
    # not yet allocated (filled lazily): the driver still reports it free; same answer
    ledger.set_used("train", 0, device="cuda:0")
    assert available_budget(auto, 8 * GiB, CARD, device="cuda:0", ledger=ledger) == 32 * GiB


def test_ledger_is_thread_safe():
    ledger = BudgetLedger()
    granted: list[int] = []

    def take(owner: int) -> None:
        for _ in range(200):
            granted.append(ledger.reserve(1, (owner, len(granted)), device="cuda:0", limit=1000))

    threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ledger.reserved("cuda:0") == 1000
    assert sum(granted) == 1000


def test_set_used_without_reservation_is_an_error():
    with pytest.raises(KeyError, match="reserve"):
        BudgetLedger().set_used("nobody", 1, device="cuda:0")


def test_a_negative_reservation_is_an_error():
    with pytest.raises(ValueError, match=r"cannot reserve a negative number of bytes \(-1\)"):
        BudgetLedger().reserve(-1, "train", device="cuda:0")


def test_release_on_one_device_keeps_the_owners_other_reservations():
    ledger = BudgetLedger()
    ledger.reserve(3 * GiB, "train", device="cuda:0")
    ledger.reserve(2 * GiB, "train", device="cuda:1")
    assert ledger.release("train", device="cuda:1") == 2 * GiB
    assert ledger.owners("cuda:0") == {"train": 3 * GiB} and ledger.owners("cuda:1") == {}


# -- settings precedence ---------------------------------------------------------------------

TOML = """
cache_size = "10GiB"
cache_reserve = "3GiB"

[jobs.train]
cache_size = "40GiB"

[jobs.val]
cache = "host"
"""


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    for name in ("GPULOAD_CACHE", "GPULOAD_CACHE_SIZE", "GPULOAD_CACHE_RESERVE", "GPULOAD_CACHE_SCOPE",
                 "GPULOAD_CONFIG", "GPULOAD_JOB"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_defaults_without_file(workdir):
    settings = CacheSettings.resolve()
    assert settings.mode.value == "auto" and settings.mode.source == "default"
    assert settings.size_spec == SizeSpec("auto", text="auto")
    assert settings.reserve.value.kind == "auto"
    assert settings.config_path is None


def test_precedence_keyword_env_file_default(workdir, monkeypatch):
    (workdir / "gpuload.toml").write_text(TOML)
    settings = CacheSettings.resolve()
    assert settings.size.value.amount == 10 * GiB
    assert settings.size.source == str(workdir / "gpuload.toml")
    assert settings.mode.source == "default"
    monkeypatch.setenv("GPULOAD_CACHE_SIZE", "20GiB")
    settings = CacheSettings.resolve()
    assert settings.size.value.amount == 20 * GiB
    assert settings.size.source == "environment variable GPULOAD_CACHE_SIZE"
    assert settings.reserve.value.amount == 3 * GiB  # still from the file
    settings = CacheSettings.resolve(cache_size="30GiB")
    assert settings.size.value.amount == 30 * GiB
    assert settings.size.source == "keyword cache_size="
    assert "keyword" in settings.describe()


def test_job_selection_by_keyword_and_env(workdir, monkeypatch):
    (workdir / "gpuload.toml").write_text(TOML)
    train = CacheSettings.resolve(job="train")
    assert train.size.value.amount == 40 * GiB
    assert train.size.source.endswith("[jobs.train]")
    assert train.reserve.value.amount == 3 * GiB  # top level still applies
    monkeypatch.setenv("GPULOAD_JOB", "val")
    val = CacheSettings.resolve()
    assert val.mode.value == "host" and val.job == "val"
    assert CacheSettings.resolve(job="train").job == "train"  # keyword beats GPULOAD_JOB


def test_unknown_job_lists_existing_ones(workdir):
    (workdir / "gpuload.toml").write_text(TOML)
    with pytest.raises(CacheSettingError) as caught:
        CacheSettings.resolve(job="tset")
    assert "'tset'" in str(caught.value) and "train, val" in str(caught.value)


def test_job_without_file_is_an_error(workdir):
    with pytest.raises(CacheSettingError, match="no gpuload.toml"):
        CacheSettings.resolve(job="train")


def test_unknown_keys_are_errors(workdir):
    (workdir / "gpuload.toml").write_text('cache_sise = "1GiB"\n')
    with pytest.raises(CacheSettingError) as caught:
        CacheSettings.resolve()
    assert "cache_sise" in str(caught.value) and "cache_size" in str(caught.value)
    (workdir / "gpuload.toml").write_text('[jobs.train]\nreserve = "1GiB"\n')
    with pytest.raises(CacheSettingError, match=r"\[jobs.train\]"):
        CacheSettings.resolve(job="train")


def test_config_path_from_env(workdir, monkeypatch, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("conf") / "mine.toml"
    elsewhere.write_text('cache = "off"\n')
    monkeypatch.setenv("GPULOAD_CONFIG", str(elsewhere))
    settings = CacheSettings.resolve()
    assert settings.mode.value == "off" and settings.mode.source == str(elsewhere)
    monkeypatch.setenv("GPULOAD_CONFIG", str(elsewhere) + ".missing")
    with pytest.raises(CacheSettingError, match="GPULOAD_CONFIG"):
        CacheSettings.resolve()


def test_bad_values_name_their_source(workdir, monkeypatch):
    (workdir / "gpuload.toml").write_text('[jobs.train]\ncache_size = "lots"\n')
    with pytest.raises(CacheSettingError) as caught:
        CacheSettings.resolve(job="train")
    assert "[jobs.train]" in str(caught.value) and "'lots'" in str(caught.value)
    monkeypatch.setenv("GPULOAD_CACHE", "vram")
    with pytest.raises(CacheSettingError, match="GPULOAD_CACHE.*'auto', 'device', 'host', 'off'"):
        CacheSettings.resolve()


def test_bool_modes_and_invalid_toml(workdir):
    assert CacheSettings.resolve(cache=False).mode.value == "off"
    assert CacheSettings.resolve(cache=True).mode.value == "auto"
    (workdir / "gpuload.toml").write_text("cache_size = \n")
    with pytest.raises(CacheSettingError, match="not valid TOML"):
        CacheSettings.resolve()


def test_cache_scope_precedence_and_errors(workdir, monkeypatch):
    assert CacheSettings.resolve().scope.value == "auto"
    assert CacheSettings.resolve().scope.source == "default"
    (workdir / "gpuload.toml").write_text('cache_scope = "node"\n[jobs.big]\ncache_scope = "world"\n')
    assert CacheSettings.resolve().scope.value == "node"
    assert CacheSettings.resolve(job="big").scope.source.endswith("[jobs.big]")
    monkeypatch.setenv("GPULOAD_CACHE_SCOPE", " World ")
    settings = CacheSettings.resolve()
    assert settings.scope.value == "world" and settings.scope.source == "environment variable GPULOAD_CACHE_SCOPE"
    settings = CacheSettings.resolve(cache_scope="rank")
    assert settings.scope.value == "rank" and "cache_scope=rank (keyword cache_scope=)" in settings.describe()
    monkeypatch.setenv("GPULOAD_CACHE_SCOPE", "cluster")
    with pytest.raises(CacheSettingError, match="GPULOAD_CACHE_SCOPE.*'auto', 'rank', 'node', 'world'"):
        CacheSettings.resolve()
    with pytest.raises(CacheSettingError, match="cache_scope=3 \\(from keyword"):
        CacheSettings.resolve(cache_scope=3)
