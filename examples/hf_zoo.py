"""Real architectures nobody here wrote: `transformers` models built from small configs with random weights
(nothing is downloaded), each with the batch its users pass (`model(**batch)`).

`build(name, size, labels)` -> (model in train mode, batch). With `labels=True` the batch holds `labels` and the
model computes its own loss (`out.loss`); with `labels=False` the step's loss is `logits_loss(out)`, the mean square
of the logits. Sizes: "test" (2 layers, width 32, batch 4, sequence 64: activations outweigh the weights, as in
training at scale, and each model plans in seconds in the test suite) and "bench" (4 layers, width 128, batch 2,
sequence 128: the real-models issue's measurements); "small" and "small24" (GPT-2-small's width and heads, 12 or 24
layers, batch 1, sequence 512: the scale benchmark); "decoder512" (8 layers of width 512, batch 1, sequence 512: a
compute-bound decoder, the baselines benchmark).

Kinds: a decoder LM with a causal and a padding mask (gpt2, llama), an encoder with a padding mask (bert), a vision
transformer (vit), conv nets with BatchNorm (resnet) and LayerNorm (convnext), an encoder-decoder (t5).
"""
from __future__ import annotations

import torch

NAMES = ("gpt2", "llama", "bert", "vit", "resnet", "convnext", "t5")
KIND = {"gpt2": "decoder", "llama": "decoder", "bert": "encoder", "vit": "vision transformer", "resnet": "conv net",
        "convnext": "conv net", "t5": "encoder-decoder"}
SIZES = {"test": dict(layers=2, width=32, seq=64, batch=4, vocab=128, image=64),
         "bench": dict(layers=4, width=128, seq=128, batch=2, vocab=1000, image=64),
         # GPT-2-small's shape (12 heads of 64, GPT-2's vocabulary), batch 1, sequence 512; and twice as deep
         "small": dict(layers=12, width=768, heads=12, seq=512, batch=1, vocab=50257, image=224),
         "small24": dict(layers=24, width=768, heads=12, seq=512, batch=1, vocab=50257, image=224),
         # a compute-bound decoder: 8 layers of width 512 (8 heads of 64), GPT-2's vocabulary, batch 1, sequence 512
         "decoder512": dict(layers=8, width=512, heads=8, seq=512, batch=1, vocab=50257, image=224)}


def logits_loss(out) -> torch.Tensor:
    """The step's loss when the batch has no labels: the mean square of the logits (in float32)."""
    return out.logits.float().pow(2).mean()


def _config(name: str, s: dict):
    import transformers as T

    L, d = s["layers"], s["width"]
    heads = s.get("heads", 2 if d <= 64 else 4)
    if name == "gpt2":
        return T.GPT2LMHeadModel, T.GPT2Config(n_layer=L, n_embd=d, n_head=heads, n_positions=s["seq"],
                                                vocab_size=s["vocab"], bos_token_id=0, eos_token_id=0)
    if name == "llama":
        return T.LlamaForCausalLM, T.LlamaConfig(num_hidden_layers=L, hidden_size=d, num_attention_heads=heads,
                                                  num_key_value_heads=heads, intermediate_size=2 * d,
                                                  vocab_size=s["vocab"], max_position_embeddings=s["seq"])
    if name == "bert":
        return T.BertForSequenceClassification, T.BertConfig(
            num_hidden_layers=L, hidden_size=d, num_attention_heads=heads, intermediate_size=2 * d,
            vocab_size=s["vocab"], max_position_embeddings=s["seq"], num_labels=4)
    if name == "vit":
        return T.ViTForImageClassification, T.ViTConfig(
            num_hidden_layers=L, hidden_size=d, num_attention_heads=heads, intermediate_size=2 * d,
            image_size=s["image"], patch_size=8, num_labels=10)
    if name == "resnet":
        return T.ResNetForImageClassification, T.ResNetConfig(
            embedding_size=d // 4, hidden_sizes=[d // 4, d // 2, d, 2 * d][:L], depths=[1] * L, num_labels=10)
    if name == "convnext":
        return T.ConvNextForImageClassification, T.ConvNextConfig(
            num_stages=L, hidden_sizes=[d // 4, d // 2, d, 2 * d][:L], depths=[1] * L, num_labels=10,
            image_size=s["image"])
    if name == "t5":
        return T.T5ForConditionalGeneration, T.T5Config(
            num_layers=L, num_decoder_layers=L, d_model=d, d_ff=2 * d, num_heads=heads, d_kv=d // heads,
            vocab_size=s["vocab"], decoder_start_token_id=0, pad_token_id=0)
    raise ValueError(f"unknown model '{name}'; choose one of {', '.join(NAMES)}")


def build(name: str, size: str = "test", labels: bool = True, seed: int = 0, batch: int | None = None):
    """(model, batch): the model in train mode with weights drawn under `seed`, and its keyword batch (of the size's
    batch, or `batch` rows)."""
    s = SIZES[size] if batch is None else {**SIZES[size], "batch": batch}
    cls, cfg = _config(name, s)
    torch.manual_seed(seed)
    model = cls(cfg).train()
    gen = torch.Generator().manual_seed(seed + 1)
    b, t = s["batch"], s["seq"]
    if name in ("vit", "resnet", "convnext"):
        batch = {"pixel_values": torch.randn(b, 3, s["image"], s["image"], generator=gen)}
        if labels:
            batch["labels"] = torch.randint(0, 10, (b,), generator=gen)
        return model, batch
    ids = torch.randint(1, s["vocab"], (b, t), generator=gen)
    mask = torch.ones(b, t, dtype=torch.long)
    if b > 1:
        mask[1, 3 * t // 4:] = 0  # a padded row: the models' mask code takes its data-dependent path
    batch = {"input_ids": ids, "attention_mask": mask}
    if name == "bert" and labels:
        batch["labels"] = torch.randint(0, 4, (b,), generator=gen)
    elif name == "t5":
        target = torch.randint(1, s["vocab"], (b, t // 2), generator=gen)
        batch["labels" if labels else "decoder_input_ids"] = target
        batch["use_cache"] = False
    elif labels:
        batch["labels"] = ids
    if name in ("gpt2", "llama"):
        batch["use_cache"] = False
    return model, batch
