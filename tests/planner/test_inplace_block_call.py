"""A block's call read again from the previous block's (BlockCall.again): the same key and tensors as BlockCall.of,
or None where the call is not that call again."""
import pytest
import torch

from planner.inplace.block_region import BlockCall, parameter_flags

transformers = pytest.importorskip("transformers")


def _layer_calls():
    """Each decoder layer's (layer, args, kwargs) in one training call of a width-64 Qwen2 with the library's
    defaults (a key/value cache made by the model, passed to every layer)."""
    config = transformers.Qwen2Config(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128, vocab_size=128)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).train()
    calls = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, a, k: calls.append((m, a, dict(k))), with_kwargs=True)
    ids = torch.randint(0, 128, (2, 9))
    model(input_ids=ids, labels=ids)
    return calls


def test_a_decoders_next_layer_call_is_read_again_with_the_key_of_BlockCall_of():
    calls = _layer_calls()
    block0, args0, kwargs0 = calls[0]
    first, tensors0 = BlockCall.of(block0, args0, kwargs0)
    for block, args, kwargs in calls[1:]:
        call, tensors = BlockCall.of(block, args, kwargs)
        again = first.again(block, args, kwargs, (len(args0), kwargs0, tensors0[len(args0):]), parameter_flags(block))
        assert again is not None and call.key == first.key
        assert len(again) == len(tensors) and all(a is b for a, b in zip(again, tensors))


def test_a_call_that_differs_is_not_read_again():
    calls = _layer_calls()
    block0, args0, kwargs0 = calls[0]
    first, tensors0 = BlockCall.of(block0, args0, kwargs0)
    last = (len(args0), kwargs0, tensors0[len(args0):])
    block, args, kwargs = calls[1]
    flags = parameter_flags(block)
    assert first.again(block, args, kwargs, last, flags) is not None
    # a keyword argument another object (an equal copy), or one that can change in place (a list)
    assert first.again(block, args, {**kwargs, "position_ids": kwargs["position_ids"].clone()}, last, flags) is None
    listed = {**kwargs0, "extra": [1]}
    assert first.again(block, args, {**kwargs, "extra": listed["extra"]}, (len(args0), listed, last[2]),
                       flags) is None
    # keyword arguments in another order, another number of positional arguments
    assert first.again(block, args, dict(reversed(list(kwargs.items()))), last, flags) is None
    assert first.again(block, (*args, args[0]), kwargs, last, flags) is None
    # hidden states of another shape, or no longer requiring grad
    assert first.again(block, (args[0][:, :5],), kwargs, last, flags) is None
    assert first.again(block, (args[0].detach(),), kwargs, last, flags) is None
    # the block in eval mode, or a parameter frozen
    block.eval()
    assert first.again(block, args, kwargs, last, parameter_flags(block)) is None
    block.train()
    next(block.parameters()).requires_grad_(False)
    assert first.again(block, args, kwargs, last, parameter_flags(block)) is None
