"""memopt.wrap on tiny Hugging Face models (random weights, no download): Llama, Mistral, GPT-2.

Losses and every gradient match the unwrapped model; saved bytes fall as the plan predicts and
beat (or equal) Hugging Face's own ``gradient_checkpointing_enable``.
"""

import contextlib
import dataclasses
import importlib
import importlib.util

import pytest
import torch

import memopt
from bench.wrap import hf_checkpointing

transformers = pytest.importorskip("transformers")

wrap_module = importlib.import_module("memopt.wrap")

VOCAB, BATCH, SEQ = 128, 2, 16


def _decoder(config_class, model_class, attn_implementation, **extra):
    config = config_class(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        attn_implementation=attn_implementation,
        **extra,
    )
    return model_class(config).train()


def _llama(attn_implementation):
    return _decoder(transformers.LlamaConfig, transformers.LlamaForCausalLM, attn_implementation)


def _mistral():
    # Mistral's decoder layer (sliding-window attention) is its own class: wrap finds it by
    # repetition, not by name.
    return _decoder(transformers.MistralConfig, transformers.MistralForCausalLM, "sdpa", sliding_window=8)


def _gpt2(attn_implementation, dropout):
    config = transformers.GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        vocab_size=VOCAB,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        attn_implementation=attn_implementation,
    )
    return transformers.GPT2LMHeadModel(config).train()


MODELS = {
    "llama-eager": lambda: _llama("eager"),
    "mistral-sdpa": _mistral,
    "llama-sdpa": lambda: _llama("sdpa"),
    "gpt2-eager": lambda: _gpt2("eager", 0.0),
    "gpt2-sdpa": lambda: _gpt2("sdpa", 0.0),
    "gpt2-dropout": lambda: _gpt2("eager", 0.1),
}


def _input_ids():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(123))


def _step(model, seed=0):
    model.zero_grad(set_to_none=True)
    ids = _input_ids()
    torch.manual_seed(seed)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, want, label=""):
    """Same loss and the same gradients (by parameter name) as the reference step."""
    (loss, grads), (ref_loss, ref_grads) = got, want
    torch.testing.assert_close(loss, ref_loss, msg=lambda m: f"{label} loss: {m}")
    assert grads.keys() == ref_grads.keys()
    for key in ref_grads:
        torch.testing.assert_close(grads[key], ref_grads[key], msg=lambda m: f"{label} {key}: {m}")


def _counted_bytes(model):
    ids = _input_ids()
    with memopt.SavedTensorCounter(exclude=list(model.parameters()) + list(model.buffers())) as counter:
        model(input_ids=ids, labels=ids, use_cache=False)
    return counter.total_bytes


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("policy", ["selective", "full"])
def test_loss_and_gradients_match_unwrapped(name, policy):
    torch.manual_seed(0)
    model = MODELS[name]()
    ref_loss, ref_grads = _step(model, seed=7)
    memopt.wrap(model, policy=policy)
    assert list(wrap_module.wrapped_policies(model).values()) == [policy, policy]
    loss, grads = _step(model, seed=7)
    _assert_same((loss, grads), (ref_loss, ref_grads))


def test_gpt2_dropout_is_active_so_replay_is_tested():
    torch.manual_seed(0)
    model = _gpt2("eager", 0.1)
    assert not torch.equal(_step(model, seed=1)[0], _step(model, seed=2)[0])


@pytest.mark.parametrize("name", ["llama-sdpa", "mistral-sdpa", "gpt2-eager"])
def test_finds_decoder_layers(name):
    model = MODELS[name]()
    layer_class = {
        "llama": transformers.models.llama.modeling_llama.LlamaDecoderLayer,
        "mistral": transformers.models.mistral.modeling_mistral.MistralDecoderLayer,
        "gpt2": transformers.models.gpt2.modeling_gpt2.GPT2Block,
    }[name.split("-")[0]]
    found = wrap_module.find_layers(model)
    assert [type(m) for _, m in found] == [layer_class, layer_class]


def test_bert_encoder_layers_found_and_match():
    config = transformers.BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).train()
    ids = _input_ids()
    assert [type(m) for _, m in wrap_module.find_layers(model)] == [transformers.models.bert.modeling_bert.BertLayer] * 2

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids).last_hidden_state
        out.square().mean().backward()
        return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    ref_out, ref_grads = step()
    memopt.wrap(model, policy="selective")
    out, grads = step()
    _assert_same((out, grads), (ref_out, ref_grads))


@pytest.mark.parametrize("name", ["llama-sdpa", "llama-eager", "gpt2-eager"])
def test_saved_bytes_against_hf_gradient_checkpointing(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    counted = {"none": _counted_bytes(model)}
    for policy in ["selective", "full"]:
        memopt.wrap(model, policy=policy)
        counted[policy] = _counted_bytes(model)
        memopt.unwrap(model)
    hf_checkpointing(model, enable=True)
    hf_full = _counted_bytes(model)
    hf_checkpointing(model, enable=False)
    assert counted["full"] <= hf_full
    assert hf_full < counted["selective"] < counted["none"]


@pytest.mark.parametrize("name", ["llama-sdpa", "gpt2-eager"])
def test_wrap_turns_the_cache_off_per_call_and_leaves_the_config(tmp_path, name):
    """wrap set config.use_cache = False while wrapped, which save_pretrained wrote to config.json:
    the model reloaded from it (unwrapped) made no cache. Hugging Face's own checkpointing keeps
    the config and turns the cache off per call, with gradients on."""
    torch.manual_seed(0)
    model = memopt.wrap(MODELS[name]())
    ids = _input_ids()
    assert model.config.use_cache is True
    assert model(input_ids=ids, labels=ids).cache is None  # with gradients: no cache, as before
    assert model(input_ids=ids).cache is None
    assert model(input_ids=ids, use_cache=True).cache is not None  # asked for: copied for the recompute
    with torch.no_grad():  # as the config says, as the unwrapped model (generate, evaluation)
        assert model(input_ids=ids).cache is not None
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    assert reloaded.config.use_cache is True
    assert reloaded(input_ids=ids).cache is not None
    memopt.unwrap(model)
    assert model(input_ids=ids).cache is not None  # the per-call switch went with unwrap


def test_wrap_refuses_model_with_hf_checkpointing_on():
    model = _llama("sdpa")
    hf_checkpointing(model, enable=True)
    with pytest.raises(RuntimeError, match="gradient checkpointing on"):
        memopt.wrap(model)


@pytest.mark.parametrize("name", ["llama-sdpa", "gpt2-eager"])
def test_plan_predicts_counted_bytes(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    ids = _input_ids()
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    plan = memopt.plan(model, inputs, budget_bytes=10**9)
    for mix in [["none", "none"], ["selective", "full"], ["full", "full"], ["none", "selective"]]:
        plan.policies = mix
        memopt.wrap(model, plan=plan)
        counted = _counted_bytes(model)
        memopt.unwrap(model)
        # Shared inputs that need no gradient (masks, rotary cos/sin, position ids) are saved or
        # not depending on the policies; the prediction counts them once, always.
        assert plan.predicted_bytes - plan.shared_bytes <= counted <= plan.predicted_bytes, mix
    assert 0 < plan.shared_bytes < 0.05 * plan.predicted_bytes
    costs = plan.layer_costs
    budget = costs[0].device_bytes[("none", False)] + costs[1].device_bytes[("selective", False)] + plan.other_bytes + plan.shared_bytes
    chosen = memopt.plan(model, inputs, budget_bytes=budget)
    assert chosen.predicted_bytes <= budget
    # The choice is the fastest that fits under its own measurements: no slower than the mix the
    # budget was built from (on a CPU "full" can be the faster policy, so it may still win).
    alternative = dataclasses.replace(chosen, choices=[("none", False), ("selective", False)])
    assert alternative.predicted_bytes <= budget
    assert chosen.predicted_extra_seconds <= alternative.predicted_extra_seconds


def _hub_kernels_side_effects_allowed():
    """transformers >= 5.25 brings the ``kernels`` package, whose hub forward on the attention
    module sets and resets a context variable inside each layer. Dynamo refuses any write to outer
    state inside a checkpoint region ("HOP: Unsafe side effect"), for plain
    ``torch.utils.checkpoint`` as much as for memopt, unless told not to replay it in the backward;
    a set/reset pair need not be replayed. The flag is the one torchtitan and transformers' own
    examples set; without ``kernels`` the test runs with dynamo's defaults."""
    flag = "skip_fwd_side_effects_in_bwd_under_checkpoint"
    if importlib.util.find_spec("kernels") is None or not hasattr(torch._dynamo.config, flag):
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(**{flag: True})


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_wrapped_llama_compiles_fullgraph_and_matches_eager(policy, compile_cache):
    """Wrapping adds no graph break: the whole wrapped Llama (loss included) is one graph."""
    torch.manual_seed(0)
    model = _llama("sdpa")
    ref_loss, ref_grads = _step(model, seed=7)
    memopt.wrap(model, policy=policy)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with _hub_kernels_side_effects_allowed():
        loss, grads = _step(compiled, seed=7)
    assert all(key.startswith("_orig_mod.") for key in grads)
    _assert_same((loss, {key.removeprefix("_orig_mod."): g for key, g in grads.items()}), (ref_loss, ref_grads))


# More architectures, each built tiny from its config: wrap must find the repeated layers and
# reproduce the loss and every gradient. (name, config class, model class, config arguments)
_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
ZOO = [
    ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", _DECODER),
    ("gemma2", "Gemma2Config", "Gemma2ForCausalLM", {**_DECODER, "head_dim": 16, "sliding_window": 8}),
    ("phi3", "Phi3Config", "Phi3ForCausalLM", {**_DECODER, "pad_token_id": 0}),
    ("mixtral-moe", "MixtralConfig", "MixtralForCausalLM", {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2}),
    ("gpt-neox", "GPTNeoXConfig", "GPTNeoXForCausalLM",
     dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
          max_position_embeddings=64)),
    ("opt", "OPTConfig", "OPTForCausalLM",
     dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64,
          vocab_size=VOCAB, max_position_embeddings=64, dropout=0.0)),
    ("falcon", "FalconConfig", "FalconForCausalLM",
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB)),
    ("t5", "T5Config", "T5ForConditionalGeneration",
     dict(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=VOCAB, dropout_rate=0.0)),
    # Encoder and decoder layers of different classes: both stacks are found.
    ("bart", "BartConfig", "BartForConditionalGeneration",
     dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
          encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=VOCAB, max_position_embeddings=64, dropout=0.1)),
]
ENCODER_DECODER = {"t5", "bart"}


@pytest.mark.parametrize("name, config_class, model_class, kwargs", ZOO, ids=[z[0] for z in ZOO])
def test_more_architectures_match_unwrapped(name, config_class, model_class, kwargs):
    if not hasattr(transformers, config_class) or not hasattr(transformers, model_class):
        pytest.skip(f"transformers {transformers.__version__} has no {model_class}")
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**kwargs)).train()
    ids = _input_ids()
    # T5's decoder keeps a cache unless every config in the model says not to (its decoder stack
    # holds its own copy of the config): wrap must turn off each of them.
    extra = {"decoder_input_ids": ids} if name == "t5" else {}

    def step():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        loss = model(input_ids=ids, labels=ids, **extra).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref_grads = step()
    layers = len(wrap_module.find_layers(model))
    assert layers == (4 if name in ENCODER_DECODER else 2)
    for policy in ["selective", "full"]:
        memopt.wrap(model, policy=policy)
        loss, grads = step()
        memopt.unwrap(model)
        _assert_same((loss, grads), (ref_loss, ref_grads), policy)


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_lora_adapters_with_dropout_match_unwrapped(policy):
    """Frozen base weights, LoRA adapters with their own dropout (PEFT): only the adapters get
    gradients, equal to the unwrapped model's; the first layer's input needs no gradient."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    model = peft.get_peft_model(_llama("sdpa"), config)
    ref_loss, ref_grads = _step(model, seed=7)
    assert ref_grads and all("lora_" in name for name in ref_grads)
    assert len(wrap_module.find_layers(model)) == 2
    memopt.wrap(model, policy=policy)
    loss, grads = _step(model, seed=7)
    _assert_same((loss, grads), (ref_loss, ref_grads))


@pytest.mark.parametrize("name", ["llama-sdpa", "gpt2-dropout"])
def test_padding_mask_passes_through_the_checkpoint(name):
    """A left-padded batch: the attention mask reaches every wrapped layer (as a shared input the
    recompute sees again) and the result equals the unwrapped model's."""
    torch.manual_seed(0)
    model = MODELS[name]()
    ids = _input_ids()
    mask = torch.ones_like(ids)
    mask[0, :5] = 0

    def step():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref_grads = step()
    unmasked_loss = _step(model, seed=3)[0]
    assert not torch.allclose(ref_loss, unmasked_loss)  # the mask matters
    memopt.wrap(model, policy="selective")
    loss, grads = step()
    _assert_same((loss, grads), (ref_loss, ref_grads))


@pytest.mark.parametrize("name", ["llama-sdpa", "gpt2-dropout"])
def test_offload_on_hf_model_moves_what_the_plan_predicts(name):
    """Offloading layers of a Hugging Face model (an engine that takes CPU tensors, so bytes
    really move): the result equals the unwrapped model's and the engine moves exactly the host
    bytes the plan measured."""
    torch.manual_seed(0)
    model = MODELS[name]()
    ref_loss, ref_grads = _step(model, seed=5)
    off = memopt.offload(min_bytes=1024, allow_cpu_source=True, pin_memory=False)
    ids = _input_ids()
    plan = memopt.plan(model, {"input_ids": ids, "labels": ids, "use_cache": False}, budget_bytes=10**9,
                       offload=off, repeats=1)
    plan.choices = [("none", True), ("none", False)]
    assert plan.layer_costs[0].host_bytes[("none", True)] > 0
    before = off.stats()["bytes_to_host"]
    memopt.wrap(model, plan=plan, offload=off)
    loss, grads = _step(model, seed=5)
    assert off.stats()["bytes_to_host"] - before == plan.predicted_host_bytes
    _assert_same((loss, grads), (ref_loss, ref_grads))
