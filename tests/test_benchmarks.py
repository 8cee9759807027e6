"""``benchmarks/end_to_end.py --sweep`` at the CPU sizes: every row and agreement column is there, the grid
selection and the top-k overlap measure are right. (Timings on a CPU mean nothing; none are asserted.)"""

import contextlib
import importlib.util
import json
import pathlib
import sys
import types

import pytest
import torch

import nsa_inductor.pass_manager

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def e2e():
    """The benchmark script as a module (registered, as its dataclasses need)."""
    spec = importlib.util.spec_from_file_location("benchmarks_end_to_end", ROOT / "benchmarks" / "end_to_end.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sweep_dir(e2e, tmp_path_factory):
    """One decode and one prefill cell, eager and nsa_rocm (two compiles), written to a folder."""
    torch._dynamo.reset()  # compile here: Dynamo would serve Indexer.decode/prefill as earlier tests compiled them
    # As in suite order: last_reports() is full (it keeps 64), so the sweep must find its reports by identity.
    nsa_inductor.pass_manager.REPORTS.extend({"passes": []} for _ in range(64))
    out = tmp_path_factory.mktemp("sweep")
    argv = ["end_to_end.py", "--sweep", "--small", "--device", "cpu", "--cells", "B4x96,T64",
            "--variants", "eager,nsa_rocm", "--out", str(out)]
    saved, sys.argv = sys.argv, argv
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the timing loops of tiny steps: intra-op threads only contend on a shared CI box
    try:  # compile here, not from Inductor's caches filled by earlier tests: the compiles table shows pass counts
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            e2e.main()
    finally:
        sys.argv = saved
        torch.set_num_threads(threads)
    return out


def test_sweep_writes_every_row_with_agreement(sweep_dir):
    result = json.loads((sweep_dir / "sweep.json").read_text())
    rows = {(r["cell"], r["variant"], r["graphs"]): r for r in result["rows"]}
    assert set(rows) == {(cell, variant, False) for cell in ("decode B=4 ctx=96", "prefill T=64")
                         for variant in ("eager", "nsa_rocm")}
    for row in rows.values():
        # nsa_rocm's K bytes may differ within wk_gate_gemm's documented bound (docs/numerics.md); eager's are eager's
        assert row["cache_bytes_equal"] is True or row["variant"] == "nsa_rocm", row
        assert row["neginf_masks_equal"] is True, row
        assert row["logits_rel_err"] < 1e-3 and row["topk_sets_identical"] == 1.0, row
        assert row["us"] > 0
    table = (sweep_dir / "sweep.md").read_text()
    assert "| cache = eager | logits rel. err | top-k overlap | top-k sets identical |" in table
    for cell, variant, _ in rows:
        assert f"\n| {cell} | {variant} | no | " in table
    short = (sweep_dir / "sweep_short.md").read_text()
    assert "\n| decode B=4 ctx=96 | " in short and "\n| prefill T=64 | " in short
    compiles = {(c["variant"], c["kind"]): c["passes"] for c in result["compiles"]}
    assert set(compiles) == {("nsa_rocm", "decode"), ("nsa_rocm", "prefill")}
    assert "paged_mqa_logits 1" in compiles["nsa_rocm", "decode"]
    assert "ragged_mqa_logits 1" in compiles["nsa_rocm", "prefill"]


def test_merge_replaces_rows_of_the_same_cell(e2e, sweep_dir):
    result = json.loads((sweep_dir / "sweep.json").read_text())
    newer = {**result, "rows": [{**r, "us": 1.0} for r in result["rows"] if r["cell"] == "prefill T=64"]}
    merged = e2e.merge_results(result, newer)
    assert len(merged["rows"]) == len(result["rows"])
    assert {r["us"] for r in merged["rows"] if r["cell"] == "prefill T=64"} == {1.0}
    with pytest.raises(SystemExit, match="different setups"):
        e2e.merge_results(result, {**newer, "meta": {**result["meta"], "layout": "flat"}})


def test_cell_selection(e2e):
    tokens = [c.token for c in e2e.sweep_cells("full", None)]
    assert tokens[0] == "B8x2048" and tokens.index("B1x2048") > tokens.index("B256x32768")  # B > 1 compiles first
    assert len(tokens) == 14
    assert [c.token for c in e2e.sweep_cells("full", "B1,T8192")] == ["B1x2048", "B1x8192", "B1x32768", "T8192"]
    assert [c.token for c in e2e.sweep_cells("full", "prefill")] == ["T1024", "T8192"]
    with pytest.raises(SystemExit, match="unknown"):
        e2e.sweep_cells("full", "B3")


def test_topk_overlap_counts_sets_not_order(e2e):
    eager = torch.tensor([[3, 1, 2, -1], [0, 1, 2, 3], [-1, -1, -1, -1]])
    other = torch.tensor([[1, 2, 3, -1], [0, 1, 2, 7], [-1, -1, -1, -1]])
    overlap, identical = e2e.topk_overlap(eager, other)
    assert overlap.tolist() == [1.0, 0.75, 1.0]
    assert identical.tolist() == [True, False, True]
    _, identical = e2e.topk_overlap(eager[:1], torch.tensor([[1, 2, 3, 0]]))  # one more valid index: not identical
    assert identical.tolist() == [False]


def test_topk_ab_worker_times_the_other_cells_when_one_fails(capsys, monkeypatch):
    """A cell whose call raises (a keyword value the launcher refuses) is reported failed with its error; the other
    cells keep their timings (one bad cell once cost a whole GPU call's table)."""
    spec = importlib.util.spec_from_file_location("benchmarks_topk_ab", ROOT / "benchmarks" / "topk_ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)

    @contextlib.contextmanager
    def cell_call(tk, spec):
        def call():
            if spec["keywords"].get("segment") == 3:
                raise ValueError("bad segment")
        yield None, None, call

    monkeypatch.setattr(sys, "path", list(sys.path))  # (the worker puts benchmarks/ first)
    monkeypatch.setitem(sys.modules, "timing", types.SimpleNamespace(graph_us=lambda call: call() or 5.0))
    monkeypatch.setattr(ab, "_cell_call", cell_call)
    monkeypatch.setattr(ab, "_agrees", lambda *args: True)
    ab.worker(["8x8192", "8x8192:segment=3", "8x8192:sorted"], kernels=False)
    result = json.loads(capsys.readouterr().out.split("RESULT ", 1)[1])
    assert result["cells"] == {"8x8192": [5.0, True, {}], "8x8192:segment=3": None, "8x8192:sorted": [5.0, True, {}]}
    assert result["failed"] == {"8x8192:segment=3": "ValueError: bad segment"}
    assert result["skipped"] == []


def test_topk_ab_worker_starts_no_cell_after_its_deadline(capsys, monkeypatch):
    """Past ``--deadline`` a worker times and profiles nothing more and still prints its result, the cells it did
    not reach listed as skipped (a run under a device call's time limit keeps what it measured)."""
    spec = importlib.util.spec_from_file_location("benchmarks_topk_ab", ROOT / "benchmarks" / "topk_ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    clock = iter([100.0, 200.0, 200.0, 200.0])  # the first cell starts before the deadline, the rest after
    called = []

    @contextlib.contextmanager
    def cell_call(tk, spec):
        yield None, None, lambda: called.append(spec["rows"])

    monkeypatch.setattr(sys, "path", list(sys.path))  # (the worker puts benchmarks/ first)
    monkeypatch.setitem(sys.modules, "timing", types.SimpleNamespace(graph_us=lambda call: call() or 5.0))
    monkeypatch.setattr(ab, "_cell_call", cell_call)
    monkeypatch.setattr(ab, "_agrees", lambda *args: True)
    monkeypatch.setattr(ab, "_kernel_us", lambda call: called.append("profiled") or {"k_kernel": 1.0})
    monkeypatch.setattr(ab.time, "time", lambda: next(clock))
    ab.worker(["1x8192", "2x8192", "3x8192"], kernels=True, deadline=150.0)
    result = json.loads(capsys.readouterr().out.split("RESULT ", 1)[1])
    assert result["cells"] == {"1x8192": [5.0, True, {}], "2x8192": None, "3x8192": None}
    assert result["skipped"] == ["2x8192", "3x8192"]
    assert called == [1, 1]  # the first cell's timing and its check; nothing profiled


def test_topk_ab_cells_parse_and_name_what_exists(tmp_path):
    """``benchmarks/topk_ab.py``'s cells: order, lengths, values, keywords (ints, bools) and module constants read as
    written; its default cells parse; an option no copy knows, a keyword or a constant no copy's source has, is
    refused before any copy runs; one that only some copies have passes."""
    spec = importlib.util.spec_from_file_location("benchmarks_topk_ab", ROOT / "benchmarks" / "topk_ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    cell = "64x65536:sorted:lengths=7680-8704:relu:path=radix_split:segment=512:@RADIX_SMALL_BLOCK=1024"
    assert ab.parse_cell(cell) == dict(rows=64, width=65536, sorted=True, lengths=(7680, 8704), values="relu",
                                       keywords={"path": "radix_split", "segment": 512},
                                       constants={"RADIX_SMALL_BLOCK": 1024})
    assert ab.parse_cell("8x8192:causal")["lengths"] == "causal"
    assert ab.parse_cell("8x8192:bounds=True:programs=-1")["keywords"] == {"bounds": True, "programs": -1}
    ab.check_cells(ab.CELLS.split(","), [ROOT])
    for cell, message in (("8x8192:bogus", "unknown option"), ("8x8192:segmnet=512", "has segmnet"),
                          ("8x8192:@NO_SUCH=1", "has @NO_SUCH")):
        with pytest.raises(SystemExit, match=message):
            ab.check_cells([cell], [ROOT])
    branch = tmp_path / "nsa_inductor" / "lowering" / "topk_indices"
    branch.mkdir(parents=True)
    (branch / "triton.py").write_text("NEW_CONSTANT: int = 1\n\ndef topk_indices(logits, k, new_keyword=None):\n"
                                      "    pass\n")
    ab.check_cells(["8x8192:new_keyword=1:@NEW_CONSTANT=2:segment=512"], [ROOT, tmp_path])
    with pytest.raises(SystemExit, match="has new_keyword, @NEW_CONSTANT"):
        ab.check_cells(["8x8192:new_keyword=1:@NEW_CONSTANT=2"], [ROOT])
    # a copy without a keyword or constant the cell names (an older revision) shows n/a for it rather than failing
    older = types.SimpleNamespace(topk_indices=lambda logits, k, lengths, offset, pad="neg1", sorted=False: None)
    assert ab._unknown(ab.parse_cell("8x8192:programs=4:@RADIX_SMALL_BLOCK=1024"), *ab._imported_names(older)) == [
        "programs", "@RADIX_SMALL_BLOCK"]
    assert ab._unknown(ab.parse_cell("8x8192:sorted"), *ab._imported_names(older)) == []


def test_host_python_prints_every_call_with_and_without_plans(capsys, monkeypatch):
    """``benchmarks/host_python.py``: a row per op call of ``helpers/op_calls.py``, each with its launches counted."""
    spec = importlib.util.spec_from_file_location("benchmarks_host_python", ROOT / "benchmarks" / "host_python.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "path", list(sys.path))  # (the script puts tests/ first)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["host_python.py", "--calls", "2"])
    module.main()
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and "µs" not in line]
    assert [row[0].removeprefix("| ") for row in rows] == list(module.CASES)
    assert all(int(row[4].rstrip(" |")) >= 1 for row in rows)
    assert "doing nothing" in out


def test_hf_indexer_rows_agree_and_name_the_rewrite(capsys, monkeypatch):
    """``benchmarks/hf_indexer.py --small`` on the CPU: a row per cell (a decode step and a causal prefill), nsa_rocm's
    int32 top-k agreeing with eager's on every finite pick, the scores and the top-k rewritten (its report found)."""
    monkeypatch.setattr(sys, "path", [str(ROOT / "benchmarks"), *sys.path])  # (its `timing` import)
    spec = importlib.util.spec_from_file_location("benchmarks_hf_indexer", ROOT / "benchmarks" / "hf_indexer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["hf_indexer.py", "--small", "--device", "cpu", "--cells", "B3xT40,S24",
                                      "--variants", "eager,nsa_rocm"])
    module.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| B3xT40 ", "| S24 "))]
    assert len(rows) == 2 and all(row.endswith("| nsa_rocm 1.0000 | batched_mqa_logits, topk_indices |")
                                  for row in rows), rows
