"""Shared pieces of the planner tests: model configurations where activations dominate, and eager references."""
from __future__ import annotations

import copy

import torch

from tests.models import MAKERS

# Sizes chosen so that activations, not parameters, dominate the peak: then 50 % of checkpoint-all's peak
# is a feasible budget for every model.
CONFIGS = {
    "mlp": dict(batch=512, depth=16),
    "cnn": dict(batch=8, size=32),
    "gpt": dict(batch=2, seq=64, vocab=128, n_layers=4),
    "unet": dict(batch=1, size=64),
}
TIME_LIMIT_S = 3.0


def make(name: str):
    return MAKERS[name](**CONFIGS[name])


def eager_state(model: torch.nn.Module, x, seed: int = 7):
    """Gradients and buffers of one eager step of a copy of `model` under `torch.manual_seed(seed)`."""
    from harness.eager_compare import step_state

    return step_state(copy.deepcopy(model), x, seed=seed)


def assert_same_state(got, want) -> None:
    g_grads, g_bufs, g_loss = got
    w_grads, w_bufs, w_loss = want
    assert g_grads.keys() == w_grads.keys()
    for k in w_grads:
        a, b = g_grads[k], w_grads[k]
        assert (a is None) == (b is None), k
        assert a is None or torch.equal(a, b), f"gradient of {k} differs: max {(a - b).abs().max().item()}"
    assert g_bufs.keys() == w_bufs.keys()
    for k in w_bufs:
        assert torch.equal(g_bufs[k], w_bufs[k]), f"buffer {k} differs"
    assert torch.equal(g_loss, w_loss)


def tiny_mixtral(seeds=(1,)):
    """A mixture-of-experts decoder nobody here wrote: Mixtral from a tiny config (2 layers of width 32, 4 experts,
    2 per token; random weights under seed 0), in train mode, and one batch of 2 rows of 24 tokens per seed in
    `seeds` (labels the input ids, no cache)."""
    import transformers

    cfg = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                     num_key_value_heads=2, vocab_size=128, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).train()
    batches = []
    for seed in seeds:
        ids = torch.randint(1, 128, (2, 24), generator=torch.Generator().manual_seed(seed))
        batches.append({"input_ids": ids, "labels": ids, "use_cache": False})
    return model, batches


def on_a_thread_of_its_own(fn) -> None:
    """fn() on a new thread, whose dispatch mode stack starts empty (models enabled by earlier tests of this process
    may hold a measuring probe on the main thread's until their next call); its exception re-raised here."""
    import threading

    box = {}

    def target():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e
    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]


def farthest(a, b) -> float:
    """The largest elementwise distance between two models' parameters."""
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
