"""memopt.wrap(ffn_chunk_tokens=) tiles the token-wise norms around the MLP too (memopt.tiled_ffn:
find_norms, find_stack_norms): each layer's RMSNorm/LayerNorm modules and the final norm run chunk
by chunk and save only their input. Against the unwrapped model in float64 (loss and every
gradient at 1e-12) on Llama, Gemma 2 and GPT-2, with PEFT LoRA and without, dropout included; in
a bf16 model the float32 copies Hugging Face's RMSNorm saves are gone (counted)."""

import copy

import pytest
import torch
from torch import nn

import memopt
from memopt.tiled_ffn import find_norms, find_stack_norms, norm_width, tiled_ffn

transformers = pytest.importorskip("transformers")

POLICIES = ["none", "selective", "full"]
VOCAB = 128


def _assert_exact(got, want, label=""):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        scale = (w.abs().max().item() if w.numel() else 0.0) or 1.0
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12 * scale, msg=lambda m: f"{label} [{i}]: {m}")


def _llama(dtype=torch.float64):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(dtype).train()


def _gemma2(dtype=torch.float64):
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, max_position_embeddings=64, attn_implementation="eager",
    )  # fmt: skip
    return transformers.Gemma2ForCausalLM(config).to(dtype).train()


def _gpt2(dtype=torch.float64, attn_dropout=0.0):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=attn_dropout, attn_pdrop=attn_dropout,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).to(dtype).train()


MODELS = {"llama": _llama, "gemma2": _gemma2, "gpt2": _gpt2}
NORMS = {  # what wrap tiles besides the MLPs, per layer and beside the layers
    "llama": (["input_layernorm", "post_attention_layernorm"], "model.norm"),
    "gemma2": (["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"],
               "model.norm"),
    "gpt2": (["ln_1", "ln_2"], "transformer.ln_f"),
}


LORA_TARGETS = {"llama": ["q_proj", "v_proj"], "gemma2": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}


def _lora(model, name):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=LORA_TARGETS[name], lora_dropout=0.0, fan_in_fan_out=name == "gpt2")
    return peft.get_peft_model(model, config).double().train()


def _ids(seq=19):
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(0))


def _run(model, ids, seed=3, skip=()):
    """Loss and the gradient of every trainable parameter (but those named in ``skip``), under a fixed seed."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for _, p in params:
        p.grad = None
    torch.manual_seed(seed)
    loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    return (loss.detach(), *[p.grad.clone() for n, p in params if n not in skip])


def _tiled_norm_names(model) -> set[str]:
    return {name for name, m in model.named_modules() if norm_width(m) is not None and "forward" in m.__dict__}


def _float32_norm_weights(model, name) -> list[str]:
    """Gemma's RMSNorm computes in float32 even in a float64 model (``x.float()``, and
    ``1 + weight.float()``), so its weight gradient is a float32 sum over tokens, which the chunked
    sum rounds differently: those gradients are compared at float32 resolution."""
    return [n for n, p in model.named_parameters() if name == "gemma2" and "norm" in n and p.requires_grad]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("lora", [False, True], ids=["full-finetune", "lora"])
@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt2"])
def test_wrap_with_tiled_norms_equals_unwrapped(name, lora, policy):
    model = MODELS[name]()
    model = _lora(model, name) if lora else model
    ids = _ids()
    float32_sums = _float32_norm_weights(model, name)
    want = _run(model, ids, skip=float32_sums)
    want_float32 = [p.grad.clone() for n, p in model.named_parameters() if n in float32_sums]
    memopt.wrap(model, policy=policy, ffn_chunk_tokens=5, loss="plain")  # 38 tokens: chunks of 5, ..., 3
    per_layer, final = NORMS[name]
    prefix = "base_model.model." if lora else ""
    layers = "model.layers" if name != "gpt2" else "transformer.h"
    expected = {f"{prefix}{layers}.{i}.{n}" for i in range(2) for n in per_layer} | {prefix + final}
    assert _tiled_norm_names(model) == expected
    _assert_exact(_run(model, ids, skip=float32_sums), want, f"{name} lora={lora} {policy}")
    for grad, (n, p) in zip(want_float32, [(n, p) for n, p in model.named_parameters() if n in float32_sums]):
        torch.testing.assert_close(p.grad, grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item(), msg=lambda m: f"{n}: {m}")
    memopt.unwrap(model)
    assert _tiled_norm_names(model) == set()
    _assert_exact(_run(model, ids, skip=float32_sums), want, "unwrapped")


@pytest.mark.parametrize("policy", POLICIES)
def test_tiled_norms_same_seed_same_result_with_attention_dropout(policy):
    """GPT-2 with active attention and embedding dropout: the tiled norms draw nothing and leave
    the RNG as they found it, so the wrapped model equals the unwrapped one under the same seed."""
    model = _gpt2(attn_dropout=0.2)
    ids = _ids()
    want = _run(model, ids)
    assert not torch.equal(_run(model, ids, seed=4)[0], want[0])  # the dropout is active
    memopt.wrap(model, policy=policy, ffn_chunk_tokens=7, loss="plain")
    _assert_exact(_run(model, ids), want, policy)


def _float32_saved_bytes(module, run, parameters) -> int:
    """Bytes of the float32 storages ``module``'s forward saves for backward during ``run()``,
    ``parameters`` left out."""
    float32 = {}
    parameters = list(parameters)

    def on_save(tensor, key, nbytes):
        if tensor.dtype == torch.float32:
            float32[key] = nbytes

    def pre(m, args):
        m._counter = memopt.SavedTensorCounter(exclude=parameters, on_save=on_save)
        m._counter.__enter__()

    def post(m, args, out):
        m._counter.__exit__(None, None, None)

    hooks = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return sum(float32.values())


@pytest.mark.parametrize("lora", [False, True], ids=["full-finetune", "lora"])
def test_bf16_llama_norms_save_no_float32_copy(lora):
    """A bf16 Llama layer's norms keep float32 copies of their inputs (2 x d_model x 4 bytes per
    token) and rstd untiled; tiled, the only float32 tensors a layer saves are SDPA's log-sum-exp
    (one per head and token) and, under LoRA, what PEFT's float32 adapters save (their input
    copies and lora_A outputs). The final norm saves no float32 tensor at all."""
    model = _llama(torch.bfloat16)
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    decoder = model.get_decoder()
    layer, final_norm = decoder.layers[1], decoder.norm
    ids = _ids(32)
    tokens, d, heads = ids.numel(), 64, 4
    run = lambda: model(ids, labels=ids, use_cache=False)  # noqa: E731
    count = lambda module: _float32_saved_bytes(module, run, model.parameters())  # noqa: E731
    untiled = count(layer), count(final_norm)
    memopt.wrap(model, policy="none", ffn_chunk_tokens=8)
    tiled = count(layer), count(final_norm)
    adapters = 2 * tokens * (d + 4) * 4 if lora else 0  # q_proj, v_proj: float32 input copy and rank-4 output
    logsumexp = tokens * heads * 4
    assert tiled == (logsumexp + adapters, 0)
    assert untiled == (logsumexp + adapters + 2 * tokens * (d + 1) * 4, tokens * (d + 1) * 4)


class _FooLayerNorm(nn.Module):
    """A Hugging Face-style norm found by its class name."""

    def __init__(self, d, data_format="channels_last"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.data_format = data_format

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _AdaptiveLayerNorm(nn.Module):
    """Named like a norm but conditioned on a second input through a submodule: not token-wise."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Linear(d, d)

    def forward(self, x, condition):
        return nn.functional.layer_norm(x, x.shape[-1:]) * self.scale(condition)


def test_norm_width_recognises_token_wise_norms_only():
    assert norm_width(nn.LayerNorm(8)) == 8
    assert norm_width(nn.RMSNorm(8)) == 8
    assert norm_width(_FooLayerNorm(8)) == 8
    assert norm_width(transformers.models.llama.modeling_llama.LlamaRMSNorm(8)) == 8
    assert norm_width(nn.LayerNorm((4, 8))) is None  # normalises two dims: rows are not independent
    assert norm_width(_FooLayerNorm(8, data_format="channels_first")) is None
    assert norm_width(_AdaptiveLayerNorm(8)) is None
    for other in (nn.GroupNorm(2, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Dropout()):
        assert norm_width(other) is None, other


class _Layer(nn.Module):
    def __init__(self, d=8, norm=None):
        super().__init__()
        self.norm = norm if norm is not None else nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 16), nn.GELU(), nn.Linear(16, d), nn.LayerNorm(d))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class _Model(nn.Module):
    def __init__(self, shared_norm=False, d=8):
        super().__init__()
        shared = nn.LayerNorm(d) if shared_norm else None
        self.layers = nn.ModuleList(_Layer(d, shared) for _ in range(2))
        self.final = _FooLayerNorm(d)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.final(x)


def test_finds_norms_outside_the_mlp_and_the_final_norm():
    model = _Model()
    assert [name for name, _ in find_norms(model.layers[0])] == ["norm"]  # mlp.3 runs inside the MLP's chunks
    assert find_stack_norms(model, ["layers.0", "layers.1"]) == [("final", model.final)]


@pytest.mark.parametrize("shared_norm", [False, True], ids=["own-norms", "shared-norm"])
def test_plain_model_with_tiled_norms_equals_unwrapped(shared_norm):
    """A norm shared by the layers is tiled once (not nested); unwrap puts every forward back."""
    model = _Model(shared_norm).double()
    x = torch.randn(3, 7, 8, dtype=torch.float64)

    def run():
        model.zero_grad(set_to_none=True)
        out = model(x)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
        return (out.detach(), *[p.grad.clone() for p in model.parameters()])

    want = run()
    memopt.wrap(model, policy="full", ffn_chunk_tokens=4)
    assert _tiled_norm_names(model) == {"layers.0.norm", "final"} | (set() if shared_norm else {"layers.1.norm"})
    assert model.layers[0].norm.forward.previous is None  # the shared norm's forward is not tiled twice
    _assert_exact(run(), want)
    memopt.unwrap(model)
    assert _tiled_norm_names(model) == set()


def test_tiled_norm_called_otherwise_raises_naming_it():
    layer = _Layer()
    layer.forward = lambda x: layer.norm(x.transpose(-1, -2))  # a norm across the wrong dim
    model = _Model()
    model.layers[0] = layer
    memopt.wrap(model, policy="none", ffn_chunk_tokens=4)
    with pytest.raises(ValueError, match=r"the norm 'layers.0.norm' normalises 8 features but got an input of shape \(3, 8, 5\)"):
        model(torch.randn(3, 5, 8))
    with pytest.raises(TypeError, match=r"the norm 'final' was called with more than one tensor argument"):
        model.final(torch.randn(3, 8), torch.randn(3, 8))


def test_tiled_norm_of_no_tokens_equals_untiled():
    """An empty sequence: the output and the gradients (zeros for the weight and bias, as the
    untiled norm gives) are the untiled norm's."""
    norm = nn.LayerNorm(8, dtype=torch.float64)
    x = torch.randn(2, 0, 8, dtype=torch.float64, requires_grad=True)
    want = [norm(x)]
    want += torch.autograd.grad(want[0].sum(), (x, *norm.parameters()))
    got = [tiled_ffn(norm, x, 4, list(norm.parameters()))]
    got += torch.autograd.grad(got[0].sum(), (x, *norm.parameters()))
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in want]
    _assert_exact(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_half_norm_weight_gradient_over_many_chunks_within_twice_eager_error(dtype):
    """A tiled norm (what wrap installs: tiled_ffn over the norm module) in float16/bfloat16: its
    weight gradient, a sum over every token, is summed over the chunks in float32 and cast once.
    Summed in the weight's dtype, each chunk added one rounding of the whole sum (RMSNorm, 4096
    tokens in 256 chunks: 5.8x eager's error in bf16, 7.6x in fp16)."""
    tokens, d, chunk = 4096, 64, 16
    norm = nn.RMSNorm(d, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(tokens, d, dtype=torch.float64)
    grad = torch.randn(tokens, d, dtype=torch.float64)

    def weight_grad(dtype, tiled=False):
        module = copy.deepcopy(norm).to(dtype)
        out = tiled_ffn(module, x.to(dtype), chunk, [module.weight]) if tiled else module(x.to(dtype))
        (result,) = torch.autograd.grad(out, module.weight, grad.to(dtype))
        return result

    reference, eager, ours = weight_grad(torch.float64), weight_grad(dtype), weight_grad(dtype, tiled=True)
    assert ours.dtype == dtype
    error = ((ours.double() - reference).norm() / reference.norm()).item()
    eager_error = ((eager.double() - reference).norm() / reference.norm()).item()
    assert error <= 2 * eager_error, f"relative error {error:.3g} > twice eager's {eager_error:.3g}"


def _qwen3(dtype=torch.float64):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.Qwen3ForCausalLM(config).to(dtype).train()


def test_head_wise_norms_run_in_as_many_chunks_as_the_hidden_norms(monkeypatch):
    """Qwen3's q_norm / k_norm normalise head_dim on (batch, seq, heads, head_dim): 4 (2) rows a
    token. Their chunks hold hidden // head_dim times the rows, the elements of ffn_chunk_tokens
    tokens of the hidden norms, so that no tiled norm runs in more than ceil(38 / 5) = 8 chunks
    (q_norm ran in 19 before); the model's loss and gradients stay the unwrapped model's."""
    model = _qwen3()
    ids = _ids()
    # Qwen3RMSNorm computes in float32 in a float64 model: its input gradients are float32
    # values, the same per row tiled or not; only the weights' sums over rows are reordered.
    want = _run(model, ids)
    memopt.wrap(model, policy="selective", ffn_chunk_tokens=5, loss="plain")
    head_norms = {n for n in _tiled_norm_names(model) if n.endswith(("q_norm", "k_norm"))}
    assert head_norms == {f"model.layers.{i}.self_attn.{n}" for i in range(2) for n in ("q_norm", "k_norm")}
    assert {model.get_submodule(n).forward.chunk_tokens for n in head_norms} == {5 * 64 // 16}
    import memopt.tiled_ffn as tiled_ffn_module

    chunk_counts = []
    original = tiled_ffn_module.token_chunks

    def counting(n_tokens, chunk_tokens, width=4):
        chunks = list(original(n_tokens, chunk_tokens, width))
        chunk_counts.append((n_tokens, len(chunks)))
        return iter(chunks)

    monkeypatch.setattr(tiled_ffn_module, "token_chunks", counting)
    got = _run(model, ids)
    # Rows: the hidden norms' and the MLP's 38, q_norm's 38 * 4, k_norm's 38 * 2. Chunks: at most
    # ceil(38 / 5) (chunks are whole multiples of 4 rows, so the hidden ones take 5 of 8 rows).
    assert {n for n, _ in chunk_counts} == {38, 38 * 4, 38 * 2}
    assert max(count for _, count in chunk_counts) <= 8, sorted(set(chunk_counts))
    _assert_exact(got, want, "qwen3")
