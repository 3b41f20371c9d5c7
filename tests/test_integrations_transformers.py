"""memopt.integrations.transformers: a memopt-wrapped tiny Llama in transformers.Trainer (CPU).

Against the unwrapped Trainer step by step; OOM recovery against a run that never ran out of
memory, and against the Trainer's own auto_find_batch_size."""

import importlib
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import memopt  # noqa: E402
from memopt.integrations.transformers import MemoptTrainer  # noqa: E402

wrap_module = importlib.import_module("memopt.wrap")

VOCAB, SEQ, SAMPLES = 96, 12, 12


def _llama(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=32, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _dataset():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=generator)
    labels = ids.clone()
    labels[::3, : SEQ // 2] = -100  # uneven label counts: the token-normalised loss is what counts
    return [{"input_ids": i, "labels": l} for i, l in zip(ids, labels)]


def _args(tmp_path, **kwargs):
    options = dict(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=4, max_steps=3,
        learning_rate=1e-2, lr_scheduler_type="constant", logging_strategy="no", save_strategy="no", seed=0,
        dataloader_drop_last=False, disable_tqdm=True,
    )  # fmt: skip
    options.update(kwargs)
    return transformers.TrainingArguments(**options)


class _RecordLosses:
    """Mixin: the loss of every training_step, as the Trainer's loop receives it."""

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.step_losses.append(loss.item())
        return loss


class RecordingTrainer(_RecordLosses, transformers.Trainer):
    step_losses: list


class RecordingMemoptTrainer(_RecordLosses, MemoptTrainer):
    step_losses: list


def _train(trainer_class, model, args, **kwargs):
    trainer = trainer_class(model=model, args=args, train_dataset=_dataset(), **kwargs)
    trainer.step_losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing is 5.x's deprecated alias
        trainer.train()
    return trainer


def _params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_params_close(got, want, **tol):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m: f"{name}: {m}", **tol)


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_memopt_selected_through_training_arguments_matches_unwrapped_trainer(tmp_path, policy):
    plain = _train(RecordingTrainer, _llama(), _args(tmp_path / "plain", gradient_accumulation_steps=2))
    args = _args(
        tmp_path / "memopt", gradient_accumulation_steps=2, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"memopt": {"policy": policy}},
    )  # fmt: skip
    ours = _train(RecordingMemoptTrainer, _llama(), args)
    assert wrap_module.is_wrapped(ours.model)
    assert set(wrap_module.wrapped_policies(ours.model).values()) == {policy}
    assert not ours.model.is_activation_checkpointing  # Hugging Face's own stayed off
    # 12 samples in batches of 4, two per optimizer step: (1, 2), (3), (1, 2).
    assert len(ours.step_losses) == len(plain.step_losses) == 5
    torch.testing.assert_close(torch.tensor(ours.step_losses), torch.tensor(plain.step_losses), rtol=1e-5, atol=1e-6)
    _assert_params_close(_params(ours.model), _params(plain.model), rtol=1e-4, atol=1e-5)


def test_model_with_a_sequence_first_layer_inside_trains_on_batch_first_batches(tmp_path):
    """A Trainer's batches are (batch, ...) tensors also for models holding batch_first=False
    layers (Encodec's LSTM): AdaptiveBatch, which refuses to guess for such models, is told so."""

    def model():
        llama = _llama()
        llama.side = torch.nn.LSTM(4, 4)  # declares batch_first=False; unused by the forward
        return llama

    plain = _train(RecordingTrainer, model(), _args(tmp_path / "plain", gradient_accumulation_steps=2))
    ours = _train(RecordingMemoptTrainer, model(), _args(tmp_path / "memopt", gradient_accumulation_steps=2))
    assert ours.adaptive_batch.batch_dim == 0
    torch.testing.assert_close(torch.tensor(ours.step_losses), torch.tensor(plain.step_losses), rtol=1e-5, atol=1e-6)
    _assert_params_close(_params(ours.model), _params(plain.model), rtol=1e-4, atol=1e-5)


def test_chunked_loss_runs_inside_the_trainer(tmp_path):
    """memopt.wrap's default loss for a causal LM is the chunked one: the Trainer's
    num_items_in_batch normalisation goes through it, with the same losses as Hugging Face's."""
    model = _llama()
    lm_loss = importlib.import_module("memopt.causal_lm_loss")
    memopt.wrap(model, policy="selective", loss="chunked")
    assert lm_loss.chosen_loss(_llama(), "chunked") is not None
    ours = _train(RecordingTrainer, model, _args(tmp_path / "a", gradient_accumulation_steps=2))
    plain = _train(RecordingTrainer, _llama(), _args(tmp_path / "b", gradient_accumulation_steps=2))
    torch.testing.assert_close(torch.tensor(ours.step_losses), torch.tensor(plain.step_losses), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        batch = _dataset()[0]
        out = model(input_ids=batch["input_ids"][None], labels=batch["labels"][None])
    assert out.logits is None  # the chunked loss ran: no logits were made


def test_wrapped_model_with_hf_checkpointing_raises_instead_of_checkpointing_twice(tmp_path):
    model = memopt.wrap(_llama())
    trainer = transformers.Trainer(model=model, args=_args(tmp_path, gradient_checkpointing=True), train_dataset=_dataset())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(RuntimeError, match="checkpoint its layers a second time"):
            trainer.train()
    assert not model.is_activation_checkpointing


def test_bad_memopt_checkpointing_kwargs_raise(tmp_path):
    model = _llama()
    with pytest.raises(ValueError, match="takes no other keys .* got \\['use_reentrant'\\]"):
        MemoptTrainer(model=model, args=_args(tmp_path), train_dataset=_dataset()).model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"memopt": {}, "use_reentrant": False}
        )
    with pytest.raises(ValueError, match="every_n_layers=2"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"memopt": {}}, every_n_layers=2)
    assert not wrap_module.is_wrapped(model)


class _OutOfMemoryAbove:
    """Forward pre-hook on a decoder layer: 'runs out of memory' when it sees more than ``limit``
    samples, with the message a CUDA OOM has (Accelerate's auto_find_batch_size looks for it)."""

    def __init__(self, limit):
        self.limit = limit
        self.raised = 0

    def __call__(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[0] > self.limit:
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")


def test_oom_recovery_keeps_the_batch_and_ends_with_the_parameters_of_a_run_without_oom(tmp_path):
    never = _train(RecordingMemoptTrainer, _llama(), _args(tmp_path / "never", gradient_accumulation_steps=2))
    model = _llama()
    bomb = _OutOfMemoryAbove(limit=1)
    model.model.layers[1].register_forward_pre_hook(bomb, with_kwargs=True)
    flaky = _train(RecordingMemoptTrainer, model, _args(tmp_path / "flaky", gradient_accumulation_steps=2))
    assert bomb.raised == 2  # 4 -> 2 -> 1 once; the micro-batch then stays at 1
    assert flaky.adaptive_batch.micro_batch == 1 and flaky.adaptive_batch.oom_count == 2
    assert flaky.state.global_step == never.state.global_step == 3
    torch.testing.assert_close(torch.tensor(flaky.step_losses), torch.tensor(never.step_losses), rtol=1e-5, atol=1e-6)
    _assert_params_close(_params(flaky.model), _params(never.model), rtol=1e-4, atol=1e-5)


def test_auto_find_batch_size_halves_the_batch_and_changes_the_run(tmp_path):
    """What the Trainer's own recovery does with the same OOM: per-device batch 4 -> 2 -> 1 and a
    restart, so it trains on other batches than the run without OOM (the comparison memopt's
    recovery is made for)."""
    never = _train(RecordingTrainer, _llama(), _args(tmp_path / "never"))
    model = _llama()
    model.model.layers[1].register_forward_pre_hook(_OutOfMemoryAbove(limit=1), with_kwargs=True)
    halved = _train(RecordingTrainer, model, _args(tmp_path / "auto", auto_find_batch_size=True))
    assert halved._train_batch_size == 1  # read only to show the effect; no public attribute holds it
    differences = [(a - b).abs().max().item() for a, b in zip(_params(halved.model).values(), _params(never.model).values())]
    assert max(differences) > 1e-3
