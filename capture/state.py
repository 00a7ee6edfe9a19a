"""The process state a step reads besides its tensors, each read one way: the autocast state, and the random
generators and buffers that a measurement or a trace must leave as it found them."""
from __future__ import annotations

import contextlib
import random
from typing import Any, Iterator

import torch

try:  # a project dependency; the generators are restored without it all the same
    import numpy
except ImportError:  # pragma: no cover
    numpy = None

AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_state() -> tuple[tuple[str, str], ...]:
    """(device type, dtype name) of each device type whose autocast is on now, () when none is: what a traced graph's
    casts depend on (a disabled device's dtype setting changes nothing and is left out)."""
    return tuple((d, str(torch.get_autocast_dtype(d)).replace("torch.", "")) for d in AUTOCAST_DEVICES
                 if torch.is_autocast_enabled(d))


def describe_autocast(state) -> str:
    return " and ".join(f"autocast({d}, {t})" for d, t in state) if state else "no autocast"


@contextlib.contextmanager
def autocast_as(state) -> Iterator[None]:
    """Run under the autocast `state` (as `autocast_state()` returns it), on another thread say."""
    with contextlib.ExitStack() as stack:
        for d, dtype in state:
            stack.enter_context(torch.autocast(d, dtype=getattr(torch, dtype)))
        yield


def cuda_devices_in_use() -> list[int]:
    """The CUDA device whose generator a forward may draw from ([] without CUDA, or before CUDA is initialised)."""
    return [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []


def host_rng_state() -> tuple[Any, Any]:
    """The state of Python's global generator (`random`) and of numpy's (`numpy.random`; None without numpy): the
    generators a forward may draw from besides torch's."""
    return random.getstate(), (numpy.random.get_state() if numpy is not None else None)


def set_host_rng_state(state: tuple[Any, Any]) -> None:
    """Put Python's and numpy's global generators back to `state` (as `host_rng_state()` returned it)."""
    python_state, numpy_state = state
    random.setstate(python_state)
    if numpy is not None and numpy_state is not None:
        numpy.random.set_state(numpy_state)


def drawn_host_generators(a: tuple[Any, Any], b: tuple[Any, Any]) -> list[str]:
    """The host generators that were drawn from between two `host_rng_state()` results: "random" (Python's) and
    "numpy.random" (numpy's global generator), [] when neither was."""
    (python_a, numpy_a), (python_b, numpy_b) = a, b
    drawn = [] if python_a == python_b else ["random"]
    return drawn if _same_numpy_state(numpy_a, numpy_b) else [*drawn, "numpy.random"]


def _same_numpy_state(a: Any, b: Any) -> bool:
    """Whether two `numpy.random.get_state()` tuples (or None, without numpy) are one state."""
    if a is None or b is None:
        return a is b
    return a[0] == b[0] and tuple(a[2:]) == tuple(b[2:]) and bool((a[1] == b[1]).all())


def same_host_rng(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    """Whether two `host_rng_state()` results are one state (nothing was drawn between them)."""
    return not drawn_host_generators(a, b)


_MT19937_STATE_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624], int pos


def _numpy_generator_bytes() -> tuple[Any, bytes] | None:
    """(numpy's global bit generator, its MT19937 state read in place), or None where it is another generator or
    numpy has no `get_bit_generator` (before 1.25): a few bytes copied where `numpy.random.get_state()` builds a
    tuple (0.6 against 33 us here)."""
    get = getattr(numpy.random, "get_bit_generator", None) if numpy is not None else None
    if get is None:
        return None
    generator = get()
    if type(generator).__name__ != "MT19937":
        return None
    import ctypes

    return generator, ctypes.string_at(generator.ctypes.state_address, _MT19937_STATE_BYTES)


def host_rng_mark() -> tuple[Any, Any]:
    """`host_rng_state()` now, with what `drew_from_host` needs to tell cheaply whether anything was drawn after."""
    return host_rng_state(), _numpy_generator_bytes()


def drew_from_host(mark: tuple[Any, Any]) -> bool:
    """Whether Python's or numpy's global generator was drawn from (or set) since `mark` (`host_rng_mark()`), as
    `not same_host_rng(mark's state, host_rng_state())` says, with numpy's generator read in place: every numpy draw
    moves its MT19937 state but one, a normal taken from the cached second value of a pair (legacy `has_gauss`),
    which the full state is compared for where that value was cached."""
    (python_state, numpy_state), raw = mark
    if random.getstate() != python_state:
        return True
    if numpy is None or numpy_state is None:
        return False
    has_gauss = numpy_state[3]
    if raw is not None and not has_gauss:
        now = _numpy_generator_bytes()
        return now is None or now[0] is not raw[0] or now[1] != raw[1]
    return not _same_numpy_state(numpy_state, numpy.random.get_state())


@contextlib.contextmanager
def restored_rng(devices=()) -> Iterator[None]:
    """The CPU generator and the CUDA ones in use (and of `devices`, CUDA indices) restored on exit, whatever ran
    (torch.random.fork_rng), and Python's and numpy's global generators (`host_rng_state`)."""
    host = host_rng_state()
    try:
        with torch.random.fork_rng(devices=sorted(set(cuda_devices_in_use()) | set(devices))):
            yield
    finally:
        set_host_rng_state(host)


@contextlib.contextmanager
def restored(module: torch.nn.Module, devices=()) -> Iterator[None]:
    """Run work that must leave no trace: the generators (torch's CPU and CUDA ones, Python's, numpy's) and the
    module's buffers (BatchNorm's running statistics, a step counter) restored on exit."""
    saved = {n: b.detach().clone() for n, b in module.named_buffers()}
    with restored_rng(devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for n, b in module.named_buffers():
                    b.copy_(saved[n])


@contextlib.contextmanager
def swapped_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> Iterator[None]:
    """Within: every slot of `model` (any submodule's parameter or buffer entry) that holds the tensor named in
    `state` (by its first name, as named_parameters() gives it) holds `state`'s replacement instead; leaving puts each
    slot's own tensor back. What torch.func.functional_call(..., tie_weights=True) does, except that a submodule
    reachable by two paths is swapped and restored once (torch 2.13's swaps it once per path and restores the second
    path's swap last, leaving the replacement, a traced FunctionalTensor, in the user's model)."""
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    new_of = {id(named[k]): v for k, v in state.items() if k in named}
    slots = []
    seen: set[int] = set()
    for module in model.modules():  # each module object once, however many paths reach it
        if id(module) in seen:
            continue
        seen.add(id(module))
        for table in (module._parameters, module._buffers):
            for key, tensor in table.items():
                if tensor is not None and id(tensor) in new_of:
                    slots.append((table, key, tensor))
    try:
        for table, key, tensor in slots:
            table[key] = new_of[id(tensor)]
        yield
    finally:
        for table, key, tensor in slots:
            table[key] = tensor
