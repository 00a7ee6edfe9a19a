"""The HF Trainer with nothing but planner.enable() before it trains as the eager Trainer does (gradient
accumulation, padded and unpadded rows)."""
from __future__ import annotations

import pytest
import torch

import planner

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _dataset(n: int = 16, seq: int = 32, vocab: int = 128):
    gen = torch.Generator().manual_seed(7)
    rows = []
    for k in range(n):
        ids = torch.randint(1, vocab, (seq,), generator=gen)
        mask = torch.ones(seq, dtype=torch.long)
        labels = ids.clone()
        if k % 3 == 1:  # a padded row
            mask[-7:] = 0
            labels[-7:] = -100
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def _train(tmp_path, enable: bool):
    cfg = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=128, n_positions=32)  # dropout 0.1
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    if enable:
        planner.enable(model, 1.0, time_limit_s=2.0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("planned" if enable else "eager")), per_device_train_batch_size=2,
        gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-3, report_to=[], save_strategy="no",
        logging_strategy="no", use_cpu=True, seed=3, dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_dataset())
    trainer.train()
    return model


def test_trainer_with_enable_equals_the_eager_trainer(tmp_path):
    eager = _train(tmp_path, enable=False)
    planned = _train(tmp_path, enable=True)
    state = planner.inplace_plan(planned)
    assert state is not None and any(r.mode == "planned" for r in state.records)
    assert type(planned) is type(eager) and list(planned.state_dict()) == list(eager.state_dict())
    for (name, p), q in zip(planned.named_parameters(), eager.parameters()):
        assert torch.equal(p, q), name
