"""The nsa_rocm backend, the pass manager, options, install(), dumps and FX-graph-cache identity."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import nsa_inductor
from nsa_inductor.options import NsaOptions, parse_options
from nsa_inductor.pass_manager import NsaPassManager
from helpers.pass_helpers import pass_graphs


def run_python(code: str, env: dict | None = None) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            env={**os.environ, **(env or {})}, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def test_backend_is_found_through_the_entry_point_without_importing_the_package():
    out = run_python("""
        import sys, torch
        fn = torch.compile(lambda x: torch.relu(x) * 2, backend="nsa_rocm")
        assert torch.equal(fn(torch.tensor([-1.0, 3.0])), torch.tensor([0.0, 6.0]))
        print("triton" in sys.modules
              and any(m.startswith("nsa_inductor.lowering.") and m.endswith(".triton") for m in sys.modules))
    """)
    assert out.strip() == "False"


def test_import_is_light():
    out = run_python("""
        import sys, nsa_inductor
        print(sorted(m for m in ("triton", "aiter", "torch._inductor.compile_fx") if m in sys.modules))
    """)
    assert out.strip() == "[]"


def test_options_are_parsed_and_validated():
    nsa, inductor = parse_options({"nsa.layout": "flat", "nsa.disable_passes": "x", "max_autotune": False})
    assert nsa == NsaOptions(layout="flat", disable_passes=("x",)) and inductor == {"max_autotune": False}
    with pytest.raises(ValueError, match="unknown option 'nsa.dumpdir'.*nsa.dump_dir"):
        parse_options({"nsa.dumpdir": "/tmp"})
    with pytest.raises(ValueError, match="'nsa.page_size' must be int"):
        parse_options({"nsa.page_size": "64"})
    with pytest.raises(ValueError, match="multiple of 16"):
        parse_options({"nsa.layout": "preshuffle", "nsa.page_size": 40})


def test_nsa_options_are_not_forwarded_to_inductor(tmp_path):
    fn = torch.compile(lambda x: x + 1, backend="nsa_rocm",
                       options={"nsa.dump_dir": str(tmp_path), "nsa.layout": "flat"})
    assert torch.equal(fn(torch.zeros(2)), torch.ones(2))


class CountingPass(CustomGraphPass):
    def __init__(self):
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return "counting-pass"


def test_install_composes_with_an_existing_pass_and_restores_it():
    import torch._inductor.config as inductor_config

    user_pass = CountingPass()
    reads_threshold = inductor_config.realize_acc_reads_threshold
    with inductor_config.patch(post_grad_custom_post_pass=user_pass, emulate_precision_casts=False):
        with nsa_inductor.install() as manager:
            assert inductor_config.post_grad_custom_post_pass is manager and manager.inner is user_pass
            assert inductor_config.emulate_precision_casts and inductor_config.realize_acc_reads_threshold == 12
            torch._dynamo.reset()
            fn = torch.compile(lambda x: x * 3)
            assert torch.equal(fn(torch.ones(3)), torch.full((3,), 3.0))
            assert user_pass.calls == 1
            uuid = manager.uuid()
            assert uuid and uuid != NsaPassManager(NsaOptions()).uuid()
        assert inductor_config.post_grad_custom_post_pass is user_pass
        assert not inductor_config.emulate_precision_casts
        assert inductor_config.realize_acc_reads_threshold == reads_threshold
    with pytest.raises(ValueError, match="nsa.\\* options only"):
        nsa_inductor.install({"max_autotune": True})


def test_uuid_is_none_when_an_inner_pass_has_no_identity():
    assert NsaPassManager(NsaOptions(), inner=lambda graph: None).uuid() is None


def test_uuid_covers_layout_and_options():
    base = NsaPassManager(NsaOptions(layout="paged")).uuid()
    assert base == NsaPassManager(NsaOptions(layout="paged")).uuid()
    assert base != NsaPassManager(NsaOptions(layout="preshuffle")).uuid()
    assert base != NsaPassManager(NsaOptions(layout="paged", head_gate_mode="off")).uuid()
    # the pass objects' configuration is part of it: "round" runs the same passes as "split"
    assert base != NsaPassManager(NsaOptions(layout="paged", head_gate_mode="round")).uuid()


@pytest.mark.parametrize("mode, runs, round_weight", [("split", True, False), ("round", True, True),
                                                      ("off", False, None)])
def test_head_gate_mode_builds_the_pass(mode, runs, round_weight):
    nsa, _ = parse_options({"nsa.head_gate_mode": mode})
    passes = {p.name: p for p in NsaPassManager(nsa).passes}
    assert ("head_gate_gemm" in passes) is runs
    if runs:
        assert (passes["head_gate_gemm"].mode == "round") is round_weight
    assert NsaOptions().head_gate_mode == "split"


def test_head_gate_mode_rejects_other_values_and_the_old_key():
    with pytest.raises(ValueError, match="'split', 'round', 'off'"):
        parse_options({"nsa.head_gate_mode": "bf16"})
    with pytest.raises(ValueError, match=r"nsa\.head_gate_bf16.*renamed.*nsa\.head_gate_mode"):
        parse_options({"nsa.head_gate_bf16": False})


def test_pass_objects_are_built_per_compile():
    a, b = NsaPassManager(NsaOptions()), NsaPassManager(NsaOptions())
    assert [p.name for p in a.passes] == [p.name for p in b.passes]
    assert not any(x is y for x, y in zip(a.passes, b.passes))


def test_dump_dir_has_graphs_and_report(tmp_path):
    torch._dynamo.reset()
    fn = torch.compile(lambda x: torch.relu(x) + 1, backend="nsa_rocm", options={"nsa.dump_dir": str(tmp_path)})
    fn(torch.randn(4))
    (graph_dir,) = list(tmp_path.iterdir())
    files = sorted(p.name for p in graph_dir.iterdir())
    assert "00_input.py" in files and "99_output.py" in files and "report.json" in files
    report = json.loads((graph_dir / "report.json").read_text())
    assert report["graph"] == graph_dir.name
    assert report["layout"] and report["capability"].startswith("nsa_inductor: platform=")
    assert report["passes"]
    for entry in report["passes"]:
        assert {"name", "matched", "near_misses"} <= set(entry)
        assert sum(f.endswith((f"_{entry['name']}.before.py", f"_{entry['name']}.after.py")) for f in files) == 2
    assert len([f for f in files if f.endswith(".before.py")]) == len(report["passes"])
    assert "relu" in (graph_dir / "00_input.py").read_text()


FX_CACHE_SCRIPT = """
    import json, sys, torch, nsa_inductor
    from torch._dynamo.utils import counters
    options = {"nsa.layout": sys.argv[1], "nsa.dump_dir": sys.argv[2]}
    fn = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="nsa_rocm", options=options)
    fn(torch.randn(8))
    (report,) = nsa_inductor.last_reports()
    print(json.dumps([counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"], report]))
"""


def test_fx_graph_cache_hits_across_processes_and_misses_on_a_new_layout(tmp_path):
    """A hit is served with the report its passes made when the entry was compiled (in ``last_reports()`` and the
    dump directory, marked as served from the cache)."""
    script = tmp_path / "compile.py"
    script.write_text(textwrap.dedent(FX_CACHE_SCRIPT))
    package_root = os.path.dirname(os.path.dirname(nsa_inductor.__file__))  # the package under test, not an install
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
           "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")])}

    def compile_in_new_process(layout):
        dump_dir = tmp_path / f"dump-{len(list(tmp_path.iterdir()))}"
        out = subprocess.run([sys.executable, str(script), layout, str(dump_dir)], capture_output=True, text=True,
                             env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        hits, misses, report = json.loads(out.stdout.splitlines()[-1])
        (written,) = dump_dir.glob("*/report.json")
        assert json.loads(written.read_text()) == report
        return hits, misses, report

    hits, misses, compiled = compile_in_new_process("paged")
    assert (hits, misses) == (0, 1) and "served_from_cache" not in compiled
    hits, misses, served = compile_in_new_process("paged")
    assert (hits, misses) == (1, 0) and served["served_from_cache"] and served["compiled_as"] == compiled["graph"]
    assert served["passes"] == compiled["passes"] and served["layout"] == compiled["layout"]
    hits, misses, _ = compile_in_new_process("preshuffle")
    assert (hits, misses) == (0, 1)


SAME_ATEN_GRAPH_SCRIPT = """
    import json, torch, nsa_inductor
    from torch._dynamo.utils import counters
    first = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="nsa_rocm")
    second = torch.compile(lambda x: x.sin().mul(2).add(1), backend="nsa_rocm")
    first(torch.randn(8))
    second(torch.randn(8))
    print(json.dumps([counters["inductor"]["fxgraph_cache_hit"], nsa_inductor.last_reports()[-2:]]))
"""


SECOND_SPELLING_SCRIPT = """
    import json, torch, nsa_inductor
    from torch._dynamo.utils import counters
    torch.compile(lambda x: x.sin().mul(2).add(1), backend="nsa_rocm")(torch.randn(8))
    print(json.dumps([counters["aot_autograd"]["autograd_cache_hit"], nsa_inductor.last_reports()[-1]]))
"""


def test_a_graph_spelled_otherwise_served_from_the_cache_keeps_its_report(tmp_path):
    """Two Dynamo graphs of other code that trace to one ATen graph: the second hits the entry the first filled (with
    the nsa passes), and reports what they did then rather than "no report was kept"; so does the second spelling
    alone in the next process, which AOTAutograd's cache serves without an ATen graph (from the report saved under
    its Dynamo graph's key when the FX graph cache served it)."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
           "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    hits, (compiled, served) = json.loads(run_python(SAME_ATEN_GRAPH_SCRIPT, env).splitlines()[-1])
    assert hits == 1 and served["served_from_cache"] and served["compiled_as"] == compiled["graph"]
    assert served["passes"] == compiled["passes"] is not None
    hits, again = json.loads(run_python(SECOND_SPELLING_SCRIPT, env).splitlines()[-1])
    assert hits == 1 and again["served_from_cache"] and again["compiled_as"] == compiled["graph"]
    assert again["passes"] == compiled["passes"]


def _fold_any_float_chain(match, arg, dtype1, dtype2):
    """torch 2.11's ``pointless_convert``: every float-to-float conversion chain becomes one conversion."""
    node = match.output_node()
    folded = match.graph.call_function(torch.ops.prims.convert_element_type.default, (arg, dtype2))
    folded.meta.update(node.meta)
    node.replace_all_uses_with(folded)
    match.erase_nodes()


def test_bf16_rounding_survives_a_lossy_pointless_convert(monkeypatch):
    """With torch 2.11's rule in place, default Inductor drops ``.to(bf16).float()``; nsa_rocm keeps it, as eager."""
    from torch._inductor.fx_passes import joint_graph

    entries = [e for group in joint_graph.patterns.patterns.values() for e in group
               if getattr(e, "handler", None) is joint_graph.pointless_convert]
    assert entries, "Inductor's pointless_convert pattern moved: the backend's guard would find nothing to wrap"
    monkeypatch.setattr(joint_graph, "pointless_convert", _fold_any_float_chain)
    for entry in entries:
        monkeypatch.setattr(entry, "handler", _fold_any_float_chain)

    def fn(x):
        return (x * 1.37).to(torch.bfloat16).float() * 3.0

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False, emulate_precision_casts=True):
        unrounded = torch.compile(fn, backend="inductor")(x)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        kept = torch.compile(fn, backend="nsa_rocm")(x)
    assert not torch.equal(unrounded, fn(x))
    assert torch.equal(kept, fn(x))
    assert all(entry.handler is _fold_any_float_chain for entry in entries)


def _rope_write_back(a, b, cos_sin, positions):
    """The indexer's q path: projection, RoPE written back into each head's first 64 columns, fp32 for Hadamard."""
    q = (a @ b).view(a.shape[0], -1, 128)
    cos, sin = cos_sin[positions][:, None].unbind(2)
    q_pe = q[..., :64]
    x1, x2 = q_pe.float().chunk(2, dim=-1)
    q_pe.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(q.dtype))
    return q.float() @ torch.eye(128)


def _buffers_allocated(options):
    """Buffers Inductor's code allocates for ``_rope_write_back`` with pointwise ``cat`` forced, as on GPUs."""
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 32, generator=gen).bfloat16(), torch.randn(32, 512, generator=gen).bfloat16()
    angles = torch.rand(16, 1, 32, generator=gen) * torch.arange(16)[:, None, None]
    args = (a, b, torch.cat([angles.cos(), angles.sin()], 1), torch.tensor([3, 0, 15, 7, 7, 1]))
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False, force_pointwise_cat=True):
        fn = torch.compile(_rope_write_back, backend="nsa_rocm", options=options)
        out, (code, *_) = run_and_get_code(fn, *args)
    assert torch.equal(out, _rope_write_back(*args))
    return code.count("= empty_strided_cpu((")


def test_rope_and_its_write_back_fuse():
    """Under Inductor's GPU thresholds the rotated slice is stored first and merged back by a second kernel; with
    the backend's that buffer is gone: projection, fp32 copy, identity matrix and product remain."""
    assert _buffers_allocated({}) == 4
    assert _buffers_allocated({"realize_acc_reads_threshold": 8, "realize_opcount_threshold": 30}) == 5


def _layer_norm_code(options):
    from torch._inductor.utils import run_and_get_code

    ln = torch.nn.LayerNorm(128)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        fn = torch.compile(lambda x: ln(x) * 2, backend="nsa_rocm", options=options)
        _, (code, *_) = run_and_get_code(fn, torch.randn(4, 128))
    return code


def test_layer_norm_stays_eager_after_a_default_inductor_compile():
    """Inductor caches a copy of its decomposition table on its first compile; LayerNorm must leave both."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        torch.compile(lambda x: torch.nn.functional.layer_norm(x, (8,)) + 1)(torch.randn(2, 8))
    assert "aten.native_layer_norm.default(" in _layer_norm_code(None)
    assert "aten.native_layer_norm.default(" not in _layer_norm_code({"nsa.eager_layer_norm": False})


def test_compiling_leaves_the_cache_identity_unchanged():
    """The passes keep no per-graph state on themselves: the FX-graph-cache key is the same after a compile."""
    before = NsaPassManager(NsaOptions()).uuid()
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        torch.compile(lambda x: x * 2 + 1, backend="nsa_rocm")(torch.ones(3))
    assert NsaPassManager(NsaOptions()).uuid() == before


def test_topk_order_configures_the_pass_and_the_cache_key():
    passes = {p.name: p for p in NsaPassManager(parse_options({"nsa.topk_order": "set"})[0]).passes}
    assert passes["topk_indices"].order == "set" and NsaOptions().topk_order == "sorted"
    assert NsaPassManager(NsaOptions(topk_order="set")).uuid() != NsaPassManager(NsaOptions()).uuid()
    with pytest.raises(ValueError, match="'sorted', 'set'"):
        parse_options({"nsa.topk_order": "unsorted"})


# ---------------------------------------------------------------------------------------------------------------
# contained failures
# ---------------------------------------------------------------------------------------------------------------


def _break_rope_pass(monkeypatch):
    """rope_copy_elision adds a node to the graph, then raises."""
    from nsa_inductor.patterns.rope_copy_elision import RopeCopyElision

    def candidates(self, graph, ctx):
        output = next(iter(graph.find_nodes(op="output")))
        with graph.inserting_before(output):
            graph.call_function(torch.ops.aten.neg.default, (output.args[0][0],))
        raise KeyError("deliberately broken")
        yield

    monkeypatch.setattr(RopeCopyElision, "candidates", candidates)


def test_a_failing_pass_is_skipped_with_the_graph_unchanged(monkeypatch, tmp_path):
    _break_rope_pass(monkeypatch)
    torch._dynamo.reset()
    fn = torch.compile(lambda x: torch.relu(x) + 2, backend="nsa_rocm", options={"nsa.dump_dir": str(tmp_path)})
    with pytest.warns(UserWarning, match=r"pass 'rope_copy_elision' failed.*KeyError.*deliberately broken"):
        assert torch.equal(fn(torch.tensor([-1.0, 3.0])), torch.tensor([2.0, 5.0]))
    (graph_dir,) = list(tmp_path.iterdir())
    report = json.loads((graph_dir / "report.json").read_text())
    (entry,) = [p for p in report["passes"] if p["name"] == "rope_copy_elision"]
    assert entry["matched"] == 0 and "deliberately broken" in entry["error"]
    ops = [re.findall(r"torch\.ops\.[\w.]+", source) for source in pass_graphs(graph_dir, "rope_copy_elision")]
    assert ops[0] == ops[1] == ["torch.ops.aten.relu.default", "torch.ops.aten.add.Tensor"]  # restored (renamed)


def test_strict_raises_the_pass_error(monkeypatch):
    _break_rope_pass(monkeypatch)
    torch._dynamo.reset()
    fn = torch.compile(lambda x: torch.relu(x) + 3, backend="nsa_rocm", options={"nsa.strict": True})
    with pytest.raises(Exception, match=r"rope_copy_elision.*deliberately broken"):
        fn(torch.ones(2))


def test_unwritable_dump_dir_warns_and_compiles(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    torch._dynamo.reset()
    fn = torch.compile(lambda x: torch.relu(x) + 4, backend="nsa_rocm", options={"nsa.dump_dir": str(not_a_dir)})
    with pytest.warns(UserWarning, match="cannot write the graph dump"):
        assert torch.equal(fn(torch.ones(2)), torch.full((2,), 5.0))


def test_dump_names_are_unique_per_process(tmp_path):
    from nsa_inductor.debug import GraphDumper

    names = {GraphDumper(str(tmp_path)).name for _ in range(2)}
    assert len(names) == 2 and all(n.startswith(f"graph_{os.getpid()}_") for n in names)


def test_disable_passes_names_are_validated():
    nsa, _ = parse_options({"nsa.disable_passes": ["topk_indices", "no_such_pass"]})
    with pytest.raises(ValueError, match=r"unknown pass\(es\) \['no_such_pass'\].*rope_copy_elision.*topk_indices"):
        NsaPassManager(nsa)


def test_install_handles_restore_in_any_exit_order():
    import torch._inductor.config as inductor_config

    user_pass = CountingPass()
    with inductor_config.patch(post_grad_custom_post_pass=user_pass, emulate_precision_casts=False):
        first, second = nsa_inductor.install(), nsa_inductor.install()
        first.__exit__(None, None, None)
        assert inductor_config.post_grad_custom_post_pass is second.manager
        second.__exit__(None, None, None)
        assert inductor_config.post_grad_custom_post_pass is user_pass
        assert not inductor_config.emulate_precision_casts


def test_prefill_batch_of_empty_sequences_has_integer_positions():
    from nsa_inductor.indexer import IndexerConfig
    from nsa_inductor.layout import KCacheLayout
    from nsa_inductor.workload import prefill_batch

    batch = prefill_batch(IndexerConfig().small(), KCacheLayout(16), [0])
    assert batch.positions.dtype == torch.int64 and batch.slot_mapping.dtype == torch.int64
