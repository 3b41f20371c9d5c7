"""A memopt-wrapped tiny Llama in trl.SFTTrainer (CPU), against the unwrapped SFTTrainer step by
step: memopt selected through gradient_checkpointing_kwargs, with memopt's default chunked loss
(SFTTrainer then runs its own fused LM-head loss, which materialises no logits either)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

from memopt.integrations.transformers import take_over_checkpointing  # noqa: E402

VOCAB, SEQ, SAMPLES = 96, 12, 12


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=32, attn_implementation="sdpa", pad_token_id=0, eos_token_id=1,
        bos_token_id=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _tokenizer():
    # A word-level tokenizer built here (no download): SFTTrainer needs a processing class.
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t3"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="t0", eos_token="t1", bos_token="t2", unk_token="t3"
    )


def _train(model, out_dir, **kwargs):
    ids = torch.randint(4, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1)).tolist()
    args = trl.SFTConfig(
        output_dir=str(out_dir), use_cpu=True, report_to=[], per_device_train_batch_size=4, max_steps=3,
        learning_rate=1e-2, lr_scheduler_type="constant", logging_strategy="no", save_strategy="no", seed=0,
        disable_tqdm=True, max_length=SEQ, **kwargs,
    )  # fmt: skip
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_dict({"input_ids": ids}), processing_class=_tokenizer()
    )
    losses = []
    step = trainer.training_step

    def recording_step(*a, **k):
        loss = step(*a, **k)
        losses.append(loss.item())
        return loss

    trainer.training_step = recording_step
    trainer.train()
    return trainer, losses, {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("loss", ["chunked", "plain"])
@pytest.mark.parametrize("policy", ["selective", "full"])
def test_sft_trainer_on_a_memopt_model_matches_the_unwrapped_run(tmp_path, policy, loss):
    _, plain_losses, plain_params = _train(_llama(), tmp_path / "plain")
    model = take_over_checkpointing(_llama())
    trainer, losses, params = _train(
        model, tmp_path / "memopt", gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"memopt": {"policy": policy, "loss": loss}},
    )  # fmt: skip
    from memopt.wrap import is_wrapped, wrapped_policies

    assert is_wrapped(trainer.model) and set(wrapped_policies(trainer.model).values()) == {policy}
    assert len(losses) == len(plain_losses) == 3
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), rtol=1e-5, atol=1e-6)
    for name in plain_params:
        torch.testing.assert_close(params[name], plain_params[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
