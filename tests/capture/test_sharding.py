"""capture/sharding.py: how capture and planning see modules FSDP2 (``fully_shard``) shards."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from fxckpt.capture.sharding import (full_parameters, is_fsdp, parameter_owners, recomputable,
                                     root_gathered, sharding_key)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4)))
        self.head = nn.Linear(4, 2)


def test_parameter_owners_are_the_outermost_modules_holding_parameters() -> None:
    assert parameter_owners(Net()) == ("body.0", "body.2.0", "head")  # the root is left out


def test_plain_modules_are_not_fsdp_and_their_key_says_so() -> None:
    import torch.distributed.fsdp  # noqa: F401  (the key is empty until FSDP is imported)

    model = Net()
    assert not is_fsdp(model) and not recomputable(model.body)
    assert sharding_key(model) == (False,) * (1 + len(list(model.modules())))


def test_plain_parameters_are_left_alone() -> None:
    model = Net()
    before = [id(p) for p in model.parameters()]
    with full_parameters(model):
        assert [id(p) for p in model.parameters()] == before
    with root_gathered(model, model):  # nothing sharded: nothing to gather, no error
        assert [id(p) for p in model.parameters()] == before


@pytest.mark.slow
def test_a_sharded_model_seen_by_capture_on_one_gloo_rank() -> None:
    """FSDP needs a process group: one rank over gloo, in a fresh process."""
    script = textwrap.dedent('''
        import os, torch, torch.distributed as dist, torch.nn as nn
        from torch.distributed.fsdp import fully_shard
        from fxckpt.capture.sharding import *
        from fxckpt.errors import CaptureError
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
        dist.init_process_group("gloo", rank=0, world_size=1)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        fully_shard(model[0])
        assert is_fsdp(model[0]) and not is_fsdp(model[1])
        assert recomputable(model[0])
        model[0].register_forward_hook(lambda m, i, o: None)
        assert not recomputable(model[0])  # a hook of the user's: never run again
        assert sharding_key(model) == (False, False, True, False)
        assert parameter_owners(model) == ("1",)
        with full_parameters(model):
            w = model[0]._parameters["weight"]
            assert type(w) is nn.Parameter and w.shape == (8, 4) and w.stride() == (0, 0)
        assert type(model[0]._parameters["weight"]).__name__ == "DTensor"
        root = nn.Linear(4, 4)
        fully_shard(root)
        assert type(root.weight).__name__ == "DTensor"
        with root_gathered(root, root):  # gathered for a capture outside forward
            assert type(root.weight) is nn.Parameter and root.weight.shape == (4, 4)
        assert type(root.weight).__name__ == "DTensor"  # sharded again
        other = nn.Module()  # DTensor parameters that no fully_shard on this root manages
        other._parameters = root._parameters
        try:
            with root_gathered(other, other):
                pass
        except CaptureError as e:
            assert "own parameters ['weight', 'bias'] are sharded (DTensor)" in str(e)
            assert "fully_shard" in str(e)
        else:
            raise AssertionError("a root FSDP does not manage was not refused")
        dist.destroy_process_group()
        print("ok")
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip().endswith("ok"), done.stderr[-2000:]
