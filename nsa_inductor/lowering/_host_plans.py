"""Host plans: a call of an ``nsa`` op that repeats a call signature replays what an earlier call of it launched,
without the op's Python in between.

Why: without CUDA graphs (prefill; engines that capture only pieces of a step) every op call pays on the host for its
checks, its size and path choices, its allocations and its launches' argument keys: more than many of its kernels
take on the GPU (BENCHMARKS.md, host cost). All of that depends only on the call's signature: each tensor's shape,
strides, dtype, device and 16-byte alignment, and every other argument's value (the launchers never read a device
value). So the second call of a signature records what the op did (the first compiled its kernels), and from the
third on the op allocates what it allocated and launches what it launched, at this call's addresses.

A plan holds the tensors the call allocated and returned (sizes, strides, dtype, device), the bytes of the scratch
it allocated and did not return (one buffer when replayed: one allocation, not several), its launches (Triton's
launcher, grid, kernel metadata, constexprs; each argument a literal or an address: an argument's, an output's or
the scratch buffer's, plus a byte offset) and what it returned (allocations or arguments). One is made only where
everything the op did is known: it ran the Triton implementation, every kernel went through
``_triton_common.launch`` and hit that cache, its only ATen ops were allocations and views, each tensor a launch
took lies in the storage of exactly one argument or allocation, and it returned allocations or arguments themselves.
Otherwise the signature is marked and always runs the op in full (a Triton call logs why, once, at INFO). No plan is
recorded or replayed while a CUDA graph is captured (the ops' side streams; a graph's replay costs no host time
anyway), while a Triton launch hook is set (a profiler that wants each launch described), or on another current
device than the recorded one. As ``launch`` does, plans take the module constants the launchers read as fixed for
the process. ``NSA_INDUCTOR_DISABLE_HOST_PLANS=1`` runs every call in full.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..capability import capability

aten = torch.ops.aten
log = logging.getLogger("nsa_inductor")

PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # keyed by their metadata (not a subclass: a fake tensor)
MAX_SIGNATURES = 4096  # per table of signatures (this module's, the ops' once-per-signature checks)
# the ATen ops a recorded call may make: allocations (replayed) and views (no kernel: nothing to replay)
_ALLOCATIONS = frozenset({aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default})
_VIEWS = frozenset({aten.view.default, aten.view.dtype, aten._unsafe_view.default, aten.alias.default,
                    aten.slice.Tensor, aten.select.int, aten.as_strided.default, aten.t.default, aten.transpose.int,
                    aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default,
                    aten.detach.default})
# where a launch argument or an output comes from: a literal, an argument of the call, an allocation of the call (as
# recorded); in a plan an allocation is an output, or scratch: a byte offset into one buffer for all of the call's
LITERAL, ARGUMENT, ALLOCATION, OUTPUT, SCRATCH = 0, 1, 2, 3, 4
SCRATCH_ALIGNMENT = 512  # bytes, as the CUDA caching allocator aligns its blocks

_PLANS: dict[tuple, Plan | None] = {}  # None: the signature has no plan and never records again
_SEEN: dict[tuple, None] = {}  # signatures called once
_RECORDING = threading.local()  # .current: the Recording of this thread's call, if one is recorded


def signature(op: str, args: tuple) -> tuple | None:
    """The plan key of a call of ``op`` with ``args`` (as the dispatcher passes them); ``None`` for a fake or other
    subclass tensor (tracing)."""
    key: list = [op]
    for a in args:
        if type(a) in PLAIN_TENSORS:
            key.append((a.shape, a.stride(), a.dtype, a.get_device(), not a.data_ptr() & 15))
        elif isinstance(a, torch.Tensor):
            return None
        else:
            key.append(a)
    return tuple(key)


def run(op: str, body: Callable, args: tuple) -> Any:
    """``body(*args)``, the op's implementation, or its plan's replay where the signature has one."""
    key = None if capability().host_plans_disabled else signature(op, args)
    try:
        plan = _PLANS.get(key, _PLANS) if key is not None else None  # (_PLANS: not decided yet)
    except TypeError:  # an argument that cannot be hashed (a list): no plan
        plan = None
    if plan is None:
        return body(*args)
    if plan is not _PLANS:
        return plan.replay(args) if plan.usable() else body(*args)
    if key not in _SEEN:
        remember(_SEEN, key, None)
        return body(*args)
    if _capturing(args):
        return body(*args)
    outer, current = recording(), Recording(args)
    _RECORDING.current = current
    try:
        with current:
            out = body(*args)
    finally:
        _RECORDING.current = outer
    plan = current.plan(out)
    if plan is None and current.backend == "triton":  # (the reference and aiter never have plans)
        log.info("nsa_inductor: nsa.%s runs every call in full (no host plan): %s", op, current.failure)
    remember(_PLANS, key, plan)
    return out


def recording() -> Recording | None:
    """The Recording of the op call this thread is in, if it is recorded."""
    return getattr(_RECORDING, "current", None)


def note_backend(backend: str) -> None:
    """An op call chose its implementation: only a Triton one can have a plan (aiter's kernels launch elsewhere)."""
    current = recording()
    if current is not None:
        current.backend = backend if current.backend in (None, backend) else "several"
        if backend != "triton":
            current.fail(f"the {backend} implementation ran")


def clear() -> None:
    """Forget every plan and signature (tests)."""
    _PLANS.clear()
    _SEEN.clear()


def remember(table: dict, key: tuple, value) -> None:
    """``table[key] = value``, the table emptied first when it holds ``MAX_SIGNATURES`` (a bounded cache)."""
    if len(table) >= MAX_SIGNATURES:
        table.clear()
    table[key] = value


def _capturing(args: tuple) -> bool:
    return any(type(a) in PLAIN_TENSORS and a.is_cuda for a in args) and torch.cuda.is_current_stream_capturing()


class Recording(TorchDispatchMode):
    """What one op call does: its ATen ops (seen as a dispatch mode) and its launches (told by ``launch``)."""

    def __init__(self, args: tuple):
        super().__init__()
        self.args = args
        self.allocations: list[torch.Tensor] = []
        self.launches: list[tuple] = []
        self.device: int | None = None
        self.hooks_set: Callable | None = None
        self.failure: str | None = None
        self.backend: str | None = None  # the implementation the call chose
        # (where, index, address, storage address) of every tensor a launch may take
        self.owners = [(ARGUMENT, i, a.data_ptr(), a.untyped_storage().data_ptr())
                       for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def fail(self, why: str) -> None:
        self.failure = self.failure or why

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.owners.append((ALLOCATION, len(self.allocations), out.data_ptr(), out.untyped_storage().data_ptr()))
            self.allocations.append(out)
        elif func not in _VIEWS:
            self.fail(f"the ATen op {func}, which a plan does not replay")
        return out

    def launch(self, run, before: tuple, function, metadata, grid: tuple, device: int, hooks_set: Callable,
               args: tuple, values: list, tail: tuple) -> None:
        """A launch from ``launch``'s cache: ``args`` as the launcher was given them, ``values`` as Triton's launcher
        takes them."""
        template = []
        for a, value in zip(args, values):
            where = self._where(a) if isinstance(a, torch.Tensor) else (LITERAL, value, 0)
            if where is None:
                self.fail("a launch took a tensor of no argument or allocation, or of several")
                return
            template.append(where)
        if self.device not in (None, device):
            self.fail("launches on several devices")
        self.device, self.hooks_set = device, hooks_set
        self.launches.append((run, before, function, metadata, grid, tuple(template), tail))

    def _where(self, t: torch.Tensor) -> tuple | None:
        storage = t.untyped_storage().data_ptr()
        owners = [(where, index, t.data_ptr() - address) for where, index, address, owner in self.owners
                  if owner == storage]
        return owners[0] if len(owners) == 1 else None

    def _output(self, t) -> tuple | None:
        """Where an output comes from: an allocation or an argument it equals in address, sizes, strides and dtype
        (under the dispatch mode an allocation comes back as another Python object)."""
        if t is None:
            return LITERAL, None
        where = self._where(t)
        if where is None or where[2] != 0:
            return None
        same = self.allocations[where[1]] if where[0] == ALLOCATION else self.args[where[1]]
        if (t.shape, t.stride(), t.dtype) != (same.shape, same.stride(), same.dtype):
            return None
        return where[:2]

    def plan(self, out) -> Plan | None:
        """The call's plan, or None where it cannot have one. The allocations it returns stay tensors of their own;
        the others (scratch the launches use) become ranges of one buffer: one allocation a replay, not several."""
        outputs = [self._output(t) for t in (out if isinstance(out, tuple) else (out,))]
        if any(o is None for o in outputs):
            self.fail("an output that is not an allocation or an argument")
        if len({a.device for a in self.allocations}) > 1:
            self.fail("allocations on several devices")
        if self.failure is not None:
            return None
        returned = sorted({index for where, index in outputs if where == ALLOCATION})
        kept = {j: k for k, j in enumerate(returned)}
        scratch, size = {}, 0
        for j, a in enumerate(self.allocations):
            if j not in kept:
                scratch[j] = size
                size += -(-a.untyped_storage().nbytes() // SCRATCH_ALIGNMENT) * SCRATCH_ALIGNMENT

        def planned(where, index, offset=0):
            if where != ALLOCATION:
                return where, index, offset
            return (OUTPUT, kept[index], offset) if index in kept else (SCRATCH, None, scratch[index] + offset)

        sources: dict[tuple, int] = {}  # (where, index) of each address base: resolved once a replay
        launches = tuple(_launch_call(*launch[:5], [planned(*where) for where in launch[5]], launch[6], sources)
                         for launch in self.launches)
        allocations = tuple((tuple(a.shape), a.stride(), a.dtype, a.device) for a in
                            (self.allocations[j] for j in returned))
        device = self.allocations[0].device if self.allocations else None
        return Plan(allocations, size, device, tuple(sources), launches, tuple(planned(*o)[:2] for o in outputs),
                    isinstance(out, tuple), self.device, self.hooks_set)


_STREAM = 3  # where the stream goes in a launcher's arguments: (grid x, y, z, stream, ...)


def _launch_call(run, before, function, metadata, grid, template, tail, sources: dict) -> tuple:
    """``(run, arguments, addresses)``: the launcher's arguments (as ``launch`` passes them, no hooks) with a
    placeholder for the stream and each address, and per address its position, its base (an index into
    ``sources``, which gets the bases not seen yet) and its byte offset."""
    call = [*grid, None, function, *before, metadata, None, None, None]
    addresses = []
    for where, x, offset in template:
        if where != LITERAL:
            addresses.append((len(call), sources.setdefault((where, x), len(sources)), offset))
        call.append(x if where == LITERAL else None)
    return run, [*call, *tail], tuple(addresses)


class Plan:
    """A recorded call: replay it with another call's arguments of the same signature."""

    def __init__(self, allocations, scratch_bytes, scratch_device, sources, launches, outputs, as_tuple, device,
                 hooks_set):
        self.allocations, self.scratch_bytes, self.scratch_device = allocations, scratch_bytes, scratch_device
        self.sources, self.launches, self.outputs, self.as_tuple = sources, launches, outputs, as_tuple
        self.device, self.hooks_set = device, hooks_set

    def usable(self) -> bool:
        """Whether this call may replay it: no launch hook set, the recorded current device, no graph captured.
        (torch's C functions: CUDA is initialized where a plan launches, and the Python wrappers cost ~µs a call.)"""
        if not self.launches:
            return True
        return (not self.hooks_set() and torch._C._cuda_getDevice() == self.device
                and not torch._C._cuda_isCurrentStreamCapturing())

    def replay(self, args: tuple) -> Any:
        allocations = [torch.empty_strided(size, stride, dtype=dtype, device=device)
                       for size, stride, dtype, device in self.allocations]
        if self.launches:
            # freed when the replay returns, after its launches are queued: the stream orders its next use
            scratch = self.scratch_bytes and torch.empty(self.scratch_bytes, dtype=torch.uint8,
                                                         device=self.scratch_device)
            bases = [scratch.data_ptr() if where == SCRATCH else (args[x] if where == ARGUMENT else allocations[x]
                                                                  ).data_ptr() for where, x in self.sources]
            stream = torch._C._cuda_getCurrentRawStream(self.device)
            for run, call, addresses in self.launches:
                call = call.copy()
                call[_STREAM] = stream
                for position, source, offset in addresses:
                    call[position] = bases[source] + offset
                run(*call)
        outputs = [x if where == LITERAL else args[x] if where == ARGUMENT else allocations[x]
                   for where, x in self.outputs]
        return tuple(outputs) if self.as_tuple else outputs[0]
