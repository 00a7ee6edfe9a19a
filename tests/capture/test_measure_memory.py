"""capture.measure_memory's walks: storage bytes of any pytree, a module's tensors as torch's generators give them."""
from __future__ import annotations

import torch

from capture.measure_memory import module_tensors, named_parameters, storage_bytes


def test_storage_bytes_counts_each_storage_once_in_any_pytree():
    a = torch.zeros(10)  # 40 bytes
    b = torch.zeros(3, dtype=torch.float64)  # 24 bytes
    view = a[2:5]
    tree = [a, (view, {"b": b, "n": None, "k": 3, "s": "x"}), [[b]], object()]
    assert storage_bytes(tree) == 64
    assert storage_bytes({"a": a}) == 40 and storage_bytes(view) == 40 and storage_bytes([]) == 0


def test_module_tensors_match_torchs_generators_with_shared_modules_and_parameters():
    shared = torch.nn.Linear(3, 3)
    model = torch.nn.Sequential(shared, torch.nn.BatchNorm1d(3), torch.nn.Sequential(shared, torch.nn.Linear(3, 2)))
    model[2][1].weight = model[0].weight  # a parameter reached by two names
    params, buffers = module_tensors(model)
    assert [id(p) for p in params] == [id(p) for p in model.parameters()]
    assert [id(b) for b in buffers] == [id(b) for b in model.buffers()]
    assert [(n, id(p)) for n, p in named_parameters(model)] == [(n, id(p)) for n, p in model.named_parameters()]
