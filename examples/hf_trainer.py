"""HF Trainer with fxfuse: ``fxfuse.patch(model)`` before the Trainer, nothing else changes.

    python examples/hf_trainer.py [--model llama] [--steps 3] [--inner inductor] [--out DIR]

A small causal LM from a config (random weights, no download), random-token data with some labels
masked (-100), gradient accumulation (the Trainer passes ``num_items_in_batch``, and the fused
loss head keeps HF's ``sum / num_items_in_batch``), an evaluation whose ``compute_metrics`` sees the
logits (exact values, see patterns/linear_cross_entropy.py), and a checkpoint saved and loaded
back with the usual ``state_dict`` keys.

Do not use ``TrainingArguments(torch_compile=True, torch_compile_backend="fxfuse")``: accelerate
checks the backend name against its own list and fails (``'FXFUSE' is not a valid DynamoBackend``).
``fxfuse.patch`` compiles the model in place, so the Trainer needs no compile setting at all.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

import fxfuse

CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64, use_cache=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build_model(model_type: str = "llama", seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **CONFIG))


def random_dataset(n: int, seq: int, vocab: int, seed: int = 0) -> list[dict]:
    """n examples of ``seq`` random tokens; the first 2 + i % 3 labels are -100 (a prompt), so
    batches hold different numbers of loss tokens and num_items_in_batch matters."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(3, vocab, (seq,), generator=g)
        labels = ids.clone()
        labels[: 2 + i % 3] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def token_accuracy(eval_pred) -> dict:
    """Next-token accuracy from the logits [N, T, V] the Trainer gathered."""
    logits, labels = eval_pred.predictions, eval_pred.label_ids
    pred, tgt = logits[:, :-1].argmax(-1), labels[:, 1:]
    keep = tgt != -100
    return {"token_accuracy": float((pred[keep] == tgt[keep]).mean())}


def training_args(out: str, steps: int, **overrides):
    from transformers import TrainingArguments

    kw = dict(output_dir=out, max_steps=steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
              per_device_eval_batch_size=4, learning_rate=1e-2, optim="sgd", lr_scheduler_type="constant",
              logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, dataloader_num_workers=0,
              seed=0, data_seed=0)
    return TrainingArguments(**{**kw, **overrides})


def run(model, out: str, steps: int = 3, seq: int = 12, patch_options: dict | None = None) -> dict:
    """Train ``steps`` steps, evaluate, save. patch_options=None trains eagerly (the reference)."""
    from transformers import Trainer

    if patch_options is not None:
        fxfuse.patch(model, **patch_options)           # the one line
    vocab = model.config.vocab_size
    trainer = Trainer(model=model, args=training_args(out, steps),
                      train_dataset=random_dataset(4 * steps, seq, vocab),
                      eval_dataset=random_dataset(4, seq, vocab, seed=1), compute_metrics=token_accuracy)
    train = trainer.train()
    metrics = trainer.evaluate()
    logits = trainer.predict(random_dataset(4, seq, vocab, seed=1)).predictions
    trainer.save_model(out)
    return {"train_loss": train.training_loss, "eval": metrics, "logits": np.asarray(logits), "trainer": trainer,
            "report": fxfuse.patch_report(model) if patch_options is not None else None}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager", "eager"])
    ap.add_argument("--out", default="fxfuse_trainer_out")
    args = ap.parse_args(argv)
    model = build_model(args.model)
    res = run(model, args.out, args.steps, patch_options={"inner": args.inner})
    print(res["report"])
    print(f"train loss {res['train_loss']:.4f}  eval {res['eval']}")
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(args.out)
    same = reloaded.state_dict().keys() == model.state_dict().keys()
    print(f"checkpoint reloaded from {args.out}: same state_dict keys: {same}")
    return {**res, "model": model, "reloaded": reloaded}


if __name__ == "__main__":
    main()
