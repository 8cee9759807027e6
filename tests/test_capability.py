import dataclasses
import logging

import pytest
import torch

from nsa_inductor import capability as cap_mod
from nsa_inductor.layout import KCacheLayout


@pytest.fixture(autouse=True)
def fresh_decisions(monkeypatch):
    for name in ("NSA_INDUCTOR_LAYOUT", "NSA_INDUCTOR_PAGE_SIZE", "NSA_INDUCTOR_DISABLE_PRESHUFFLE"):
        monkeypatch.delenv(name, raising=False)
    cap_mod._select_layout.cache_clear()
    cap_mod._warn_once.cache_clear()
    yield
    cap_mod._select_layout.cache_clear()
    cap_mod._warn_once.cache_clear()


def rocm(triton="3.5.0", aot=False, disabled=False) -> cap_mod.Capability:
    return cap_mod.Capability(
        platform="rocm", device_name="AMD Instinct MI300X", aiter_available=True, aiter_disabled=False,
        triton_version=triton, aiter_aot=aot, preshuffle_disabled=disabled, fp8_dtype=torch.float8_e4m3fnuz,
    )


def test_cpu_defaults_to_paged_row_major():
    decision = cap_mod.select_layout()
    assert decision.layout == KCacheLayout(64, preshuffle=False)
    assert "layout=paged(page_size=64)" in cap_mod.describe(decision)


@pytest.mark.parametrize(
    ("cap", "expected", "warns"),
    [
        (rocm("3.5.0"), KCacheLayout(64, preshuffle=True), False),
        (rocm("3.4.0", aot=True), KCacheLayout(64, preshuffle=True), False),
        (rocm("3.4.0"), KCacheLayout(1), True),
        (rocm("3.6.0", disabled=True), KCacheLayout(1), True),
    ],
)
def test_rocm_aiter_prefers_preshuffle_and_falls_back_to_flat_once(monkeypatch, caplog, cap, expected, warns):
    monkeypatch.setattr(cap_mod, "capability", lambda: cap)
    with caplog.at_level(logging.WARNING, logger="nsa_inductor"):
        first = cap_mod.select_layout()
        cap_mod._select_layout.cache_clear()
        assert cap_mod.select_layout() == first
    assert first.layout == expected
    warnings = [r for r in caplog.records if "falls back to flat" in r.getMessage()]
    assert len(warnings) == (1 if warns else 0)
    if warns:
        assert "NSA_INDUCTOR_DISABLE_PRESHUFFLE" in first.reason or "Triton 3.4.0" in first.reason


def test_rocm_page_size_not_multiple_of_16_falls_back(monkeypatch):
    monkeypatch.setattr(cap_mod, "capability", lambda: rocm())
    assert cap_mod.select_layout(page_size=24).layout == KCacheLayout(1)


def test_environment_and_argument_overrides(monkeypatch):
    monkeypatch.setenv("NSA_INDUCTOR_LAYOUT", "preshuffle")
    monkeypatch.setenv("NSA_INDUCTOR_PAGE_SIZE", "32")
    assert cap_mod.select_layout().layout == KCacheLayout(32, preshuffle=True)
    assert cap_mod.select_layout("flat").layout == KCacheLayout(1)
    assert cap_mod.select_layout("paged", 16).layout == KCacheLayout(16)


@pytest.mark.parametrize(
    ("layout", "page_size", "match"),
    [
        ("preshuffle", 24, "multiple of 16"),
        ("flat", 64, "page_size 1"),
        ("paged", 1, "page_size > 1"),
        ("rowmajor", None, "must be one of flat, paged, preshuffle"),
        ("paged", 0, "positive integer"),
    ],
)
def test_impossible_requests_raise_value_error(layout, page_size, match):
    with pytest.raises(ValueError, match=match):
        cap_mod.select_layout(layout, page_size)


def test_bad_environment_value_raises(monkeypatch):
    monkeypatch.setenv("NSA_INDUCTOR_LAYOUT", "preshufle")
    with pytest.raises(ValueError, match="NSA_INDUCTOR_LAYOUT"):
        cap_mod.select_layout()


def test_capability_is_cached_and_describes_itself():
    assert cap_mod.capability() is cap_mod.capability()
    line = cap_mod.describe()
    assert line.startswith("nsa_inductor: platform=") and "\n" not in line
    assert dataclasses.replace(rocm(), aiter_disabled=True).kernel_backend == "triton"
