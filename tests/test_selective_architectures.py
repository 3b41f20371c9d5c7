"""``"selective"`` is exact on every architecture the test suite builds, in-place updates included.

Issue 15, "Done when": the architectures other test files build only for another purpose (the
chunked loss's families, its refusals, the planner's SqueezeBERT), and those where issue 15 item 1
and 11 saw ``"selective"`` go wrong or crash because the model updates a matmul output in place
(Gemma-3n, BigBird block-sparse, Falcon with eager attention ``scores /= sqrt(d)``, Nystromformer,
Swin-v2's position-bias MLP with ``ReLU(inplace=True)``), each built tiny from its config, in
float64: the output and every parameter gradient under ``memopt.wrap(policy="selective")`` equal
the unwrapped model's. (test_hf.py, test_wrap_hybrid.py, test_plan_budget.py and
test_wrap_cache.py compare the rest, each under "selective" and "full".)
"""

import importlib

import pytest
import torch

import memopt

transformers = pytest.importorskip("transformers")
wrap_module = importlib.import_module("memopt.wrap")

VOCAB = 64
_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)  # fmt: skip


def _text(ids):
    return {"input_ids": ids}


def _image(ids):
    return {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)}


# (name, config class, model class, config arguments, inputs from token ids)
ARCHITECTURES = [
    ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {**_DECODER, "head_dim": 8}, _text),
    ("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", {**_DECODER, "head_dim": 8, "sliding_window": 4}, _text),
    ("llama-bias", "LlamaConfig", "LlamaForCausalLM", {**_DECODER, "attention_bias": True, "mlp_bias": True}, _text),
    ("cohere", "CohereConfig", "CohereForCausalLM", _DECODER, _text),
    ("granite", "GraniteConfig", "GraniteForCausalLM", _DECODER, _text),
    ("squeezebert", "SqueezeBertConfig", "SqueezeBertModel",
     dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
          embedding_size=32, q_groups=2, k_groups=2, v_groups=2, post_attention_groups=2, intermediate_groups=2,
          output_groups=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), _text),
    ("falcon-eager", "FalconConfig", "FalconForCausalLM",
     dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB, attn_implementation="eager"),
     _text),
    ("nystromformer", "NystromformerConfig", "NystromformerModel",
     dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
          segment_means_seq_len=32, num_landmarks=4, conv_kernel_size=3, max_position_embeddings=64,
          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), _text),
    ("bigbird-block-sparse", "BigBirdConfig", "BigBirdModel",
     dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
          attention_type="block_sparse", block_size=2, num_random_blocks=2, max_position_embeddings=64,
          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), _text),
    ("gemma3n", "Gemma3nTextConfig", "Gemma3nForCausalLM",
     dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          head_dim=8, vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
          max_position_embeddings=64, sliding_window=4, laurel_rank=4, altup_num_inputs=2,
          activation_sparsity_pattern=[0.0, 0.0], layer_types=["sliding_attention", "full_attention"],
          num_kv_shared_layers=0), _text),
    ("swinv2", "Swinv2Config", "Swinv2Model",
     dict(image_size=32, patch_size=4, embed_dim=16, depths=[2], num_heads=[2], window_size=4,
          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0), _image),
]


def _output(out):
    for key in ("logits", "last_hidden_state"):
        value = getattr(out, key, None)
        if value is not None:
            return value
    raise AssertionError(f"no logits or last_hidden_state in {type(out).__name__}")


@pytest.mark.parametrize("name, config_class, model_class, kwargs, inputs", ARCHITECTURES, ids=[a[0] for a in ARCHITECTURES])
def test_selective_equals_plain(name, config_class, model_class, kwargs, inputs):
    if not hasattr(transformers, config_class) or not hasattr(transformers, model_class):
        pytest.skip(f"transformers {transformers.__version__} has no {model_class}")
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**kwargs)).train().double()
    batch = inputs(torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0)))
    weights = None

    def step():
        nonlocal weights
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        out = _output(model(**batch))
        if weights is None:
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
        (out * weights).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_out, ref_grads = step()
    # BigBird falls back to full attention on sequences too short for its blocks.
    assert getattr(model.config, "attention_type", "block_sparse") == "block_sparse"
    memopt.wrap(model, policy="selective", loss="plain")
    assert len(wrap_module.wrapped_policies(model)) >= 2
    out, grads = step()
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    assert grads.keys() == ref_grads.keys()
    for key in ref_grads:
        torch.testing.assert_close(grads[key], ref_grads[key], rtol=1e-9, atol=1e-11, msg=lambda m: f"{key}: {m}")
