"""TRL SFTTrainer + PEFT LoRA with fxfuse: wrap with PEFT, ``fxfuse.patch`` the PEFT model, train.

    python examples/peft_sft.py [--model llama] [--steps 3] [--inner inductor] [--out DIR]

LoRA adapters on every attention and MLP projection; the base weights, the norm weights and the
lm_head stay frozen. fxfuse matches by what the graph computes, so the norms, the rotary embedding
and the gated MLP (whose gate and up are now ``base(x) + B(A(x)) * scale``) are still fused, and the
fused ops compute no gradient for the frozen weights. TRL (>= 1.x) installs its own chunked LM head
for the loss (``fused_lm_head=True``); fxfuse leaves that part to TRL and fuses the backbone.

The tokenizer is a character-level one built here, so the example runs offline.
"""
from __future__ import annotations

import argparse

import torch

import fxfuse

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64, use_cache=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TEXTS = ["the quick brown fox jumps", "over the lazy dog again", "fused kernels for any model",
         "rms norm rope and swiglu", "lm head and cross entropy", "patch once then train"]


def char_tokenizer():
    """A character-level fast tokenizer: [PAD]=0, [BOS]=1, [EOS]=2, then a-z, space, digits."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list("abcdefghijklmnopqrstuvwxyz 0123456789")
    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, "[UNK]": 3, **{c: i + 4 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", bos_token="[BOS]",
                                   eos_token="[EOS]", unk_token="[UNK]")


def lora_model(model_type: str = "llama", seed: int = 0):
    """A tiny causal LM from config wrapped with LoRA (r=4, no dropout, so runs are deterministic)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **CONFIG))
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM",
                     init_lora_weights=False)  # random B, so adapter gradients are all non-zero from step 1
    return get_peft_model(base, cfg)


def sft(model, out: str, steps: int = 3, patch_options: dict | None = None):
    """SFTTrainer on TEXTS for ``steps`` steps; patch_options=None trains eagerly. Returns the trainer."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    if patch_options is not None:
        fxfuse.patch(model, **patch_options)
    args = SFTConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                     learning_rate=1e-2, optim="sgd", lr_scheduler_type="constant", logging_steps=1,
                     save_strategy="no", report_to="none", use_cpu=True, max_length=32, seed=0, data_seed=0,
                     dataloader_num_workers=0)  # TRL's default gradient_checkpointing=True: fused as well
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": TEXTS}),
                         processing_class=char_tokenizer())
    with fxfuse.skip_checkpoint_side_effect_replay():  # transformers >= 5.25: README, Limits
        trainer.train()
    return trainer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager", "eager"])
    ap.add_argument("--out", default="fxfuse_sft_out")
    args = ap.parse_args(argv)
    model = lora_model(args.model)
    model.print_trainable_parameters()
    trainer = sft(model, args.out, args.steps, patch_options={"inner": args.inner})
    print(fxfuse.patch_report(model))
    print("log:", [h.get("loss") for h in trainer.state.log_history if "loss" in h])
    return trainer


if __name__ == "__main__":
    main()
