"""planner.enable on transformers decoders called as a plain loop calls them, `model(**batch).loss.backward()`, with
`use_cache` left at the library's default: the cache each forward makes reaches every decoder layer. The blocks are
planned all the same (keyed by the cache's class, traced without it), train as eager does, and the cache a step
returns holds each layer's keys once, as eager's does (tiny configs, random weights, nothing downloaded)."""
from __future__ import annotations

import copy

import pytest
import torch

import planner
from planner.tools.baselines import per_block_checkpointed
from planner.tools.measure import measure_peak_bytes

T = pytest.importorskip("transformers")

LIMIT_S = 2.0  # per new block shape
WIDTH, HEADS, LAYERS, VOCAB, BATCH, SEQ = 32, 2, 2, 128, 2, 16


def _model(name: str) -> torch.nn.Module:
    """A 2-layer decoder of width 32 (the library's config defaults otherwise), in train mode, weights drawn under
    seed 0."""
    attention = dict(num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=HEADS,
                     intermediate_size=2 * WIDTH, vocab_size=VOCAB)
    kv = dict(num_key_value_heads=HEADS)
    if name == "llama":  # the repo's own (examples/hf_zoo.py), its batch's use_cache=False left out below
        from examples.hf_zoo import build
        return build("llama", "test", batch=BATCH)[0]
    made = {
        "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**attention, **kv)),
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**attention, **kv)),
        "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(**attention, **kv, pad_token_id=0)),  # its default is 32000
        "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**attention)),
        "olmo2": lambda: T.Olmo2ForCausalLM(T.Olmo2Config(**attention, **kv)),
        "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**attention, **kv, head_dim=WIDTH // HEADS)),
    }[name]
    torch.manual_seed(0)
    return made().train()


@pytest.fixture
def enable():
    """planner.enable, each model disabled after the test (nothing of the planner's left on the thread)."""
    models = []

    def on(model, budget_gb: float, **options):
        models.append(model)
        return planner.enable(model, budget_gb, time_limit_s=LIMIT_S, **options)
    yield on
    for model in models:
        planner.disable(model)


def _batch() -> dict:
    """input_ids, attention_mask (the second row padded: the mask code's data-dependent path) and labels (-100 on
    the padding); no use_cache."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -5:] = 0
    labels = ids.clone()
    labels[1, -5:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _cache(out):
    for field in ("cache", "past_key_values"):  # transformers 5 names it `cache`
        c = out.get(field) if hasattr(out, "get") else getattr(out, field, None)
        if c is not None:
            return c
    return None


def _key_shapes(cache) -> list:
    """Each layer's cached keys' shape (None for a layer the cache holds nothing of)."""
    if hasattr(cache, "layers"):
        return [tuple(k.shape) if (k := getattr(layer, "keys", None)) is not None and k.numel() else None
                for layer in cache.layers]
    return [tuple(k.shape) if k.numel() else None for k in cache.key_cache]  # transformers 4


def _step(model, opt, batch: dict, seed: int):
    torch.manual_seed(seed)
    out = model(**batch)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out.loss.detach(), _cache(out)


@pytest.mark.parametrize("name", ["qwen2", "mistral", "phi3", "gpt_neox", "olmo2", "gemma2", "llama"])
def test_a_plain_loop_with_the_default_cache_trains_as_eager(name, enable):
    model, batch = _model(name), _batch()
    torch.manual_seed(0)
    budget = measure_peak_bytes(per_block_checkpointed(model), batch)
    eager = copy.deepcopy(model)
    state = enable(model, budget / 1e9)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    opt_p = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for k in range(3):
        (le, ce), (lp, cp) = _step(eager, opt_e, batch, k), _step(model, opt_p, batch, k)
        assert torch.equal(le, lp), k
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            assert torch.equal(p, q), (k, n)
        # the cache: each layer's keys once, as eager's, where the block ran with it (a planned block's schedule,
        # traced without it, leaves its layer's entry empty)
        assert ce is not None and cp is not None, k
        expected = _key_shapes(ce)
        assert all(s is not None for s in expected)
        options = state.records[-1].options
        assert _key_shapes(cp) == [None if o.startswith("planned") else s for o, s in zip(options, expected)], \
            (k, options)
    # one profile for the blocks (a fresh cache per call, keyed by its class), and the steps after the measuring one
    # planned from it, within the budget
    assert len(state.profiles) == 1, state.summary()
    assert [r.mode for r in state.records] == ["measure", "planned", "planned"]
    assert any(o != "kept" for r in state.records for o in r.options)
    torch.manual_seed(3)
    assert measure_peak_bytes(model, batch) <= budget


def test_the_measuring_step_leaves_the_cache_as_eager_does(enable):
    """Every block checkpointed (the measuring call): the backward's recomputation does not update the cache again."""
    model, batch = _model("qwen2"), _batch()
    eager = copy.deepcopy(model)
    state = enable(model, 1.0)
    torch.manual_seed(0)
    out_e = eager(**batch)
    out_e.loss.backward()
    torch.manual_seed(0)
    out_p = model(**batch)
    assert state.records[-1].options == ["checkpointed"] * LAYERS
    before = _key_shapes(_cache(out_p))
    out_p.loss.backward()
    shapes = _key_shapes(_cache(out_p))
    assert shapes == before == _key_shapes(_cache(out_e)) == [(BATCH, HEADS, SEQ, WIDTH // HEADS)] * LAYERS
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_a_cache_with_earlier_content_is_read_by_the_blocks_and_updated_once(enable):
    """A cache passed in with a prefix (as prefix tuning does): the blocks read it, so they get no schedule traced
    without it (planned=True); the recomputation rebuilds the prefix and the new states, and the gradients reach the
    prefix."""
    model = _model("qwen2")
    prefix = [torch.nn.Parameter(torch.randn(BATCH, HEADS, 4, WIDTH // HEADS)) for _ in range(2)]

    def step(m):
        m.zero_grad(set_to_none=True)
        for p in prefix:
            p.grad = None
        cache = T.DynamicCache(config=m.config)
        for layer in range(LAYERS):
            cache.update(prefix[0] * (layer + 1), prefix[1] * (layer + 1), layer)
        batch = _batch()
        batch["attention_mask"] = torch.cat([torch.ones(BATCH, 4, dtype=torch.long), batch["attention_mask"]], 1)
        m(**batch, past_key_values=cache).loss.backward()
        return [p.grad for p in m.parameters()] + [p.grad for p in prefix], _key_shapes(cache)

    eager_grads, eager_shapes = step(model)
    assert eager_shapes == [(BATCH, HEADS, 4 + SEQ, WIDTH // HEADS)] * LAYERS
    state = enable(model, 1.0, planned=True)
    for _ in range(2):  # the measuring call (checkpointed), then the chosen options (kept, at this budget)
        grads, shapes = step(model)
        assert shapes == eager_shapes
        assert all(torch.equal(g, h) for g, h in zip(grads, eager_grads))
    (profile,) = state.profiles.values()
    assert "reads its cache" in profile.note and not profile.plans
    assert {"kept", "checkpointed"} <= {o.kind.value for o in profile.options} <= {"kept", "checkpointed", "selective"}
    # the hand-written baseline (planner.tools.baselines) recomputes with the prefix rebuilt too
    grads, shapes = step(per_block_checkpointed(_model("qwen2")))
    assert shapes == eager_shapes and all(torch.equal(g, h) for g, h in zip(grads, eager_grads))


def test_selective_blocks_with_the_default_cache_train_as_eager(enable, monkeypatch):
    """Selective blocks (their policy's overhead taken as free: at this width it outweighs every recompute saved) run
    the cache's update in their forward, and their recomputation answers it from the record without the save policy
    seeing either (capture.kv_cache): parameters and the cache as eager's."""
    import planner.inplace.option_costs as option_costs
    from capture.measure_memory import StorageTracker, storage_bytes

    monkeypatch.setattr(option_costs, "SELECTIVE_OP_SECONDS", 0.0)
    model, batch = _model("qwen2"), _batch()
    low = measure_peak_bytes(per_block_checkpointed(model), batch)
    tracker = StorageTracker()
    with tracker:
        copy.deepcopy(model)(**batch).loss.backward()
    high = tracker.peak_bytes + storage_bytes(list(model.parameters()))
    eager = copy.deepcopy(model)
    state = enable(model, (low + (high - low) / 5) / 1e9)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    opt_p = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for k in range(3):
        (le, ce), (lp, cp) = _step(eager, opt_e, batch, k), _step(model, opt_p, batch, k)
        assert torch.equal(le, lp) and _key_shapes(cp) == _key_shapes(ce), k
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager.parameters())), k
    assert any(o.startswith("selective@") for o in state.records[-1].options), state.explain()
