"""Every function on the export allowlist, called with forged arguments, in a child process.

A loaded export's graph calls only names of the allowlist, but with the arguments the file
gives. So each of them must keep the process alive whatever those are: the kernel's own checks
must raise, never crash or hang. ``python tests/export/fuzz_ops.py PROGRESS [START]`` calls
every entry with :data:`COMBOS` argument lists drawn from pools of hostile values (empty,
huge and negative sizes, NaN, stride-0 and non-contiguous tensors, wrong dtypes, mismatched
lists), writing ``index combo`` to ``PROGRESS`` before each call. The parent
(``tests/export/test_fuzz_ops.py``) restarts it past any call that killed it and names the
function. Memory is capped (``RLIMIT_AS``) so a forged size fails to allocate instead of
swapping, and each call has 10 s (``SIGALRM``, default action: the process dies, a hang).
"""

from __future__ import annotations

import random
import resource
import signal
import sys
import warnings
from typing import Any, Callable

import torch
import torch.utils._pytree

COMBOS = 96
MEMORY_CAP = 6 << 30
SECONDS = 10


def _tensors() -> list[torch.Tensor]:
    t = torch.arange(6.0).reshape(2, 3)
    return [
        torch.empty(0), torch.tensor(2.5), torch.randn(3), t, t.t(), t.expand(4, 2, 3),
        torch.tensor([-5, 2**40, 3]), torch.tensor([True, False]),
        torch.full((2, 2), float("nan"), dtype=torch.float64),
        torch.tensor([2**31 - 1, -(2**31), 7], dtype=torch.int32), torch.randn(1, 1, 1, 1),
        torch.randn(2, 3, 4, 5), torch.zeros(3, 0, 2), torch.tensor([1, 0], dtype=torch.uint8),
    ]


INTS = [-1, 0, 1, 3, 2**31, 2**62, -(2**62)]
LISTS: list[list[int]] = [[], [-1], [0], [2**40], [3, -2], [1] * 10, [2**20, 2**20], [2, 3],
                          [1 << 20], [1 << 10], [64, 64], [1, 1 << 16]]
FLOATS = [float("nan"), float("inf"), -1.0, 0.0, 1e308]


def _pool(type_name: str, tensors: list[torch.Tensor]) -> list[Any]:
    """Hostile values for an argument of this schema type (``str(argument.real_type)``)."""
    if type_name.startswith("Optional[") and type_name.endswith("]"):
        return _pool(type_name[len("Optional["):-1], tensors) + [None]
    lists: dict[str, list[Any]] = {
        "List[int]": LISTS, "List[float]": [[], [float("nan")], [-1.0, 2.0]],
        "List[bool]": [[True, False, True], []],
        "List[Tensor]": [[], [tensors[2], tensors[3]], [tensors[0]], [tensors[6], tensors[7]]],
        "List[Optional[Tensor]]": [[None], [tensors[6]], [tensors[7], None], [tensors[9]]],
    }
    pools: dict[str, list[Any]] = {
        "Tensor": tensors, "int": INTS, "float": FLOATS,
        "number": [-1, 2**62, float("nan"), True, 0.5], "bool": [True, False],
        "str": ["mean", "", "x" * 100, "none"],
        "ScalarType": [torch.float64, torch.int8, torch.bool, torch.complex64],
        "Layout": [torch.strided, torch.sparse_coo], "Device": ["cpu", "meta"],
        "MemoryFormat": [torch.contiguous_format, torch.channels_last],
    }
    return lists.get(type_name) or pools.get(type_name) or [None]


def _aten_calls(op: Any, rng: random.Random, tensors: list[torch.Tensor]) -> list[tuple]:
    schema = op._schema
    calls = []
    for _ in range(COMBOS):
        args, kwargs = [], {}
        for a in schema.arguments:
            if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write:
                continue  # out=: where an out-variant writes
            value = rng.choice(_pool(str(a.real_type), tensors))
            if a.kwarg_only:
                kwargs[a.name] = value
            else:
                args.append(value)
        calls.append((tuple(args), kwargs))
    return calls


def _python_calls(rng: random.Random, tensors: list[torch.Tensor]) -> list[tuple]:
    pool: list[Any] = [*tensors, *INTS, *LISTS[:4], *FLOATS[:3], None, True, "x"]
    calls = []
    for _ in range(COMBOS):
        arity = rng.randint(0, 4)
        calls.append((tuple(rng.choice(pool) for _ in range(arity)), {}))
    return calls


def functions() -> list[tuple[str, Callable[..., Any]]]:
    """Every function the allowlist holds, resolved as a load would."""
    from fxckpt.export.allowlist import allowlist
    from fxckpt.export.targets import resolve_function

    return [(name, resolve_function(name, "fuzz")) for name in sorted(allowlist().functions)]


def calls_of(name: str, fn: Any) -> list[tuple]:
    rng = random.Random(name)
    tensors = _tensors()
    if isinstance(fn, torch._ops.OpOverload):
        return _aten_calls(fn, rng, tensors)
    return _python_calls(rng, tensors)


def _use(out: Any) -> None:
    """Read every tensor the call returned: a view past its storage crashes only when read."""
    for t in torch.utils._pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.numel() and not t.is_meta:
            t.detach().float().sum().item()


def main(progress: str, start: int = 0) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    entries = functions()
    with open(progress, "a") as log:
        for index in range(start, len(entries)):
            name, fn = entries[index]
            for combo, (args, kwargs) in enumerate(calls_of(name, fn)):
                log.write(f"{index} {combo}\n")
                log.flush()
                signal.alarm(SECONDS)
                try:
                    _use(fn(*args, **kwargs))
                except BaseException as e:  # noqa: B036 - any raise is the check holding
                    if isinstance(e, (KeyboardInterrupt, SystemExit)):
                        raise
                signal.alarm(0)
        log.write(f"done {len(entries)}\n")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
