"""Compiled models shared by the test modules (compiling costs seconds): the reference indexer per config, layout and
entry point, the independently written indexer, and the batches they run on.

Every compiled entry point here marks its K cache static on each call (``compile_indexer``) and is run on caches of
``CACHE_SLOTS`` slots, so the graphs in its dump directory are the same whichever test compiles it first."""

from __future__ import annotations

import functools
import pathlib
import tempfile

import torch

from nsa_inductor.indexer import Indexer, IndexerConfig
from nsa_inductor.layout import KCacheLayout
from nsa_inductor.workload import decode_batch, prefill_batch

from helpers.other_indexer import OtherIndexer

CONFIGS = {"deepseek_v32": IndexerConfig.deepseek_v32().small(), "glm5": IndexerConfig.glm5().small()}
LAYOUTS = {"flat": KCacheLayout(1), "paged": KCacheLayout(16), "preshuffle": KCacheLayout(16, preshuffle=True)}


@functools.cache
def compiled(config_name: str, layout_name: str, entry: str):
    """One model and one compiled entry point per combination, shared by every test (compiling costs seconds)."""
    layout = LAYOUTS[layout_name]
    model = Indexer(CONFIGS[config_name], layout)
    model.reset_parameters(torch.Generator().manual_seed(0))
    dump_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"nsa-{config_name}-{layout_name}-{entry}-"))
    options = {"nsa.layout": layout_name, "nsa.page_size": layout.page_size, "nsa.dump_dir": str(dump_dir)}
    fn = getattr(model, entry)
    return fn, compile_indexer(fn, options), dump_dir


CACHE_SLOTS = 1024  # one cache shape for every batch, as in serving: only the token count varies between compiles


def compile_indexer(fn, options: dict):
    """``fn`` (an indexer's ``decode`` or ``prefill``) compiled with nsa_rocm; every call marks the K cache static.

    The models share code objects (``Indexer.decode`` for every config and layout, ``OtherIndexer.decode`` for two
    layouts), and Dynamo keeps its automatic-dynamic state per code object: without the mark, the first caller with
    another cache size would make the cache symbolic for every later compile of every model, which the passes then
    fix with a guard, one more graph per cache shape. A serving engine's cache has one shape."""
    compiled_fn = torch.compile(fn, backend="nsa_rocm", options=options)

    def call(x, q_lora, positions, slot_mapping, kv_cache, *rest):
        torch._dynamo.mark_static(kv_cache)
        return compiled_fn(x, q_lora, positions, slot_mapping, kv_cache, *rest)

    return call


def batches(config, layout, entry):
    page = layout.page_size
    if entry == "decode":
        return [decode_batch(config, layout, [5, 33, 0, 17], next_n=1, max_len=48, seed=1, cache_pages=CACHE_SLOTS // page),
                decode_batch(config, layout, [2, 47, 16], next_n=2, max_len=48, seed=2, cache_pages=CACHE_SLOTS // page)]
    return [prefill_batch(config, layout, [9, 17, 1], padding_tokens=3, seed=3, cache_pages=CACHE_SLOTS // page)]


@functools.cache
def other(layout_name: str, entry: str):
    """The independently written indexer (``OtherIndexer``) with the reference's weights, compiled with nsa_rocm."""
    layout = LAYOUTS[layout_name]
    config = CONFIGS["deepseek_v32"]
    ref = Indexer(config, layout)
    ref.reset_parameters(torch.Generator().manual_seed(0))
    model = OtherIndexer(config, layout.page_size).load_from(ref)
    dump_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"nsa-other-{layout_name}-{entry}-"))
    options = {"nsa.layout": layout_name, "nsa.page_size": layout.page_size, "nsa.dump_dir": str(dump_dir)}
    fn = getattr(model, entry)
    return fn, compile_indexer(fn, options), dump_dir
