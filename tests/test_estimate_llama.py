"""memopt.estimate for arch='llama': the layer formula against bytes counted on a Hugging Face
Llama, the whole-step prediction against the measured peak (bench.long_context), LoRA and
long-context arithmetic by hand, and the seq-length search with its binding term."""

from __future__ import annotations

import pytest
import torch

import memopt
from memopt.estimate import ModelConfig, llama_final_norm_saved, llama_layer_saved, seq_len_limit, strategies

transformers = pytest.importorskip("transformers")

SHAPE = dict(arch="llama", n_layers=2, d_model=64, n_heads=2, n_kv_heads=1, d_ff=172, vocab_size=1000,
             seq_len=96, micro_batch=2, attention="flash", dropout=0.0, device="cpu")


def _hf_llama(cfg: ModelConfig, dtype: torch.dtype, lora_rank: int | None, targets=("q_proj", "v_proj")):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.seq_len, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).to(dtype)
    if lora_rank is not None:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=lora_rank, target_modules=list(targets)))
    return model.train()


def _decoder(model):
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    return decoder if decoder is not None else model.base_model.model.model


def _counted_per_layer(model, cfg, modules=None) -> list[int]:
    """Bytes each decoder layer's forward (or each of ``modules``') saves for backward, parameters
    and buffers excluded."""
    modules = _decoder(model).layers if modules is None else modules
    resident = list(model.parameters()) + list(model.buffers())
    counts, hooks = [], []
    for layer in modules:
        def pre(module, args, kwargs):
            module._counter = memopt.SavedTensorCounter(exclude=resident)
            module._counter.__enter__()

        def post(module, args, kwargs, out):
            module._counter.__exit__(None, None, None)
            counts.append(module._counter.total_bytes)

        hooks += [layer.register_forward_pre_hook(pre, with_kwargs=True), layer.register_forward_hook(post, with_kwargs=True)]
    ids = torch.randint(cfg.vocab_size, (cfg.micro_batch, cfg.seq_len))
    model(input_ids=ids, labels=ids, use_cache=False)
    for h in hooks:
        h.remove()
    return counts


LORA_CASES = [(None, ()), (8, ("q_proj", "v_proj")), (4, ("k_proj", "o_proj", "gate_proj", "down_proj")),
              (4, ("gate_proj", "down_proj"))]


def _rope(cfg, dtype, index, targets) -> int:
    """The rotary cos/sin a layer is handed and saves (shared by the layers, counted once in the
    model; one row per position, batch broadcast), unless nothing of its attention half needs a
    gradient (layer 0 under LoRA without an adapter on the attention projections)."""
    if index == 0 and cfg.lora_rank is not None and not set(targets) & {"q_proj", "k_proj", "v_proj", "o_proj"}:
        return 0
    return cfg.seq_len * 2 * (cfg.d_model // cfg.n_heads) * dtype.itemsize


@pytest.mark.parametrize("dtype,precision", [(torch.float32, "fp32"), (torch.bfloat16, "pure")])
@pytest.mark.parametrize("lora_rank,targets", LORA_CASES)
def test_layer_formula_matches_counted_bytes(dtype, precision, lora_rank, targets):
    """Every layer saves what llama_layer_saved says, plus the rotary cos/sin: exactly, layer 0
    under LoRA (frozen embeddings) too."""
    extra = dict(lora_rank=lora_rank, lora_targets=targets) if lora_rank else {}
    cfg = ModelConfig(**SHAPE, precision=precision, low_dtype=torch.bfloat16, **extra)
    model = _hf_llama(cfg, dtype, lora_rank, targets)
    counted = _counted_per_layer(model, cfg)
    tokens = cfg.micro_batch * cfg.seq_len
    for index, bytes_counted in enumerate(counted):
        attention, mlp = llama_layer_saved(cfg, input_requires_grad=index > 0 or lora_rank is None)
        expected = (sum(attention.values()) + sum(mlp.values())) * tokens + _rope(cfg, dtype, index, targets)
        assert expected == bytes_counted, (index, attention, mlp)


@pytest.mark.parametrize("dtype,precision", [(torch.float32, "fp32"), (torch.bfloat16, "pure")])
@pytest.mark.parametrize("lora_rank,targets", LORA_CASES)
def test_tiled_layer_and_final_norm_formulas_match_counted_bytes(dtype, precision, lora_rank, targets):
    """Under memopt.wrap(ffn_chunk_tokens=) (policy "none": the layer saves as in the forward)
    every layer saves what llama_layer_saved says for a config with ffn_chunk_tokens (norms and
    MLP keep their inputs only) and the final norm what llama_final_norm_saved says, exactly;
    the untiled final norm too."""
    extra = dict(lora_rank=lora_rank, lora_targets=targets) if lora_rank else {}
    cfg = ModelConfig(**SHAPE, precision=precision, low_dtype=torch.bfloat16, **extra)
    tiled_cfg = cfg.replace(ffn_chunk_tokens=40)
    model = _hf_llama(cfg, dtype, lora_rank, targets)
    tokens = cfg.micro_batch * cfg.seq_len
    final_norm = [_decoder(model).norm]
    assert _counted_per_layer(model, cfg, final_norm) == [llama_final_norm_saved(cfg) * tokens]
    memopt.wrap(model, policy="none", ffn_chunk_tokens=40)
    counted = _counted_per_layer(model, cfg)
    for index, bytes_counted in enumerate(counted):
        attention, mlp = llama_layer_saved(tiled_cfg, input_requires_grad=index > 0 or lora_rank is None)
        expected = (sum(attention.values()) + sum(mlp.values())) * tokens + _rope(cfg, dtype, index, targets)
        assert expected == bytes_counted, (index, attention, mlp)
    assert _counted_per_layer(model, cfg, final_norm) == [llama_final_norm_saved(tiled_cfg) * tokens]


@pytest.mark.parametrize("precision", ["fp32", "autocast"])
def test_measured_hf_llama_matches_counted_bytes_at_the_target_batch(precision):
    """memopt.estimate(model, ids) measured at batch 1, asked for 4: the rotary cos/sin Hugging Face
    computes once per forward, (1, seq, head_dim) whatever the batch, and (under autocast) the bf16
    weight copies are saved once, not once per sample."""
    cfg = ModelConfig(**dict(SHAPE, n_layers=1, seq_len=16))
    model = _hf_llama(cfg, torch.float32, None)
    est = memopt.estimate(model, {"input_ids": torch.randint(cfg.vocab_size, (1, 16)), "use_cache": False},
                          micro_batch=4, precision=precision)
    resident = list(model.parameters()) + list(model.buffers())
    with memopt.SavedTensorCounter(exclude=resident) as counter, \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
        model(input_ids=torch.randint(cfg.vocab_size, (4, 16)), use_cache=False)
    assert est.breakdown["activations"] + est.breakdown["fixed_activations"] == counter.total_bytes
    assert est.breakdown["fixed_activations"] >= 2 * 16 * (cfg.d_model // cfg.n_heads) * 4  # cos and sin


def test_llama_3_8b_parameters_and_lora_by_hand():
    """Llama-3-8B: 32 x (2*4096 norms + 4096*4096 q + 2*4096*1024 k,v + 4096*4096 o + 3*4096*14336 MLP)
    + 2*128256*4096 (untied embedding and head) + 4096 = 8,030,261,248; PEFT's default LoRA (rank 8
    on q_proj, v_proj): 32 * 8 * ((4096 + 4096) + (4096 + 1024)) = 3,407,872 trainable."""
    cfg = ModelConfig(**memopt.estimate_presets["llama-3-8b"], micro_batch=1, lora_rank=8)
    assert cfg.num_parameters == 8_030_261_248
    assert cfg.num_lora_parameters == 3_407_872
    b = memopt.estimate(cfg).breakdown
    # bf16 base weights + float32 adapters; Adam state and gradients for the adapters only.
    assert b["parameters"] == 2 * 8_030_261_248 + 4 * 3_407_872
    assert (b["gradients"], b["optimizer_state"], b["master_weights"]) == (4 * 3_407_872, 8 * 3_407_872, 0)


def test_plain_loss_holds_seq_by_vocab_and_chunked_does_not():
    cfg = ModelConfig(**{**SHAPE, "precision": "pure", "seq_len": 512, "vocab_size": 32000, "micro_batch": 1})
    tokens = 512
    plain = memopt.estimate(cfg.replace(policy="checkpoint"))
    # bf16 logits (2) + their float32 upcast (4) + log-probs (4) in forward; in backward logits,
    # log-probs and the nll_loss / log_softmax gradients: 2 + 3*4 = 14 bytes per logit.
    assert plain.breakdown["logits_loss"] == tokens * 32000 * 14
    chunked = memopt.estimate(cfg.replace(policy="checkpoint", loss="chunked", loss_chunk_tokens=128))
    assert chunked.breakdown["logits_loss"] < plain.breakdown["logits_loss"] / 3
    assert chunked.breakdown["logits_loss"] >= 128 * 32000 * 4


def test_offloaded_inputs_follow_the_host_budget():
    cfg = ModelConfig(**{**SHAPE, "n_layers": 8}, policy="full", offload=True, loss="chunked")
    layer_input = cfg.micro_batch * cfg.seq_len * cfg.d_model * 4
    unbounded = memopt.estimate(cfg)
    assert unbounded.host_bytes == 8 * layer_input
    assert unbounded.breakdown["activations"] == 2 * layer_input  # the current layer's and the prefetched one
    three = memopt.estimate(cfg.replace(host_memory_bytes=3 * layer_input + 5))
    assert three.host_bytes == 3 * layer_input
    assert three.breakdown["activations"] == (8 - 3 + 2) * layer_input
    none = memopt.estimate(cfg.replace(host_memory_bytes=layer_input - 1))
    assert none.host_bytes == 0 and none.breakdown["activations"] == 8 * layer_input
    assert none.total_bytes == memopt.estimate(cfg.replace(offload=False)).total_bytes


def test_tiled_ffn_bounds_the_recompute_by_the_chunk():
    cfg = ModelConfig(**{**SHAPE, "seq_len": 4096, "micro_batch": 1}, policy="full", loss="chunked")
    untiled = memopt.estimate(cfg).transients["layer_recompute"]
    tiled = memopt.estimate(cfg.replace(ffn_chunk_tokens=256)).transients["layer_recompute"]
    attention, mlp = llama_layer_saved(cfg)
    tiled_attention, tiled_mlp = llama_layer_saved(cfg.replace(ffn_chunk_tokens=256))
    # Tiled, the two norms keep neither rstd (4 bytes each) nor, their weights training, the
    # normalized rows (d_model float32 each); the MLP keeps its input only.
    assert sum(attention.values()) - sum(tiled_attention.values()) == 2 * 4 + 2 * cfg.d_model * 4
    assert tiled_mlp == {"mlp_input": cfg.d_model * 4}
    layer_input = 4096 * cfg.d_model * 4  # a float32 model's first norm saves the checkpointed input itself
    assert untiled == 4096 * (sum(attention.values()) + sum(mlp.values())) - layer_input
    assert tiled == 4096 * sum(tiled_attention.values()) + 256 * sum(mlp.values()) - layer_input


def test_seq_len_limit_is_largest_fitting_and_names_the_binding_term():
    cfg = ModelConfig(**{**SHAPE, "vocab_size": 32000, "micro_batch": 1}, precision="pure")
    budget = memopt.estimate(cfg.replace(seq_len=3000, policy="checkpoint")).total_bytes
    limit = seq_len_limit(budget, cfg, policy="checkpoint")
    assert limit.max_seq_len == 3000 == memopt.max_seq_len(budget, cfg, policy="checkpoint")
    assert limit.binding == "logits_loss"  # the plain loss's seq x vocab buffers
    assert memopt.estimate(cfg.replace(seq_len=3001, policy="checkpoint")).total_bytes > budget
    offloaded = cfg.replace(policy="selective", offload=True, host_memory_bytes=2**20, loss="chunked")
    assert seq_len_limit(2**40, offloaded).binding == "host memory"


def test_binding_term_is_one_that_grows_with_the_sequence():
    """Full fine-tuning of Llama-3-8B in 80 GiB: Adam's state (29.9 GiB) is the largest term at
    every length, but it does not grow with the sequence; what binds is the term that does (it used
    to be named optimizer_state for every strategy). The binding term is the one that grew the most
    from length 1 to the first length that does not fit."""
    from memopt.estimate import _config_estimate

    FIXED_TERMS = ("parameters", "gradients", "master_weights", "optimizer_state", "autocast_weights")
    cfg = ModelConfig(**memopt.estimate_presets["llama-3-8b"], micro_batch=1)
    expected = {"no checkpointing": "activations", "Hugging Face checkpointing": "logits_loss",
                "memopt selective": "activations", "memopt full": "activations", "memopt long-context": "workspace"}
    for name, strategy in strategies(cfg).items():
        limit = seq_len_limit(80 * 2**30, strategy)
        longest = limit.max_seq_len
        assert longest > 0
        over = _config_estimate(strategy.replace(seq_len=longest + 1))
        shortest = _config_estimate(strategy.replace(seq_len=1)).breakdown
        assert over.total_bytes > 80 * 2**30 and over.largest(1)[0][0] == "optimizer_state"
        growth = {k: v - shortest[k] for k, v in over.breakdown.items()}
        assert all(growth[k] == 0 for k in FIXED_TERMS)  # none of them grows with the sequence
        assert limit.binding == max(growth, key=growth.get) == expected[name], name
    # In 40 GiB the weights, gradients and Adam state alone (59.8 GiB) do not fit: no length fits,
    # and that is what the binding says, for every strategy.
    for strategy in strategies(cfg).values():
        limit = seq_len_limit(40 * 2**30, strategy)
        fixed = sum(limit.estimate.breakdown[k] for k in FIXED_TERMS)
        assert (limit.max_seq_len, limit.binding) == (0, "fixed terms") and fixed > 40 * 2**30
    # Fixed terms that fit with a few bytes to spare: length 1 does not fit, and the term that binds
    # is the largest one that depends on the sequence, not a fixed one.
    fixed = sum(_config_estimate(cfg.replace(seq_len=1)).breakdown[k] for k in FIXED_TERMS)
    limit = seq_len_limit(fixed + 1, cfg)
    assert limit.max_seq_len == 0 and limit.binding not in FIXED_TERMS + ("fixed terms",)


def test_headline_strategies_order():
    """Llama-3-8B + LoRA in 141 GiB with 128 GiB of host memory: each memopt step reaches further,
    long-context at least 8x Hugging Face checkpointing and 700K tokens (the numbers the README
    quotes; 685,318 before the norms were tiled)."""
    cfg = ModelConfig(**memopt.estimate_presets["llama-3-8b"], micro_batch=1, lora_rank=8,
                      host_memory_bytes=128 * 2**30)
    limits = {name: seq_len_limit(141 * 2**30, c).max_seq_len for name, c in strategies(cfg).items()}
    assert limits["no checkpointing"] < limits["Hugging Face checkpointing"] < limits["memopt full"]
    assert limits["memopt full"] < limits["memopt long-context"]
    assert limits["memopt long-context"] >= 8 * limits["Hugging Face checkpointing"]
    assert limits["memopt long-context"] >= 700_000


@pytest.mark.parametrize("changes,match", [
    (dict(arch="bert"), "arch must be one of"),
    (dict(n_kv_heads=3), "n_kv_heads must be a positive int dividing n_heads"),
    (dict(loss="fused"), "loss must be one of"),
    (dict(ffn_chunk_tokens=0), "ffn_chunk_tokens must be a positive int"),
    (dict(loss_chunk_tokens=True), "loss_chunk_tokens must be a positive int"),
    (dict(lora_rank=-2), "lora_rank must be a positive int"),
    (dict(lora_rank=8, lora_targets=("q_proj", "wq")), "lora_targets must be names from"),
    (dict(lora_rank=8, lora_targets="q_proj"), "lora_targets must be a non-empty tuple"),
    (dict(host_memory_bytes=1.5), "host_memory_bytes must be a positive int"),
    (dict(precision="autocast"), "precision='autocast' is modelled for arch='gpt2' only"),
    (dict(attention="math"), "attention must be 'flash'"),
    (dict(dropout=0.1), "dropout must be 0.0"),
    (dict(arch="gpt2", n_kv_heads=1), "n_kv_heads is modelled for arch='llama' only"),
    (dict(arch="gpt2", n_kv_heads=2, attention="math", dropout=0.1, lora_rank=4), "lora_rank is modelled for arch='llama' only"),
])
def test_bad_long_context_fields_name_the_argument(changes, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**SHAPE, **changes})


def test_attention_and_dropout_default_to_the_archs():
    """Left out (None), attention and dropout are the arch's: llama's flash and 0.0, gpt2's math
    and 0.1. Before, llama got gpt2's defaults and refused them."""
    shape = {k: v for k, v in SHAPE.items() if k not in ("attention", "dropout")}
    assert ModelConfig(**shape) == ModelConfig(**SHAPE)
    assert ModelConfig(**shape, attention=None, dropout=None) == ModelConfig(**SHAPE)
    assert memopt.estimate(ModelConfig(**shape)).total_bytes == memopt.estimate(ModelConfig(**SHAPE)).total_bytes
    gpt2 = dict(shape, arch="gpt2", n_kv_heads=None)
    made = ModelConfig(**gpt2)
    assert (made.attention, made.dropout) == ("math", 0.1)
    assert made == ModelConfig(**gpt2, attention="math", dropout=0.1)


def test_llama_refuses_other_policies():
    with pytest.raises(ValueError, match="policy must be one of .* for arch='llama'"):
        memopt.estimate(ModelConfig(**SHAPE, policy="test-unknown"))


def test_bench_prediction_within_10_percent_on_a_small_configuration():
    """The bench's check at its tiny preset: every strategy this memopt runs, measured peak of one
    accumulation micro-step against the estimate (the three CPU-scale configurations are the
    committed bench run, bench/results/long_context-default-cpu-*.json)."""
    long_context = pytest.importorskip("bench.long_context")
    pytest.importorskip("peft")
    settings = long_context.PRESETS["tiny"]
    shape = settings.configs[0]
    device = torch.device("cpu")
    skip = long_context.supports_long_context()
    checked = 0
    for strategy in settings.strategies:
        row = long_context.bench_point(shape, settings.seqs[0], strategy, device, skip)
        if row["status"].startswith("skipped"):
            continue
        assert row["measured_bytes"] is not None, row["status"]
        assert abs(row["predicted_bytes"] - row["measured_bytes"]) <= 0.10 * row["measured_bytes"], row
        checked += 1
    assert checked >= 4
