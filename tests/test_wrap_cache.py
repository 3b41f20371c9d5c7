"""memopt.wrap on layers given a key/value cache while training, and the chunked loss only where
the model's loss is Hugging Face's ForCausalLMLoss.

Issue 15 item 15: XLM passes its layers a cache it builds on every call (use_cache=False or not),
and each layer appends to it; a recompute saw the appended cache. memopt.checkpoint now hands
every recompute a copy of the cache as the forward saw it (note [a key/value cache argument]),
and refuses a cache that writes into its tensors in place. Before, wrap refused XLM.

Also: BartForCausalLM and XLMWithLMHeadModel compute their loss themselves, over unshifted
labels, never calling loss_function; the default loss='chunked' (shifted, ForCausalLMLoss)
gave them a different loss without a word.
"""

import importlib

import pytest
import torch
from torch import nn

import memopt

transformers = pytest.importorskip("transformers")
wrap_module = importlib.import_module("memopt.wrap")

VOCAB = 100


def _ids():
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))


def _step(model, **inputs):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    out = model(**inputs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, want):
    (out, grads), (ref_out, ref_grads) = got, want
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-12, atol=1e-12)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-10, atol=1e-12, msg=name)


def _xlm(model_class):
    config = transformers.XLMConfig(
        vocab_size=VOCAB, emb_dim=16, n_layers=2, n_heads=2, dropout=0.1, attention_dropout=0.1,
    )  # fmt: skip
    return getattr(transformers, model_class)(config).train().double()


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_xlm_trains_wrapped_exactly(policy):
    """XLM's layers append to the cache XLM builds: loss and every gradient (float64, dropout on)
    equal the unwrapped model's, and the real cache gets each layer's keys once."""
    torch.manual_seed(0)
    model = _xlm("XLMWithLMHeadModel")
    ids = _ids()
    ref = _step(model, input_ids=ids, labels=ids)
    memopt.wrap(model, policy=policy)
    assert wrap_module.wrapped_policies(model)["transformer.attentions.0"] == policy
    _assert_same(_step(model, input_ids=ids, labels=ids), ref)


def _llama():
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).train().double()


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_a_cache_asked_for_while_training_is_exact(policy):
    """use_cache=True while training: loss, gradients and the returned cache's keys and values
    equal the unwrapped model's (the recompute appends to a copy, not to the returned cache)."""
    torch.manual_seed(0)
    model = _llama()
    ids = _ids()
    ref = _step(model, input_ids=ids, labels=ids, use_cache=True)
    # Hugging Face's loss runs in float32 whatever the logits' dtype; the chunked one would not.
    memopt.wrap(model, policy=policy, loss="plain")
    got = _step(model, input_ids=ids, labels=ids, use_cache=True)
    _assert_same(got, ref)
    for layer, ref_layer in zip(got[0].past_key_values.layers, ref[0].past_key_values.layers):
        assert layer.keys.shape == ref_layer.keys.shape == (2, 2, 8, 8)
        torch.testing.assert_close(layer.keys, ref_layer.keys, rtol=0, atol=0)
        torch.testing.assert_close(layer.values, ref_layer.values, rtol=0, atol=0)


def test_a_cache_written_in_place_is_refused():
    """A StaticCache writes into its preallocated tensors: a copy sharing them cannot keep the
    forward's view, so memopt.checkpoint refuses it rather than recompute from the written one."""
    model = _llama()
    ids = _ids()
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    memopt.wrap(model, policy="full")
    with pytest.raises(ValueError, match=r"memopt.checkpoint: fn wrote into the tensors of its key/value cache"):
        model(input_ids=ids, labels=ids, cache=cache, use_cache=True)


def _bart_causal_lm():
    config = transformers.BartConfig(
        d_model=16, decoder_layers=2, encoder_layers=2, decoder_attention_heads=2, encoder_attention_heads=2,
        decoder_ffn_dim=32, encoder_ffn_dim=32, vocab_size=VOCAB, max_position_embeddings=32, dropout=0.0,
    )  # fmt: skip
    return transformers.BartForCausalLM(config).train().double()


@pytest.mark.parametrize("build", [_bart_causal_lm, lambda: _xlm("XLMWithLMHeadModel")], ids=["bart", "xlm"])
def test_a_model_computing_its_own_loss_keeps_it(build):
    """These models' losses are not ForCausalLMLoss (no shift): the default keeps the model's
    loss (equal to unwrapped), and loss='chunked' is refused, saying why."""
    torch.manual_seed(0)
    model = build()
    ids = _ids()
    ref = _step(model, input_ids=ids, labels=ids)
    memopt.wrap(model)
    _assert_same(_step(model, input_ids=ids, labels=ids), ref)
    memopt.unwrap(model)
    with pytest.raises(ValueError, match=r"forward computes its loss itself, not with loss_function"):
        memopt.wrap(model, loss="chunked")


class _AppendingLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, cache=None):
        cache.append(x)
        return self.linear(torch.cat(cache).sum(0, keepdim=True))


def test_a_cache_that_is_not_a_transformers_cache_is_refused_by_name():
    """Only a transformers.Cache can be copied for the recompute; any other cache object a
    layer gets while training (here a list it appends to) is refused, naming the layer."""
    model = nn.ModuleList([_AppendingLayer(), _AppendingLayer()])
    memopt.wrap(model, layers=_AppendingLayer)
    x = torch.randn(1, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"layer '0' \(_AppendingLayer\) got a key/value cache \(cache=, list\)"):
        model[0](x, cache=[])
