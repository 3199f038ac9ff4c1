"""Only random ops reach compile_rng in a step (compile_rng.eager.random_kernels).

A step used to see every aten op through a dispatch mode (a Python call per op, forward,
backward and recomputation); now each random op has a kernel over torch's, and every other
op runs torch's kernel with no Python in between. These tests pin that down (a plain op
meets no compile_rng frame: the mode design fails it), what the kernels serve (every random
overload with a kernel of its own), what they leave as it was (values, errors, autograd
outside a step; ``uninstall()`` removes them) and what they cannot see, refused: a random
op that torch's ``run_with_rng_state`` replays.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import pytest
import torch
import torch.nn.functional as F

import compile_rng
from compile_rng._torch import core_internals
from compile_rng.eager import dispatch_modes
from device_threads import stream_key_in_thread_state


def _python_frames(fn) -> list[str]:
    """Every Python function ``fn()`` calls (``fn`` itself left out)."""
    seen: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            seen.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen[1:]


OUTSIDE = {
    "rand": lambda x: torch.rand(4, 4), "randn": lambda x: torch.randn(4, 4),
    "randint": lambda x: torch.randint(0, 7, (4,)), "randperm": lambda x: torch.randperm(16),
    "uniform_": lambda x: x.uniform_(), "normal_": lambda x: x.normal_(), "bernoulli_": lambda x: x.bernoulli_(0.5),
    "native_dropout": lambda x: torch.native_dropout(x, 0.5, True), "multinomial": lambda x: torch.multinomial(x.abs() + 1, 2),
    "poisson": lambda x: torch.poisson(x.abs()),
}


@pytest.mark.parametrize("op", sorted(OUTSIDE))
def test_outside_a_stream_a_random_op_calls_no_python_after_a_step(op):
    """The kernels stay registered after a step, but outside every stream each calls torch's
    kernel in C++: no Python frame (before, every random op in the process entered a Python
    kernel and held the GIL for its whole run)."""
    with compile_rng.step(4):
        F.dropout(torch.ones(4, 4), 0.5)
    x = torch.ones(4, 4)
    assert _registered()
    assert _python_frames(functools.partial(OUTSIDE[op], x)) == []


def test_a_background_draw_outside_a_stream_leaves_the_gil_to_other_threads():
    """A random op outside any stream releases the GIL as stock torch does: a background
    thread's large draw does not stall the main thread (a Python kernel held the GIL for
    the draw's whole run: 1.2 s of stall for a randn(2**25) before)."""
    import threading
    import time

    with compile_rng.step(4):
        F.dropout(torch.ones(4, 4), 0.5)
    done = threading.Event()

    def background():
        torch.randn(2**24)
        done.set()

    worker = threading.Thread(target=background)
    ticks, longest = 0, 0.0
    start = last = time.perf_counter()
    worker.start()
    while not done.is_set():
        now = time.perf_counter()
        longest, last, ticks = max(longest, now - last), now, ticks + 1
    worker.join()
    total = time.perf_counter() - start
    # the main thread kept running beside the draw: never held up for most of it
    assert ticks > 100 and longest < total / 2, (ticks, longest, total)


def _compile_rng_frames(fn) -> list[str]:
    """The Python functions of compile_rng (and any ``__torch_dispatch__``) that ``fn()`` calls."""
    seen: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if "compile_rng" in code.co_filename or code.co_name == "__torch_dispatch__":
                seen.append(f"{code.co_filename}:{code.co_name}")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def test_a_plain_op_in_a_step_runs_torchs_kernel_without_python():
    """Forward and backward of plain ops inside a step call no compile_rng code and no
    dispatch mode; the step's dropout does (it is the one op served)."""
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16)

    def plain():
        torch.relu(torch.addmm(x, x, w)).sum().backward()

    with compile_rng.step(4):
        assert _compile_rng_frames(plain) == []
        assert _compile_rng_frames(lambda: F.dropout(x, 0.5)) != []


KERNEL_KEY = "Fake" if stream_key_in_thread_state() else "CPU"  # where a CPU draw meets compile_rng's kernel


def _dispatch_lines(op) -> dict[str, str]:
    """``op``'s dispatch table, key -> the line torch prints for it."""
    return {line.partition(":")[0]: line for line in torch._C._dispatch_dump_table(op.name()).splitlines()}


def test_every_random_overload_with_a_kernel_of_its_own_is_served():
    """Each aten overload tagged ``nondeterministic_seeded`` that has a CPU kernel of its
    own (not a decomposition into the others) has compile_rng's kernel at the key a stream
    includes (torch 2.13+; on 2.11 and 2.12 at the CPU key), and torch's own at every other
    backend key; no other key of it names compile_rng but the Python kernel's, which no
    dispatch reaches."""
    with dispatch_modes.eager_stream():
        pass
    served = [op for op in core_internals.random_op_overloads() if core_internals.has_backend_kernel(op, "CPU")]
    assert {torch.ops.aten.bernoulli_.float, torch.ops.aten.native_dropout.default, torch.ops.aten.randperm.default} <= set(served)
    for op in served:
        lines = _dispatch_lines(op)
        assert "compile_rng" in lines[KERNEL_KEY] and "[kernel]" in lines[KERNEL_KEY], (op, lines[KERNEL_KEY])
        if KERNEL_KEY == "Fake":
            assert all("compile_rng" not in line for key, line in lines.items()
                       if key not in ("Fake", core_internals.PYTHON_KERNEL_KEY)), op


@pytest.mark.skipif(not stream_key_in_thread_state(), reason="torch 2.11 and 2.12: the kernels sit at the backend keys")
def test_the_streams_key_is_in_a_threads_state_only_in_a_stream():
    """The key compile_rng's kernels sit at is included while a stream is open - on a
    backward's device thread too, with the handler - and gone after it, also when the block
    raises; a DTensor region of torch's own tracker (``drawing(None)``) takes it out."""
    from compile_rng.eager import random_kernels

    def included() -> bool:
        return "Fake" in str(torch._C._dispatch_tls_local_include_set())

    assert not included()
    seen = []
    x = torch.ones(4, 4, requires_grad=True)

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(included())
            return g

    with pytest.raises(KeyError):
        with compile_rng.step(4):
            assert included()
            Probe.apply(x).sum().backward()
            with random_kernels.drawing(None):
                assert not included()
            assert included()
            raise KeyError("the block fails")
    assert seen == [True] and not included()


def _stock_draws() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.ones(6, 5, requires_grad=True)
    y = F.dropout(x, 0.5)
    y.sum().backward()
    return [torch.rand(4, generator=g), torch.randperm(7, generator=g), torch.randn(3, generator=g), y, x.grad]


def test_outside_a_step_random_ops_are_torchs_values_errors_and_autograd():
    """With the kernels registered, outside a step: torch's values (the same generator
    draws), its errors and its autograd (a leaf that requires grad refuses an in-place
    draw); after ``uninstall()`` no kernel of compile_rng is where a dispatch reaches it
    (those at the stream's key stay, with no thread including it) and the same holds."""
    with dispatch_modes.eager_stream():
        pass  # the kernels are registered

    def errors() -> list[str]:
        found = []
        for bad in (lambda: torch.rand(3, dtype=torch.int64),
                    lambda: torch.ones(2, requires_grad=True).bernoulli_(0.5),
                    lambda: torch.randint(5, 2, (3,))):
            with pytest.raises((RuntimeError, ValueError)) as info:
                bad()
            found.append(str(info.value))
        return found

    torch.manual_seed(11)
    served, served_errors = _stock_draws(), errors()
    compile_rng.uninstall()
    try:
        # no kernel of compile_rng is left where a dispatch can reach it: the C++ kernels
        # (or a fallthrough) at the stream's key, which no thread's state includes out of a
        # stream or a layout block, and the Python kernels at a key no dispatch reaches, stay
        assert "Fake" not in str(torch._C._dispatch_tls_local_include_set())
        assert _python_frames(lambda: torch.rand(4)) == []
        for op in core_internals.random_op_overloads():
            lines = _dispatch_lines(op)
            # at the stream's key: the C++ kernel or the fallthrough, never a Python kernel
            assert "installation.py" not in lines.get("Fake", ""), (op, lines["Fake"])
            assert all("compile_rng" not in line for key, line in lines.items()
                       if key not in ("Fake", core_internals.PYTHON_KERNEL_KEY)), op
        torch.manual_seed(11)
        stock, stock_errors = _stock_draws(), errors()
    finally:
        compile_rng.install()
    assert all(torch.equal(a, b) for a, b in zip(served, stock))
    assert served_errors == stock_errors


def _registered() -> bool:
    line = _dispatch_lines(torch.ops.aten.bernoulli_.float).get(KERNEL_KEY, "")
    return "compile_rng" in line and "[kernel]" in line


def test_a_step_draws_the_stream_installed_uninstalled_and_reinstalled():
    """The values a step draws come from compile_rng's stream (the same seed, the same
    masks) installed, uninstalled (a step serves the kernels again, once: they stay,
    calling no Python outside streams, until the next ``uninstall()``) and installed again.
    ``uninstall()`` removes the kernels at the backend keys (torch 2.11, 2.12); at the
    stream's key, which only a stream includes, they stay for the process (a step after
    ``uninstall()`` would pay ~0.7 ms to register them again) and it drops the lane's
    references to compile_rng's handler."""
    x = torch.ones(8, 4)

    def masks():
        compile_rng.set_state(5, 0)
        with compile_rng.step(8):
            assert _registered()
            return F.dropout(x, 0.5), torch.rand(8, 3)

    kept = KERNEL_KEY == "Fake"
    before = masks()

    def references() -> int:  # outside an assert: pytest's rewriting holds the function too
        return sys.getrefcount(dispatch_modes.stream_op)

    held = references()
    compile_rng.uninstall()
    try:
        assert _registered() == kept
        assert references() == held - 1
        uninstalled = masks()
        assert references() == held
        assert _python_frames(lambda: torch.rand(4)) == []
        compile_rng.uninstall()
        assert _registered() == kept
    finally:
        compile_rng.install()
    after = masks()
    assert all(torch.equal(a, b) for a, b in zip(before, uninstalled))
    torch.manual_seed(5)  # torch's own generator at the same seed draws other values
    stock = F.dropout(x, 0.5)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert not torch.equal(before[0], stock)


def test_a_random_op_torch_replays_is_refused_in_a_step():
    """``run_and_save_rng_state`` / ``run_with_rng_state`` (another backend's checkpointed
    random op, replayed from torch's generator in the backward) draw in a step only to be
    refused - the kernels see the op, not the operator, so the Python stack says it. An op
    that draws nothing under them runs."""
    hop = torch.ops.higher_order
    q = torch.randn(1, 1, 4, 8)
    with compile_rng.step(1):
        with pytest.raises(NotImplementedError, match="run_with_rng_state"):
            hop.run_and_save_rng_state(torch.ops.aten.rand.default, [4], device=torch.device("cpu"))
        state = torch.get_rng_state()
        with pytest.raises(NotImplementedError, match="run_with_rng_state"):
            hop.run_with_rng_state(state, torch.ops.aten.rand.default, [4], device=torch.device("cpu"))
        _, out = hop.run_and_save_rng_state(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, q, q, q)
        assert out[0].shape == q.shape


def test_tracing_in_a_step_sees_torchs_ops_and_draws_nothing():
    """FakeTensor and torch.export inside a step run torch's own random ops (the kernels
    sit at the backend keys, which tracing never reaches): stock graphs, no draw."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.ones(4, 3)
    with compile_rng.step(4):
        before = compile_rng.get_state()
        with FakeTensorMode():
            fake = F.dropout(torch.empty(4, 3), 0.5) + torch.rand(4, 3)
        exported = torch.export.export(torch.nn.Dropout(0.5), (x,))
        assert compile_rng.get_state() == before
    assert fake.shape == (4, 3)
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert any("dropout" in t for t in targets) and not any("compile_rng" in t for t in targets), targets


class _PassThrough(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode the step's code enters and leaves (selective AC's, a profiler's)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_a_piece_recorded_under_a_mode_entered_in_the_step_is_followed_after_it():
    """A tensor-parallel rank's piece first recorded inside a mode the step's code entered:
    the step's piece mode goes under that mode, so it outlives it - the dropout on the piece
    after the mode has exited draws the piece's layout (ranks differ), exactly as with no
    such mode - and the stack is as it was after the step."""
    from dtensor_reference import fake_rank
    from test_local_shards import _input, _tensor_parallel, Scores

    from compile_rng._torch.core_internals import dispatch_mode_stack

    outs = {}
    for rank in range(2):
        for entered in (False, True):
            with fake_rank(rank, 2):
                model, x = _tensor_parallel(Scores(), rank), _input()
                compile_rng.manual_seed(5)
                with compile_rng.step(x.shape[0]):
                    with _PassThrough() if entered else contextlib.nullcontext():
                        q = model.q(x)  # this rank's columns: a recorded piece
                    outs[rank, entered] = F.dropout(q, 0.5)
                assert dispatch_mode_stack() == []
    assert torch.equal(outs[0, False], outs[0, True]) and torch.equal(outs[1, False], outs[1, True])
    assert not torch.equal(outs[0, True] != 0, outs[1, True] != 0)


def test_a_draw_in_a_step_keeps_no_caller_alive():
    """Reading the Python stack for a draw must leave no cycle through the callers' frames:
    one kept a broken-off ``accelerate_batches`` generator - and the step it was inside -
    alive into the next run."""
    import gc
    import weakref

    class Marker:
        pass

    def run():
        marker = Marker()
        with compile_rng.step(4):
            F.dropout(torch.ones(4, 2), 0.5)
        return weakref.ref(marker)

    gc.disable()
    try:
        assert run()() is None
    finally:
        gc.enable()


def test_a_backward_device_thread_draws_at_the_callers_rows():
    """The autograd engine runs a CUDA backward on a device thread under the caller's
    thread state - the kernels' handler included - but none of the caller's context
    variables: a recomputed dropout there must still draw at the step's rows (here the
    second half of a batch of 8, in a microbatch). Simulated on CPU: another thread handed
    this thread's state as the engine hands it."""
    from device_threads import on_a_device_thread

    x = torch.ones(2, 6)
    compile_rng.manual_seed(9)
    with compile_rng.step(4, rows=[4, 5, 6, 7], global_batch=8) as s:
        for _ in range(2):  # the second microbatch: rows 6 and 7
            with s.microbatch(2):
                start = compile_rng.get_state()
                here = F.dropout(x, 0.5)
                compile_rng.set_state(*start)  # the recomputation draws at the forward's position
                there = on_a_device_thread(lambda: F.dropout(x, 0.5))
    compile_rng.manual_seed(9)
    with compile_rng.step(8):
        whole = F.dropout(torch.ones(8, 6), 0.5)
    assert torch.equal(here, whole[6:]) and torch.equal(there, here)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("rows", [{}, {"rows": [4, 5, 6, 7], "global_batch": 8}], ids=["whole", "second half"])
def test_an_eager_step_with_activation_checkpointing_recomputes_its_masks(reentrant, rows):
    """torch.utils.checkpoint recomputes a dropout in backward after setting torch's CPU
    generator state back; compile_rng's CPU stream goes back with it, so the recomputation
    draws the forward's mask: the gradients equal the uncheckpointed run's bitwise (they
    differed by ~1.7 before, in every eager step on CPU)."""
    from torch.utils.checkpoint import checkpoint

    lin = torch.nn.Linear(32, 32)

    def block(t):
        return F.dropout(lin(t), 0.3)

    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    grads, states = [], []
    for ckpt in (False, True):
        part = x.clone().requires_grad_()
        compile_rng.manual_seed(4)
        with compile_rng.step(4, **rows):
            out = checkpoint(block, part, use_reentrant=reentrant) if ckpt else block(part)
            out.square().sum().backward()
        grads.append(part.grad)
        states.append(compile_rng.get_state())
    assert torch.equal(grads[0], grads[1]) and states[0] == states[1]


def test_a_cpu_generator_state_set_back_sets_the_stream_back():
    """Outside checkpointing too: ``torch.set_rng_state`` of a state ``torch.get_rng_state``
    handed out puts compile_rng's CPU stream where it was then; a state from elsewhere (a
    file, a clone) leaves the stream alone."""
    compile_rng.manual_seed(1)
    saved = torch.get_rng_state()
    with compile_rng.step(4):
        first = torch.rand(4, 3)
    torch.set_rng_state(saved)
    with compile_rng.step(4):
        again = torch.rand(4, 3)
    assert torch.equal(first, again)
    moved = compile_rng.get_state()
    torch.set_rng_state(saved.clone())
    assert compile_rng.get_state() == moved


def test_without_a_cpp_compiler_the_python_kernels_serve(monkeypatch, tmp_path):
    """Where the C++ kernels cannot be built, one warning says what it costs, the Python
    kernels sit at the backend keys themselves, and a step draws the same values."""
    from compile_rng.eager import native_kernels

    x = torch.ones(8, 4)
    compile_rng.set_state(5, 0)
    with compile_rng.step(8):
        native = F.dropout(x, 0.5), torch.randperm(6)
    compile_rng.uninstall()
    monkeypatch.setenv("COMPILE_RNG_CACHE", str(tmp_path))
    monkeypatch.setattr(native_kernels, "_compiler", lambda: None)
    native_kernels.load.cache_clear()
    try:
        compile_rng.set_state(5, 0)
        with pytest.warns(RuntimeWarning, match=r"could not build its C\+\+ random-op kernels .no C\+\+ compiler"):
            with compile_rng.step(8):
                fallback = F.dropout(x, 0.5), torch.randperm(6)
        cpu = [line for line in torch._C._dispatch_dump_table("aten::bernoulli_.float").splitlines()
               if line.startswith("CPU:")]
        assert "compile_rng/installation.py" in cpu[0], cpu  # a Python registration, not the C++ one
        assert _compile_rng_frames(lambda: torch.rand(3)) != []  # the price: Python outside streams too
    finally:
        compile_rng.uninstall()
        monkeypatch.undo()
        native_kernels.load.cache_clear()
        compile_rng.install()
    assert all(torch.equal(a, b) for a, b in zip(native, fallback))


@pytest.mark.skipif(not stream_key_in_thread_state(), reason="torch 2.11 and 2.12: the kernels sit at the backend keys")
def test_a_higher_order_op_runs_eagerly_in_a_step():
    """A higher-order op reads the thread's included keys itself and raised at the stream's
    key (it has no kernel there) until it was told to pass it, as it passes BackendSelect:
    ``torch.cond`` run eagerly in a step gives what it gives outside one, and a HOP made
    later passes the key too (torch's default list holds it)."""
    x = torch.arange(4.0)

    def run():
        return torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t - 1, (x,))

    outside = run()
    with compile_rng.step(4):
        inside = run()
    assert torch.equal(inside, outside)
    from compile_rng.eager import native_kernels

    defaults, _ = core_internals.higher_order_op_defaults()
    assert core_internals.numbered_dispatch_key(native_kernels.load().LIVE_KEY) in defaults


def test_a_step_under_torchs_python_dispatcher_draws_the_stream():
    """torch keeps its Python dispatcher's key in every keyset a kernel redispatches with
    (``make_fx(pre_dispatch=True)`` turns the dispatcher on): it names no backend, so the
    draws under it are the stream's, as without it (they drew torch's values silently, or
    raised a KeyError, before)."""
    from torch._dispatch.python import enable_python_dispatcher

    def draws(dispatcher: bool):
        compile_rng.set_state(7, 0)
        with compile_rng.step(4), enable_python_dispatcher() if dispatcher else contextlib.nullcontext():
            values = [F.dropout(torch.ones(4, 4), 0.5), torch.rand(4, 3), torch.empty(4, 2).uniform_()]
        return values, compile_rng.get_state()

    plain, under = draws(False), draws(True)
    assert plain[1] == under[1] and plain[1][1] > 0
    assert all(torch.equal(a, b) for a, b in zip(plain[0], under[0]))


@pytest.mark.skipif(not stream_key_in_thread_state(), reason="torch 2.11 and 2.12: the kernels sit at the backend keys")
def test_uninstall_inside_a_guard_leaves_no_key_behind():
    """A layout block is no stream (``uninstall()`` is allowed in it), but it holds a guard
    and the key: its random ops after ``uninstall()`` meet the kept kernels with their lane
    cleared and run as before it (a plain tensor's: torch's values), and leaving the block
    takes the key out all the same."""
    def included() -> bool:
        return "Fake" in str(torch._C._dispatch_tls_local_include_set())

    def draws() -> list[torch.Tensor]:
        return [torch.rand(2), F.dropout(torch.ones(8), 0.5), torch.randn(3)]

    torch.manual_seed(3)
    stock = draws() + draws()
    try:
        torch.manual_seed(3)
        with compile_rng.layout("invariant"):
            drawn = draws()  # the guard is held while a random op runs
            compile_rng.uninstall()
            assert included()
            drawn += draws()
        assert not included()
    finally:
        compile_rng.install()
    assert all(torch.equal(a, b) for a, b in zip(drawn, stock))


TAKEN_KEY = r"""
import sys, warnings, torch
from torch.library import Library, fallthrough_kernel
taken = Library("_", "IMPL")
taken.fallback(fallthrough_kernel, "Fake")  # another fallback at the key, first
import compile_rng
compile_rng.set_state(7, 0)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with compile_rng.step(4):
        values = [torch.nn.functional.dropout(torch.ones(4, 4), 0.5), torch.rand(4, 3)]
assert any("cannot sit at torch's Fake dispatch key" in str(w.message) for w in caught), [str(w.message) for w in caught]
torch.save((values, compile_rng.get_state()), sys.argv[1])
"""


@pytest.mark.skipif(not stream_key_in_thread_state(), reason="torch 2.11 and 2.12: the kernels sit at the backend keys")
def test_with_the_key_taken_the_backend_keys_serve(tmp_path):
    """Where another fallback already holds the key (a fake-tensor backend's: the key is
    torch's, unused in 2.11-2.15), the kernels go to the backend keys with a warning, and a
    step draws the stream's values (they drew torch's, silently, when the failed
    registration was taken for done)."""
    import subprocess

    out = tmp_path / "draws.pt"
    subprocess.run([sys.executable, "-c", TAKEN_KEY, str(out)], check=True, timeout=300)
    values, state = torch.load(out)
    compile_rng.set_state(7, 0)
    with compile_rng.step(4):
        expected = [F.dropout(torch.ones(4, 4), 0.5), torch.rand(4, 3)]
    assert state == compile_rng.get_state()
    assert all(torch.equal(a, b) for a, b in zip(values, expected))
