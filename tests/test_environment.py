"""gpuload's environment variables: one registry, and a one-line error for every bad value."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import gpuload
from gpuload.cache.settings import ENV_CONFIG, ENV_JOB, ENV_VARS
from gpuload.distributed.group import exchange_timeout
from gpuload.environment import VARIABLES, check_environment, dali_stderr, exchange_timeout_seconds, markdown_table
from gpuload.sizes import CacheSettingError

PACKAGE = Path(gpuload.__file__).parent
# Names spelled GPULOAD_* in the package that are Python names, not environment variables.
NOT_VARIABLES = {"GPULOAD_OPTIONS"}


def test_every_gpuload_variable_named_in_the_package_is_in_the_registry() -> None:
    """In the package's code (its docs also name the test and bench scripts' own variables)."""
    named = {}
    for path in PACKAGE.rglob("*.py"):
        if path.is_file():
            for name in re.findall(r"\bGPULOAD_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")):
                named.setdefault(name, path.relative_to(PACKAGE))
    registered = {variable.name for variable in VARIABLES}
    unknown = {name: str(where) for name, where in named.items() if name not in registered | NOT_VARIABLES}
    assert not unknown, f"GPULOAD_* names not in gpuload.environment.VARIABLES: {unknown}"
    assert {*ENV_VARS.values(), ENV_CONFIG, ENV_JOB} <= registered
    assert len(registered) == len(VARIABLES)
    table = markdown_table()
    assert all(f"`{name}`" in table for name in registered)


def test_the_configuration_page_lists_the_registry() -> None:
    page = (PACKAGE / "docs" / "configuration.md").read_text()
    assert markdown_table() in page, "paste gpuload.environment.markdown_table() into gpuload/docs/configuration.md"


@pytest.mark.parametrize("value", ["inf", "1e10", "nan", "-1", "0", "ten", "9.3e9"])
def test_a_bad_exchange_timeout_is_one_line_naming_the_variable_and_the_range(value: str, monkeypatch) -> None:
    monkeypatch.setenv("GPULOAD_EXCHANGE_TIMEOUT", value)
    with pytest.raises(CacheSettingError) as raised:
        exchange_timeout()
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"GPULOAD_EXCHANGE_TIMEOUT={value!r}")
    assert "> 0 and <= 1e+09" in message


def test_exchange_timeouts_in_range() -> None:
    assert exchange_timeout_seconds({}) == 600
    assert exchange_timeout_seconds({"GPULOAD_EXCHANGE_TIMEOUT": " 2.5 "}) == 2.5
    assert exchange_timeout_seconds({"GPULOAD_EXCHANGE_TIMEOUT": "1e9"}) == 1e9


def test_dali_stderr_accepts_filter_and_keep_only() -> None:
    assert dali_stderr({}) == "filter"
    assert dali_stderr({"GPULOAD_DALI_STDERR": "KEEP"}) == "keep"
    assert dali_stderr({"GPULOAD_DALI_STDERR": "filter"}) == "filter"
    with pytest.raises(CacheSettingError, match=r"^GPULOAD_DALI_STDERR='garbage' \(from environment variable "
                       r"GPULOAD_DALI_STDERR\) is not one of 'filter', 'keep'"):
        check_environment({"GPULOAD_DALI_STDERR": "garbage"})


@pytest.mark.parametrize("name,value", [("GPULOAD_DALI_STDERR", "garbage"), ("GPULOAD_EXCHANGE_TIMEOUT", "inf")])
def test_a_loader_fails_at_once_on_a_bad_variable(name: str, value: str, monkeypatch) -> None:
    """Not when (or if) a DALI run or an exchange reads the variable: when the loader is made."""
    monkeypatch.setenv(name, value)
    with pytest.raises(CacheSettingError, match=f"^{name}="):
        gpuload.DataLoader(torch.utils.data.TensorDataset(torch.arange(4)), batch_size=2)
