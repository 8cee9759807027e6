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


def rocm(triton="3.5.0", aot=False, disabled=False, aiter="0.1.20", arch="gfx942", bundle=None,
         aiter_disabled=False) -> cap_mod.Capability:
    return cap_mod.Capability(
        platform="rocm", device_name="AMD Instinct MI300X", aiter_available=aiter is not None,
        aiter_disabled=aiter_disabled, triton_version=triton, aiter_aot=aot, preshuffle_disabled=disabled,
        fp8_dtype=torch.float8_e4m3fnuz if arch == "gfx942" else torch.float8_e4m3fn, aiter_version=aiter,
        gfx_arch=arch, aiter_aot_bundle=aot if bundle is None else bundle,
    )


def test_cpu_defaults_to_paged_row_major():
    decision = cap_mod.select_layout()
    assert decision.layout == KCacheLayout(64, preshuffle=False)
    assert "layout=paged(page_size=64)" in cap_mod.describe(decision)


@pytest.mark.parametrize(
    ("cap", "expected", "warns"),
    [
        (rocm("3.5.0"), KCacheLayout(64, preshuffle=True), False),
        (rocm("3.3.1", aot=True), KCacheLayout(64, preshuffle=True), False),
        (rocm("3.4.0", aot=True), KCacheLayout(1), True),  # AOT asserts Triton < 3.4, JIT gluon needs 3.5
        (rocm("3.3.1", aot=True, bundle=False), KCacheLayout(1), True),  # the AOT bundle is not installed
        (rocm("3.4.0"), KCacheLayout(1), True),
        (rocm("3.6.0", arch="gfx90a"), KCacheLayout(1), True),  # no gluon kernels on MI250
        (rocm("3.6.0", aiter="0.1.12"), KCacheLayout(1), True),  # no preshuffle in aiter's cache ops
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
        assert any(w in first.reason for w in ("NSA_INDUCTOR_DISABLE_PRESHUFFLE", "Triton 3.4.0", "bundle", "gfx90a",
                                               "0.1.13"))


@pytest.mark.parametrize("page_size", [24, 48, 80, 96, 320])
def test_rocm_page_size_outside_aiters_preshuffle_sizes_falls_back(monkeypatch, page_size):
    monkeypatch.setattr(cap_mod, "capability", lambda: rocm())
    decision = cap_mod.select_layout(page_size=page_size)
    assert decision.layout == KCacheLayout(1) and "256 % P == 0" in decision.reason


@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256, 512])
def test_rocm_preshuffle_page_sizes_aiter_accepts(monkeypatch, page_size):
    monkeypatch.setattr(cap_mod, "capability", lambda: rocm())
    assert cap_mod.select_layout("preshuffle", page_size).layout == KCacheLayout(page_size, preshuffle=True)


@pytest.mark.parametrize("arch, page_size", [("gfx942", 48), ("gfx942", 80), ("gfx942", 272), ("gfx1250", 512)])
def test_preshuffle_page_size_aiter_cannot_read_is_refused_where_aiter_runs(monkeypatch, arch, page_size):
    monkeypatch.setattr(cap_mod, "capability", lambda: rocm("3.6.0", arch=arch))
    with pytest.raises(ValueError, match=r"page_size=%d.*accepts preshuffle page sizes 16, 32, 64, 128" % page_size):
        cap_mod.select_layout("preshuffle", page_size)
    # where aiter's preshuffle kernel does not run (Triton 3.4, aiter disabled, CPU), the Triton kernel reads any P % 16
    for cap in (rocm("3.4.0", arch=arch), rocm("3.6.0", arch=arch, aiter_disabled=True)):
        cap_mod._select_layout.cache_clear()
        monkeypatch.setattr(cap_mod, "capability", lambda cap=cap: cap)
        assert cap_mod.select_layout("preshuffle", page_size).layout == KCacheLayout(page_size, preshuffle=True)


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
        ("paged", 999999999999, r"1\.\.65536"),
    ],
)
def test_impossible_requests_raise_value_error(layout, page_size, match):
    with pytest.raises(ValueError, match=match):
        cap_mod.select_layout(layout, page_size)


def test_bad_environment_value_raises(monkeypatch):
    monkeypatch.setenv("NSA_INDUCTOR_LAYOUT", "preshufle")
    with pytest.raises(ValueError, match="NSA_INDUCTOR_LAYOUT"):
        cap_mod.select_layout()


@pytest.mark.parametrize("value", ["999999999999", "65537", "abc", "-4", "0"])
def test_page_size_environment_value_out_of_range_is_refused(monkeypatch, value):
    monkeypatch.setenv("NSA_INDUCTOR_PAGE_SIZE", value)
    with pytest.raises(ValueError, match=r"NSA_INDUCTOR_PAGE_SIZE must be a positive integer page size \(1\.\.65536\)"):
        cap_mod.select_layout()
    monkeypatch.setenv("NSA_INDUCTOR_LAYOUT", "paged")  # used by the environment's layout too
    with pytest.raises(ValueError, match="NSA_INDUCTOR_PAGE_SIZE"):
        cap_mod.select_layout()


@pytest.mark.parametrize("env", [{"NSA_INDUCTOR_PAGE_SIZE": "abc"}, {"NSA_INDUCTOR_LAYOUT": "bogus"},
                                 {"NSA_INDUCTOR_PAGE_SIZE": "999999999999", "NSA_INDUCTOR_LAYOUT": "bogus"}])
def test_environment_values_an_explicit_request_does_not_use_are_ignored(monkeypatch, env):
    """One rule for both variables: an explicit layout + page size wins and unused env values are not parsed."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cap_mod.select_layout("paged", 32).layout == KCacheLayout(32)
    assert cap_mod.select_layout("flat").layout == KCacheLayout(1)
    if "NSA_INDUCTOR_PAGE_SIZE" not in env:
        assert cap_mod.select_layout("paged").layout == KCacheLayout(64)
    else:  # the page size comes from the environment here: it is used, so it is checked
        with pytest.raises(ValueError, match="NSA_INDUCTOR_PAGE_SIZE"):
            cap_mod.select_layout("paged")


def test_compile_with_explicit_layout_ignores_a_bad_page_size_variable(monkeypatch):
    from nsa_inductor.options import parse_options

    monkeypatch.setenv("NSA_INDUCTOR_PAGE_SIZE", "abc")
    monkeypatch.setenv("NSA_INDUCTOR_LAYOUT", "bogus")
    options, _ = parse_options({"nsa.layout": "paged", "nsa.page_size": 16})
    assert options.layout_decision().layout == KCacheLayout(16)


def test_a_changed_layout_variable_takes_effect_at_the_next_decision(monkeypatch):
    """As the README says: NSA_INDUCTOR_LAYOUT / PAGE_SIZE are read at each decision (each compile)."""
    monkeypatch.setenv("NSA_INDUCTOR_LAYOUT", "flat")
    assert cap_mod.select_layout().layout == KCacheLayout(1)
    monkeypatch.setenv("NSA_INDUCTOR_LAYOUT", "paged")
    assert cap_mod.select_layout().layout == KCacheLayout(64)


CPU = cap_mod.Capability(platform="cpu", device_name="cpu", aiter_available=False, aiter_disabled=False,
                         triton_version="3.6.0", aiter_aot=False, preshuffle_disabled=False,
                         fp8_dtype=torch.float8_e4m3fn)

H200 = dataclasses.replace(CPU, platform="cuda", device_name="NVIDIA H200", cuda_arch=90)

# simulated machine, env overrides -> fragments describe() must contain
DESCRIBE_TABLE = [
    (CPU, {}, ["platform=cpu", "aiter=no", "layout=paged(page_size=64)"], ["ops:", "pdl"]),
    (H200, {}, ["platform=cuda (NVIDIA H200)", "kernels=triton", "pdl=on", "layout=paged(page_size=64)"], ["ops:"]),
    (dataclasses.replace(H200, pdl_disabled=True), {}, ["pdl=off (NSA_INDUCTOR_DISABLE_PDL)"], ["pdl=on"]),
    (dataclasses.replace(H200, device_name="NVIDIA A100", cuda_arch=80), {}, ["kernels=triton"], ["pdl"]),
    (dataclasses.replace(H200, triton_version="3.3.1"), {}, ["triton=3.3.1", "kernels=triton"], ["pdl"]),
    (rocm("3.6.0", aiter="0.1.20"), {},
     ["gfx942", "aiter=0.1.20", "layout=preshuffle(page_size=64)", "quant_cache_store=aiter",
      "gather_k=triton [cp_gather_indexer_k_quant_cache needs num_tokens == cu_seqlens[-1]",
      "paged_mqa_logits=aiter [power-of-two heads >= 16]", "mqa_logits=aiter [power-of-two heads]",
      "topk_indices=aiter [sorted=False]"], []),
    (rocm("3.6.0", aiter="0.1.20"), {"NSA_INDUCTOR_LAYOUT": "paged"},
     ["layout=paged(page_size=64) (requested by NSA_INDUCTOR_LAYOUT)", "quant_cache_store=aiter",
      "paged_mqa_logits=triton [row-major pages (page_size 64)"], []),
    (rocm("3.6.0", aiter="0.1.20"), {"NSA_INDUCTOR_DISABLE_PRESHUFFLE": "1"},
     ["layout=flat(page_size=1)", "paged_mqa_logits=aiter"], []),
    (rocm("3.6.0", aiter="0.1.12"), {},
     ["aiter=0.1.12", "layout=flat(page_size=1)", "no preshuffle (aiter >= 0.1.13)", "paged_mqa_logits=aiter",
      "topk_indices=triton [aiter 0.1.12's top_k_per_row_decode has no k (fixed at 2048 before aiter 0.1.14)]"], []),
    (rocm("3.6.0", aiter="0.1.14"), {},
     ["topk_indices=triton [aiter 0.1.14's top_k_per_row_decode may launch its multi-block kernel"], []),
    (rocm("3.6.0", aiter="0.1.17"), {}, ["topk_indices=aiter [sorted=False]"], []),
    (rocm("3.6.0", aiter="0.1.12"), {"NSA_INDUCTOR_LAYOUT": "preshuffle"},
     ["layout=preshuffle(page_size=64)", "quant_cache_store=triton [aiter 0.1.12's indexer_k_quant_and_cache has no "
      "preshuffle (aiter >= 0.1.13)]", "paged_mqa_logits=triton"], []),
    (rocm("3.6.0", aiter="0.1.7"), {},
     ["layout=flat(page_size=1)", "paged_mqa_logits=triton [aiter 0.1.7's deepgemm_fp8_paged_mqa_logits has no "
      "Preshuffle/KVBlockSize (aiter >= 0.1.8)]", "quant_cache_store=aiter"], []),
    (rocm("3.4.0", aiter="0.1.20"), {},
     ["triton=3.4.0", "layout=flat(page_size=1)", "Triton 3.4.0 < 3.5", "paged_mqa_logits=aiter"], []),
    (rocm("3.4.0", aiter="0.1.20", aot=True), {},
     ["layout=flat(page_size=1)", "AOT gluon path needs Triton < 3.4"], []),
    (rocm("3.3.1", aiter="0.1.20", aot=True), {}, ["layout=preshuffle(page_size=64)"], []),
    (rocm("3.6.0", aiter="0.1.20", arch="gfx950"), {}, ["gfx950", "fp8=float8_e4m3fn", "layout=preshuffle"], []),
    (rocm("3.6.0", aiter="0.1.20", arch="gfx1250"), {"NSA_INDUCTOR_PAGE_SIZE": "512"},
     ["layout=flat(page_size=1)", "gfx1250: ChunkK 256 must be a multiple of the page size"], []),
    (rocm("3.6.0", aiter="0.1.20", arch="gfx90a"), {},
     ["layout=flat(page_size=1)", "gluon paged-MQA kernels need gfx942/gfx950/gfx1250, this GPU is gfx90a"], []),
    (rocm("3.6.0", aiter="0.1.20", aiter_disabled=True), {},
     ["kernels=triton", "disabled by NSA_INDUCTOR_DISABLE_AITER", "layout=paged(page_size=64)"], ["ops:"]),
    (rocm("3.6.0", aiter=None), {}, ["aiter=no", "kernels=triton", "layout=paged(page_size=64)"], ["ops:", "pdl"]),
]


@pytest.mark.parametrize("cap, env, contains, absent", DESCRIBE_TABLE)
def test_describe_over_simulated_machines(monkeypatch, cap, env, contains, absent):
    monkeypatch.delenv("NSA_INDUCTOR_DISABLE_PRESHUFFLE", raising=False)
    if env.get("NSA_INDUCTOR_DISABLE_PRESHUFFLE"):
        cap = dataclasses.replace(cap, preshuffle_disabled=True)  # capability() reads it once per process
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cap_mod, "capability", lambda: cap)
    line = cap_mod.describe()
    assert "\n" not in line
    for fragment in contains:
        assert fragment in line, f"{fragment!r} not in {line!r}"
    for fragment in absent:
        assert fragment not in line


def test_capability_is_cached_and_describes_itself():
    assert cap_mod.capability() is cap_mod.capability()
    line = cap_mod.describe()
    assert line.startswith("nsa_inductor: platform=") and "\n" not in line
    assert dataclasses.replace(rocm(), aiter_disabled=True).kernel_backend == "triton"


@pytest.mark.parametrize("params, version, has_k", [
    (None, "0.1.20", True),  # not inspected: the version decides
    (None, "0.1.12", False),
    (("top_k_per_row_decode", "top_k_per_row_decode.*"), "0.1.14", True),  # @compile_ops wrapper: the version
    (("top_k_per_row_decode", "top_k_per_row_decode.*"), "0.1.12", False),
    (("top_k_per_row_decode", "top_k_per_row_decode.k", "top_k_per_row_decode.logits"), "git", True),
    (("top_k_per_row_decode", "top_k_per_row_decode.logits"), "0.1.20", False),  # inspected: no k keyword
    (("fp8_mqa_logits", "fp8_mqa_logits.Q"), "0.1.20", False),  # aiter.ops.topk did not import
])
def test_signature_inspection_per_function(params, version, has_k):
    """A function aiter wraps as ``(*args, **kwargs)`` is decided by the version; the others by their keywords."""
    assert dataclasses.replace(rocm(aiter=version), aiter_params=params).aiter_has("topk") is has_k


@pytest.mark.parametrize("version, sorted_, why", [
    ("0.1.20", False, None), ("0.1.17", None, None), ("0.1.20", True, "sorted=True"),
    ("0.1.16", False, "multi-block"), ("0.1.13", False, "has no k"), (None, False, "has no k"),
])
def test_topk_refusal(version, sorted_, why):
    got = cap_mod.aiter_refusal(rocm(aiter=version) if version else dataclasses.replace(rocm(), aiter_version=None),
                                "topk_indices", sorted=sorted_)
    assert got is None if why is None else why in got


@pytest.mark.parametrize("layout, shape, expected", [
    (KCacheLayout(64), (10, 16 * 132), KCacheLayout(16)),
    (KCacheLayout(1), (10, 64 * 132), KCacheLayout(64)),
    (KCacheLayout(64, preshuffle=True), (10, 32 * 132), KCacheLayout(32, preshuffle=True)),
    (KCacheLayout(64), (10, 64 * 132), KCacheLayout(64)),
])
def test_cache_layout_takes_the_caches_page_size_and_the_guards_format(layout, shape, expected):
    assert cap_mod.cache_layout(cap_mod.LayoutDecision(layout, "test"), shape) == expected


@pytest.mark.parametrize("layout, shape, match", [
    (KCacheLayout(64, preshuffle=True), (10, 8 * 132), "multiple of 16"),
    (KCacheLayout(64), (10, 1000), "whole number"),
])
def test_cache_layout_refuses_a_contradicting_cache(layout, shape, match):
    with pytest.raises(ValueError, match=match):
        cap_mod.cache_layout(cap_mod.LayoutDecision(layout, "test"), shape)
