"""``import nsa_inductor`` registers every ``torch.ops.nsa`` op without importing triton or aiter."""

import os
import pathlib
import subprocess
import sys
import textwrap

OPS = ["gather_k", "gather_k_slots", "head_gate_gemm", "mqa_logits", "paged_mqa_logits", "quant_cache_store",
       "rotate_act_quant", "topk_indices", "wk_gate_gemm"]


def test_import_registers_every_op_without_triton_or_aiter():
    """In a fresh interpreter where importing triton fails: every op is there and its CPU reference runs."""
    code = textwrap.dedent(f"""
        import sys
        sys.modules["triton"] = None  # any import of triton now raises ImportError
        sys.modules["aiter"] = None
        import torch
        import nsa_inductor
        from helpers.ops64 import small_inputs

        names = sorted(n.removeprefix("nsa::") for n in torch._C._dispatch_get_all_op_names() if n.startswith("nsa::"))
        assert names == {OPS!r}, names
        inputs = small_inputs()
        for name in names:
            getattr(torch.ops.nsa, name)(*inputs[name])
        loaded = [m for m in sys.modules if m.split(".")[0] in ("triton", "aiter") and sys.modules[m] is not None]
        assert not loaded, loaded
        print("ok")
    """)
    tests_dir = pathlib.Path(__file__).resolve().parents[1]  # for helpers; its parent holds this tree's package
    path = [str(tests_dir.parent), str(tests_dir), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip() == "ok"
