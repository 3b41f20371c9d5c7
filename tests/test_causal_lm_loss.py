"""memopt.wrap(model, loss=...) on tiny Hugging Face causal LMs built from configs (no download).

The reference is the unwrapped model itself: Hugging Face's own logits and ForCausalLMLoss. The
chunked loss must give the same loss and every parameter gradient in float32, with padding
labels (-100), with ``num_items_in_batch``, alone and together with layer checkpointing; without
labels the model is unchanged; ``unwrap`` restores the original forward; the tensors saved for
backward hold no (tokens x vocab) tensor.
"""

import copy
import importlib
import pickle

import pytest
import torch

import memopt

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 128, 2, 16
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _build(config_name, model_name, **extra):
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB, max_position_embeddings=64, attn_implementation="eager", **{**SMALL, **extra}
    )
    return getattr(transformers, model_name)(config)


def _gpt2():
    config = transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager",
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


FAMILIES = {
    "llama": lambda: _build("LlamaConfig", "LlamaForCausalLM"),
    "llama-bias-untied": lambda: _build("LlamaConfig", "LlamaForCausalLM", attention_bias=True, mlp_bias=True),
    "mistral": lambda: _build("MistralConfig", "MistralForCausalLM", sliding_window=8),
    "qwen2": lambda: _build("Qwen2Config", "Qwen2ForCausalLM"),
    "gemma2-softcap": lambda: _build(
        "Gemma2Config", "Gemma2ForCausalLM", head_dim=16, final_logit_softcapping=3.0, query_pre_attn_scalar=16
    ),
    "phi3": lambda: _build("Phi3Config", "Phi3ForCausalLM", pad_token_id=0, bos_token_id=0, eos_token_id=0),
    "gpt2": _gpt2,
}
if hasattr(transformers, "Qwen3ForCausalLM"):
    FAMILIES["qwen3"] = lambda: _build("Qwen3Config", "Qwen3ForCausalLM", head_dim=16)
if hasattr(transformers, "Gemma3ForCausalLM"):
    FAMILIES["gemma3-softcap"] = lambda: _build(
        "Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=16, final_logit_softcapping=3.0, query_pre_attn_scalar=16,
        sliding_window=8,
    )  # fmt: skip


def _model(family):
    torch.manual_seed(0)
    # eval(): no dropout (GPT-2 and Phi-3 have some by default), so both runs see the same
    # function; gradients are still computed.
    return FAMILIES[family]().float().eval()


def _batch():
    generator = torch.Generator().manual_seed(123)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -4:] = 0  # right padding in the second row
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt whose tokens are not trained on
    labels[1, -4:] = -100  # the padding
    return ids, mask, labels


def _step(model, **loss_kwargs):
    model.zero_grad(set_to_none=True)
    ids, mask, labels = _batch()
    out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False, **loss_kwargs)
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, want):
    (out, grads), (ref_out, ref_grads) = got, want
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("num_items", [None, 23], ids=["mean", "num_items_in_batch"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_loss_and_gradients_equal_hugging_face(family, num_items):
    model = _model(family)
    loss_kwargs = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    reference = _step(model, **loss_kwargs)
    assert reference[0].logits is not None
    memopt.wrap(model, policy="none")  # the loss alone: no layer is checkpointed
    got = _step(model, **loss_kwargs)
    assert got[0].logits is None
    assert type(got[0]) is type(reference[0])
    _assert_same(got, reference)


@pytest.mark.parametrize("family", ["llama", "gemma2-softcap", "gpt2"])
def test_chunked_loss_with_layer_checkpointing(family):
    model = _model(family)
    reference = _step(model, num_items_in_batch=torch.tensor(19))
    memopt.wrap(model)  # the default policy checkpoints every layer, the default loss is chunked
    assert set(importlib.import_module("memopt.wrap").wrapped_policies(model).values()) == {"selective"}
    got = _step(model, num_items_in_batch=torch.tensor(19))
    assert got[0].logits is None
    _assert_same(got, reference)


def test_chunked_loss_in_train_mode_with_chunks_smaller_than_the_batch(monkeypatch):
    # Several chunks per call (5 tokens each, 32 tokens): not a single-chunk special case.
    torch.manual_seed(0)
    model = FAMILIES["llama"]().train()
    reference = _step(model)
    memopt.wrap(model, policy="full")
    from memopt.ops import cross_entropy

    calls = []
    monkeypatch.setattr(cross_entropy, "default_chunk_tokens", lambda vocab: calls.append(vocab) or 5)
    got = _step(model)
    assert calls == [VOCAB]
    _assert_same(got, reference)


def test_shift_labels_and_ignore_index_are_honoured():
    model = _model("llama")
    ids, mask, labels = _batch()
    labels = labels.masked_fill(labels == -100, -1)
    shift = torch.nn.functional.pad(labels, (0, 1), value=-1)[..., 1:].contiguous()
    kwargs = dict(input_ids=ids, attention_mask=mask, labels=labels, shift_labels=shift, ignore_index=-1)
    reference = model(**kwargs).loss
    memopt.wrap(model, policy="none")
    torch.testing.assert_close(model(**kwargs).loss, reference, rtol=1e-5, atol=1e-6)


def test_without_labels_the_model_is_unchanged_and_unwrap_restores():
    model = _model("qwen2")
    ids, mask, labels = _batch()
    ref_logits = model(input_ids=ids, attention_mask=mask).logits
    ref_loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    memopt.wrap(model)
    assert "forward" in model.__dict__
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, ref_logits, rtol=0, atol=0)
    # Positional labels and return_dict=False: a tuple led by the loss, no logits in it.
    as_tuple = model(ids, mask, None, None, None, labels, return_dict=False)
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], ref_loss, rtol=1e-5, atol=1e-6)
    assert all(not (torch.is_tensor(t) and t.shape[-1:] == (VOCAB,)) for t in as_tuple)
    memopt.unwrap(model)
    assert "forward" not in model.__dict__
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.logits, ref_logits, rtol=0, atol=0)
    torch.testing.assert_close(out.loss, ref_loss, rtol=0, atol=0)


def test_plain_keeps_hugging_face_loss():
    model = _model("llama")
    ids, mask, labels = _batch()
    memopt.wrap(model, loss="plain")
    assert "forward" not in model.__dict__
    assert model(input_ids=ids, labels=labels).logits.shape == (BATCH, SEQ, VOCAB)


def test_wrapped_model_deep_copies_and_pickles():
    model = _model("llama")
    ids, mask, labels = _batch()
    memopt.wrap(model)
    loss = model(input_ids=ids, labels=labels).loss
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert clone.forward.model is clone
        torch.testing.assert_close(clone(input_ids=ids, labels=labels).loss, loss, rtol=0, atol=0)
        memopt.unwrap(clone)
        assert "forward" not in clone.__dict__


def test_unsupported_models_get_a_clear_error():
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    with pytest.raises(ValueError, match="loss='chunked' needs a Hugging Face causal LM.*holds no Hugging Face"):
        memopt.wrap(encoder, loss="chunked")
    with pytest.raises(ValueError, match="loss must be None, 'chunked' or 'plain'"):
        memopt.wrap(encoder, loss="fused")
    memopt.wrap(encoder)  # the default: plain for a model that is no causal LM
    assert importlib.import_module("memopt.wrap").is_wrapped(encoder)


@pytest.mark.parametrize(
    "config_name, model_name, attribute, extra",
    [
        ("CohereConfig", "CohereForCausalLM", "logit_scale", dict(logit_scale=0.5)),
        ("GraniteConfig", "GraniteForCausalLM", "logits_scaling", dict(logits_scaling=4.0)),
    ],
)
def test_logit_rescaling_is_refused_by_name(config_name, model_name, attribute, extra):
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers has no {model_name}")
    model = _build(config_name, model_name, **extra).eval()
    with pytest.raises(ValueError, match=f"{attribute}="):
        memopt.wrap(model, loss="chunked")
    memopt.wrap(model)  # the default falls back to Hugging Face's loss
    ids, _, labels = _batch()
    assert model(input_ids=ids, labels=labels).logits is not None


class _ScaledLlama(transformers.LlamaForCausalLM):
    """A causal LM that changes its logits after the LM head with no config attribute saying so."""

    def forward(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
        out = super().forward(input_ids=input_ids, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
        out.logits = out.logits * 2
        return out


def test_an_unknown_logit_transform_raises_rather_than_a_wrong_loss():
    torch.manual_seed(0)
    model = _ScaledLlama(transformers.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=64, **SMALL))
    memopt.wrap(model, loss="chunked")
    ids, _, labels = _batch()
    with pytest.raises(RuntimeError, match="logits are not its LM head"):
        model(input_ids=ids, labels=labels)


def test_a_model_whose_own_logits_are_nan_gets_the_same_nan_loss():
    # A NaN in the model (here one embedding row) makes its own loss NaN; the first-call check
    # blamed the model for "rescaling" its logits. Wrapped, the loss is NaN as the model's is.
    model = _model("llama")
    ids, mask, labels = _batch()
    with torch.no_grad():
        model.model.embed_tokens.weight[ids[0, 2]] = float("nan")
    reference = model(input_ids=ids, labels=labels).loss
    assert torch.isnan(reference)
    memopt.wrap(model)
    assert torch.isnan(model(input_ids=ids, labels=labels).loss)


class _NaNLogitLlama(transformers.LlamaForCausalLM):
    """A causal LM that writes NaN into one of its logits after the LM head."""

    def forward(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
        out = super().forward(input_ids=input_ids, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
        out.logits = out.logits.index_fill(-1, torch.tensor([3]), float("nan"))
        return out


def test_non_finite_logits_the_head_does_not_give_are_named_as_such():
    torch.manual_seed(0)
    model = _NaNLogitLlama(transformers.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=64, **SMALL))
    memopt.wrap(model, loss="chunked")
    ids, _, labels = _batch()
    with pytest.raises(RuntimeError, match="logits hold NaN or inf"):
        model(input_ids=ids, labels=labels)


def test_logits_to_keep_with_labels_is_refused():
    model = _model("llama")
    memopt.wrap(model)
    ids, _, labels = _batch()
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(input_ids=ids, labels=labels, logits_to_keep=4)


def _largest_saved_bytes(model, ids):
    largest = []
    exclude = list(model.parameters()) + list(model.buffers())
    counter = memopt.SavedTensorCounter(exclude=exclude, on_save=lambda t, key, nbytes: largest.append(nbytes))
    with counter:
        model(input_ids=ids, labels=ids).loss
    return max(largest), counter.total_bytes


def test_saved_tensors_hold_no_tokens_by_vocab_tensor():
    vocab, seq = 32_000, 128
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, max_position_embeddings=seq, **SMALL)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    logits_bytes = seq * vocab * 4  # one float32 (tokens x vocab) tensor
    plain_largest, plain_total = _largest_saved_bytes(model, ids)
    assert plain_largest >= logits_bytes  # the reference does save the logits: the check can fail
    memopt.wrap(model)
    largest, total = _largest_saved_bytes(model, ids)
    assert largest < seq * vocab  # not even one byte per logit in any saved tensor
    assert plain_total - total >= logits_bytes


def test_peft_lora_model_gets_the_chunked_loss_on_its_inner_causal_lm():
    peft = pytest.importorskip("peft")
    base = _model("llama")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, lora)
    reference = _step(model)
    memopt.wrap(model)
    assert "forward" in base.__dict__  # installed on the LlamaForCausalLM inside the PEFT wrapper
    got = _step(model)
    assert got[0].logits is None
    _assert_same(got, reference)
    memopt.unwrap(model)
    assert "forward" not in base.__dict__


def test_wrapped_llama_at_2048_tokens_trains_exactly_below_the_logits_peak():
    # The check: a tiny Llama with a 32k vocabulary, so that the (tokens x vocab) logits
    # dominate, at 2048 tokens. Wrapped (chunked loss) it gives the unwrapped loss and gradients,
    # and its peak tracked bytes over forward + backward (ChunkAwareTracker also sees inside the
    # chunked-loss op) fall below the unwrapped peak by at least one float32 logits tensor.
    from bench.cross_entropy import ChunkAwareTracker

    vocab, seq = 32_000, 2048
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, max_position_embeddings=seq, attn_implementation="eager", **SMALL)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(1))

    def step():
        model.zero_grad(set_to_none=True)
        resident = [*model.parameters(), ids]
        with ChunkAwareTracker(exclude=resident) as tracker:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        return loss.detach(), grads, tracker.peak_bytes()

    ref_loss, ref_grads, ref_peak = step()
    memopt.wrap(model)
    loss, grads, peak = step()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    logits_bytes = seq * vocab * 4
    assert ref_peak - peak >= logits_bytes, (ref_peak, peak, logits_bytes)


def _mixtral(**extra):
    torch.manual_seed(0)
    config = dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5)
    return _build("MixtralConfig", "MixtralForCausalLM", **{**config, **extra}).eval()


@pytest.mark.parametrize("num_items", [None, 23], ids=["mean", "num_items_in_batch"])
def test_moe_router_aux_loss_is_added_as_hugging_face_adds_it(num_items):
    # output_router_logits=True: Hugging Face adds router_aux_loss_coef * aux_loss to the loss when
    # labels are given. The chunked forward runs the model with labels=None, so memopt adds it.
    model = _mixtral()
    loss_kwargs = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    reference = _step(model, **loss_kwargs)
    assert reference[0].aux_loss is not None and "model.layers.0.mlp.gate.weight" in reference[1]
    memopt.wrap(model, policy="none")
    got = _step(model, **loss_kwargs)
    assert got[0].logits is None
    torch.testing.assert_close(got[0].aux_loss, reference[0].aux_loss, rtol=0, atol=0)
    _assert_same(got, reference)  # the loss and every gradient, the router's included
    # The coefficient is read per call, as Hugging Face's forward reads it.
    model.router_aux_loss_coef = 0.25
    memopt.unwrap(model)
    reference = _step(model, **loss_kwargs)
    memopt.wrap(model, policy="none")
    model.router_aux_loss_coef = 0.25
    _assert_same(_step(model, **loss_kwargs), reference)


class _ZLossLlama(transformers.LlamaForCausalLM):
    """A causal LM that adds a term of its own to the loss after loss_function."""

    def forward(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
        out = super().forward(input_ids=input_ids, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
        if out.loss is not None:
            out.loss += 1e-2 * out.logits.float().logsumexp(-1).square().mean()
        return out


def test_a_forward_adding_another_term_to_the_loss_keeps_the_plain_loss():
    torch.manual_seed(0)
    model = _ZLossLlama(transformers.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=64, **SMALL)).eval()
    reference = _step(model)
    with pytest.raises(ValueError, match="adds to its loss"):
        memopt.wrap(model, loss="chunked")
    memopt.wrap(model)  # the default: Hugging Face's loss, with the term
    got = _step(model)
    assert got[0].logits is not None
    _assert_same(got, reference)


def test_lora_on_lm_head_added_after_wrap_is_not_bypassed():
    peft = pytest.importorskip("peft")

    def build(wrap_first):
        model = _model("llama")
        if wrap_first:
            memopt.wrap(model)
        torch.manual_seed(0)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], lora_dropout=0.0)
        model = peft.get_peft_model(model, lora)
        with torch.no_grad():  # as after some steps: the adapters change the output
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
        return model

    reference = _step(build(wrap_first=False))
    assert "base_model.model.lm_head.lora_B.default.weight" in reference[1]
    model = build(wrap_first=True)
    with pytest.warns(UserWarning, match="LM head is now .*lora.*plain loss runs instead"):
        got = _step(model)
    _assert_same(got, reference)


@pytest.mark.parametrize("num_items", [None, 23], ids=["mean", "num_items_in_batch"])
def test_bf16_model_loss_is_float32_as_hugging_face(num_items):
    # Hugging Face upcasts the bf16 logits to float32 for the loss; the chunked loss accumulates
    # in float32 and returns that, not a value rounded to bf16 (spacing 2^-5 near 7).
    model = _model("llama").to(torch.bfloat16)
    ids, mask, labels = _batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    if num_items is not None:
        kwargs["num_items_in_batch"] = torch.tensor(num_items)
    with torch.no_grad():
        reference = model(**kwargs).loss
        memopt.wrap(model, policy="none")
        got = model(**kwargs).loss
    assert reference.dtype == got.dtype == torch.float32
    torch.testing.assert_close(got, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("make", [lambda: _model("llama"), _mixtral], ids=["llama", "mixtral"])
def test_return_dict_false_keeps_hugging_face_tuple_positions(make):
    # Hugging Face's tuple is its output's non-None fields in order; the chunked one has None
    # where the logits were (Mixtral's are third, after aux_loss), the rest in their places.
    model = make()
    ids, mask, labels = _batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False, return_dict=False,
                  output_hidden_states=True)  # fmt: skip
    reference = model(**kwargs)
    memopt.wrap(model, policy="none")
    got = model(**kwargs)
    assert isinstance(got, tuple) and len(got) == len(reference)
    logits_at = [i for i, t in enumerate(reference) if torch.is_tensor(t) and t.shape == (BATCH, SEQ, VOCAB)]
    assert logits_at == [1 if make is not _mixtral else 2]
    for i, (g, r) in enumerate(zip(got, reference)):
        if i in logits_at:
            assert g is None
        else:
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=lambda m: f"position {i}: {m}")


def test_wrapping_a_causal_lm_whose_base_model_is_wrapped_raises():
    model = _model("llama")
    ids, mask, labels = _batch()
    reference = model(input_ids=ids, labels=labels).loss
    memopt.wrap(model.model)  # the layers
    with pytest.raises(RuntimeError, match="already wrapped inside: 'model' \\(LlamaModel\\)"):
        memopt.wrap(model)  # then the causal LM, for the chunked loss: unwrap first
    assert "forward" not in model.__dict__
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, reference, rtol=1e-6, atol=1e-6)
    memopt.unwrap(model.model)
    memopt.wrap(model)
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, reference, rtol=1e-5, atol=1e-6)
