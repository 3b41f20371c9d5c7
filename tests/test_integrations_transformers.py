"""memopt.integrations.transformers: a memopt-wrapped tiny Llama in transformers.Trainer (CPU).

Against the unwrapped Trainer step by step; OOM recovery against a run that never ran out of
memory, and against the Trainer's own auto_find_batch_size."""

import copy
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


# training_step straight from the test, against a float64 full-batch backward of the model's own
# loss: the gradient of one optimizer step of gradient_accumulation_steps=2 (two batches of 4),
# with an OOM above 2 samples that splits each batch in two.


def _sequence_classifier(problem):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=VOCAB, max_position_embeddings=32, pad_token_id=0, attn_implementation="sdpa",
        num_labels=1 if problem == "regression" else 3,
        problem_type="regression" if problem == "regression" else "multi_label_classification",
    )  # fmt: skip
    return transformers.LlamaForSequenceClassification(config)


def _tiny_causal_lm():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=VOCAB, max_position_embeddings=32, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _step_batches(problem):
    generator = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(2):
        ids = torch.randint(1, VOCAB, (4, 8), generator=generator)
        if problem == "regression":
            labels = torch.randn(4, generator=generator)
        elif problem == "multi_label":
            labels = torch.randint(0, 2, (4, 3), generator=generator).float()
        else:  # causal LM, uneven label counts per sample
            labels = ids.clone()
            labels[0, :5] = -100
            labels[3, :2] = -100
        batches.append({"input_ids": ids, "labels": labels})
    return batches


def _num_items(problem, batches):
    """What the Trainer's _get_num_items_in_batch counts for the step: label tokens, shifted for
    a causal LM; every label (not -100) for the others."""
    labels = [b["labels"][..., 1:] if problem == "causal_lm" else b["labels"] for b in batches]
    return sum(lab.ne(-100).sum() for lab in labels).float()


def _float64_step_gradient(model, problem, batches):
    """In float64, what the plain Trainer backpropagates over one step: each whole batch's model
    loss, summed (the causal LM divides by num_items_in_batch; the sequence classifiers ignore it,
    and the Trainer does not divide their loss by the accumulation steps since they take loss
    kwargs)."""
    reference = copy.deepcopy(model).double()
    num_items = _num_items(problem, batches)
    for batch in batches:
        labels = batch["labels"].double() if batch["labels"].is_floating_point() else batch["labels"]
        kwargs = {"num_items_in_batch": num_items} if problem == "causal_lm" else {}
        reference(input_ids=batch["input_ids"], labels=labels, **kwargs).loss.backward()
    return {name: p.grad for name, p in reference.named_parameters()}


def _memopt_step_gradient(tmp_path, model, problem, batches, batch_type=dict):
    trainer = MemoptTrainer(model=model, args=_args(tmp_path, optim="sgd", gradient_accumulation_steps=2))
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 2  # the training loop sets it per optimizer step
    num_items = _num_items(problem, batches)
    for batch in batches:
        trainer.training_step(model, batch_type(batch), num_items)
    return trainer, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("problem", ["regression", "multi_label", "causal_lm"])
def test_oom_split_gradient_equals_float64_full_batch_gradient(tmp_path, problem):
    """A model that takes **kwargs gets num_items_in_batch, but a regression or multi-label loss
    (MSE, BCE) stays a per-micro-batch mean: weighting it as a pre-normalised loss doubled the
    gradient after one split. A causal LM divides by the count of label tokens instead."""
    model = _sequence_classifier(problem) if problem != "causal_lm" else _tiny_causal_lm()
    batches = _step_batches(problem)
    expected = _float64_step_gradient(model, problem, batches)
    bomb = _OutOfMemoryAbove(limit=2)
    model.model.layers[0].register_forward_pre_hook(bomb, with_kwargs=True)
    trainer, got = _memopt_step_gradient(tmp_path, model, problem, batches)
    assert bomb.raised == 1 and trainer.adaptive_batch.micro_batch == 2
    for name, grad in expected.items():
        torch.testing.assert_close(got[name].double(), grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_batch_encoding_batch_trains(tmp_path):
    """transformers' collators (DataCollatorForLanguageModeling, DataCollatorWithPadding) return a
    BatchEncoding, a UserDict, not a dict."""
    model = _tiny_causal_lm()
    batches = _step_batches("causal_lm")
    expected = _float64_step_gradient(model, "causal_lm", batches)
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[0]),
                                    with_kwargs=True)
    bomb = _OutOfMemoryAbove(limit=2)
    model.model.layers[0].register_forward_pre_hook(bomb, with_kwargs=True)
    _, got = _memopt_step_gradient(tmp_path, model, "causal_lm", batches, batch_type=transformers.BatchEncoding)
    assert seen == [4, 2, 2, 2, 2]
    for name, grad in expected.items():
        torch.testing.assert_close(got[name].double(), grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_short_last_batch_does_not_lower_the_micro_batch(tmp_path):
    """9 samples in batches of 4 for two epochs: the epoch's last batch of 1 runs whole, and the
    next epoch's batches still run in one micro-step each."""
    seen = []

    class Counting(MemoptTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            seen.append((inputs["input_ids"].shape[0], self.adaptive_batch.micro_batch))
            return loss

    data = _dataset()[:9]
    args = _args(tmp_path, max_steps=-1, num_train_epochs=2)
    trainer = Counting(model=_tiny_causal_lm(), args=args, train_dataset=data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        trainer.train()
    assert seen == [(4, 4), (4, 4), (1, 4)] * 2  # (batch, micro-batch after it); before: 1 from the first batch of 1


# PEFT models: the Trainer calls the PeftModel's activation_checkpointing_enable, which its class
# does not define (the instance reaches the inner model's through __getattr__).


def _lora(seed=0):
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(_llama(seed), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


@pytest.mark.parametrize("policy", [None, "selective"])
def test_memopt_trainer_trains_a_peft_model_as_the_unwrapped_trainer(tmp_path, policy):
    """MemoptTrainer refused every PEFT model (TypeError 'not a Hugging Face PreTrainedModel'),
    with gradient_checkpointing off too."""
    plain = _train(RecordingTrainer, _lora(), _args(tmp_path / "plain", gradient_accumulation_steps=2))
    checkpointing = {} if policy is None else {
        "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"memopt": {"policy": policy}},
    }  # fmt: skip
    ours = _train(RecordingMemoptTrainer, _lora(), _args(tmp_path / "memopt", gradient_accumulation_steps=2, **checkpointing))
    assert wrap_module.is_wrapped(ours.model) is (policy is not None)
    assert not ours.model.base_model.model.is_activation_checkpointing  # Hugging Face's own stayed off
    assert len(ours.step_losses) == len(plain.step_losses) == 5
    torch.testing.assert_close(torch.tensor(ours.step_losses), torch.tensor(plain.step_losses), rtol=1e-5, atol=1e-6)
    _assert_params_close(_params(ours.model), _params(plain.model), rtol=1e-4, atol=1e-5)


def test_take_over_checkpointing_on_a_peft_model_falls_back_to_the_inner_models_checkpointing():
    from memopt.integrations.transformers import take_over_checkpointing

    model = take_over_checkpointing(_lora())
    model.activation_checkpointing_enable()  # no "memopt" key: Hugging Face's, on the model PEFT holds
    assert model.base_model.model.is_activation_checkpointing and not wrap_module.is_wrapped(model)
    model = take_over_checkpointing(_lora())
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"memopt": {"policy": "full"}})
    assert set(wrap_module.wrapped_policies(model).values()) == {"full"}
    with pytest.raises(TypeError, match="not a Hugging Face PreTrainedModel"):
        take_over_checkpointing(torch.nn.Linear(2, 2))


def test_wrapped_peft_model_with_hf_checkpointing_raises_instead_of_checkpointing_twice(tmp_path):
    """wrap(peft_model) installed no switch (its class defines no checkpointing method), so
    Hugging Face's checkpointing went on top and every layer was checkpointed twice."""
    model = memopt.wrap(_lora())
    with pytest.raises(RuntimeError, match="checkpoint its layers a second time"):
        model.activation_checkpointing_enable()
    with pytest.raises(RuntimeError, match="checkpoint its layers a second time"):
        model.gradient_checkpointing_enable()  # the 4.x name, which the PEFT model reaches in the inner model
    trainer = transformers.Trainer(model=model, args=_args(tmp_path, gradient_checkpointing=True), train_dataset=_dataset())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(RuntimeError, match="checkpoint its layers a second time"):
            trainer.train()
    assert not model.base_model.model.is_activation_checkpointing


# Evaluation: the chunked loss makes no logits, and the Trainer's prediction step passes on what
# the model returns besides the loss.


def _evaluate(trainer_class, model, tmp_path, compute_metrics):
    seen = []
    metrics = None if compute_metrics is None else lambda p: seen.append(p) or {}
    args = _args(tmp_path, per_device_eval_batch_size=4)
    trainer = trainer_class(model=model, args=args, eval_dataset=_dataset(), compute_metrics=metrics)
    return trainer.evaluate()["eval_loss"], seen


def test_memopt_trainer_evaluate_gives_compute_metrics_the_logits_of_the_unwrapped_model(tmp_path):
    """compute_metrics got empty predictions () from a wrapped causal LM (its chunked loss returns
    logits=None with labels); eval_loss was right."""
    want_loss, (want,) = _evaluate(transformers.Trainer, _llama(), tmp_path / "plain", compute_metrics=True)
    model = memopt.wrap(_llama(), policy="selective")
    got_loss, (got,) = _evaluate(MemoptTrainer, model, tmp_path / "memopt", compute_metrics=True)
    assert got.predictions.shape == want.predictions.shape == (SAMPLES, SEQ, VOCAB)
    torch.testing.assert_close(torch.from_numpy(got.predictions), torch.from_numpy(want.predictions), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # outside the prediction step the chunked loss is back
        batch = _dataset()[0]
        assert model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).logits is None


def test_memopt_trainer_loss_only_evaluation_keeps_the_chunked_loss(tmp_path):
    model = memopt.wrap(_llama(), policy="selective")
    logits = []
    model.register_forward_hook(lambda module, args, output: logits.append(output.logits))
    got_loss, _ = _evaluate(MemoptTrainer, model, tmp_path / "memopt", compute_metrics=None)
    want_loss, _ = _evaluate(transformers.Trainer, _llama(), tmp_path / "plain", compute_metrics=None)
    assert logits and all(value is None for value in logits)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
