"""TEMPORARY plain-PyTorch stand-ins for ops other helpers are landing (norm, activation,
attention). Registered only when torch.ops.memopt lacks them. Deleted before the final commit."""

import torch
import torch.nn.functional as F

from memopt.ops._philox import dropout_keep_mask


def _has(name):
    try:
        getattr(torch.ops.memopt, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def _empty(ref):
    return ref.new_empty(0)


def _stat_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


if not _has("layer_norm_fwd"):

    @torch.library.custom_op("memopt::layer_norm_fwd", mutates_args=())
    def layer_norm_fwd(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        z = x if residual is None else x + residual
        zf = z.to(_stat_dtype(x))
        mean = zf.mean(-1)
        rstd = torch.rsqrt(zf.var(-1, unbiased=False) + eps)
        y = (zf - mean[:, None]) * rstd[:, None]
        if weight is not None:
            y = y * weight.to(zf.dtype)
        if bias is not None:
            y = y + bias.to(zf.dtype)
        return y.to(x.dtype), (z.clone() if residual is not None else _empty(x)), mean, rstd

    @layer_norm_fwd.register_fake
    def _(x, residual, weight, bias, eps):
        n = x.shape[0]
        sd = _stat_dtype(x)
        return torch.empty_like(x), (torch.empty_like(x) if residual is not None else x.new_empty(0)), x.new_empty(n, dtype=sd), x.new_empty(n, dtype=sd)

    @torch.library.custom_op("memopt::layer_norm_bwd", mutates_args=())
    def layer_norm_bwd(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor, grad_x_extra: torch.Tensor | None, return_y: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        sd = _stat_dtype(x)
        xhat = (x.to(sd) - mean[:, None]) * rstd[:, None]
        g = grad_y.to(sd)
        w = weight.to(sd) if weight is not None else torch.ones(x.shape[-1], dtype=sd)
        gxhat = g * w
        d = x.shape[-1]
        gx = rstd[:, None] * (gxhat - gxhat.mean(-1, keepdim=True) - xhat * (gxhat * xhat).mean(-1, keepdim=True))
        if grad_x_extra is not None:
            gx = gx + grad_x_extra.to(sd)
        gw = (g * xhat).sum(0) if weight is not None else _empty(x)
        gb = g.sum(0) if bias is not None else _empty(x)
        y = xhat * w + (bias.to(sd) if bias is not None else 0)
        return gx.to(x.dtype), gw, gb, (y.to(x.dtype) if return_y else _empty(x))

    @layer_norm_bwd.register_fake
    def _(grad_y, x, weight, bias, mean, rstd, grad_x_extra, return_y):
        sd = _stat_dtype(x)
        d = x.shape[-1]
        return torch.empty_like(x), (x.new_empty(d, dtype=sd) if weight is not None else x.new_empty(0)), (x.new_empty(d, dtype=sd) if bias is not None else x.new_empty(0)), (torch.empty_like(x) if return_y else x.new_empty(0))

    @torch.library.custom_op("memopt::rms_norm_fwd", mutates_args=())
    def rms_norm_fwd(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        z = x if residual is None else x + residual
        zf = z.to(_stat_dtype(x))
        rstd = torch.rsqrt((zf * zf).mean(-1) + eps)
        y = zf * rstd[:, None]
        if weight is not None:
            y = y * weight.to(zf.dtype)
        return y.to(x.dtype), (z.clone() if residual is not None else _empty(x)), rstd

    @rms_norm_fwd.register_fake
    def _(x, residual, weight, eps):
        return torch.empty_like(x), (torch.empty_like(x) if residual is not None else x.new_empty(0)), x.new_empty(x.shape[0], dtype=_stat_dtype(x))

    @torch.library.custom_op("memopt::rms_norm_bwd", mutates_args=())
    def rms_norm_bwd(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, grad_x_extra: torch.Tensor | None, return_y: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sd = _stat_dtype(x)
        xhat = x.to(sd) * rstd[:, None]
        g = grad_y.to(sd)
        w = weight.to(sd) if weight is not None else torch.ones(x.shape[-1], dtype=sd)
        gxhat = g * w
        gx = rstd[:, None] * (gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True))
        if grad_x_extra is not None:
            gx = gx + grad_x_extra.to(sd)
        gw = (g * xhat).sum(0) if weight is not None else _empty(x)
        return gx.to(x.dtype), gw, ((xhat * w).to(x.dtype) if return_y else _empty(x))

    @rms_norm_bwd.register_fake
    def _(grad_y, x, weight, rstd, grad_x_extra, return_y):
        d = x.shape[-1]
        return torch.empty_like(x), (x.new_empty(d, dtype=_stat_dtype(x)) if weight is not None else x.new_empty(0)), (torch.empty_like(x) if return_y else x.new_empty(0))


def _act(x, activation):
    if activation == "relu":
        return F.relu(x)
    if activation == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none")


def _act_grad(z, activation):
    if activation == "relu":
        return (z > 0).to(z.dtype)
    if activation == "silu":
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(z / 2**0.5))
        pdf = torch.exp(-0.5 * z * z) / (2 * torch.pi) ** 0.5
        return cdf + z * pdf
    c = (2 / torch.pi) ** 0.5
    inner = c * (z + 0.044715 * z**3)
    t = torch.tanh(inner)
    return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * c * (1 + 3 * 0.044715 * z * z)


if not _has("bias_act_fwd"):

    @torch.library.custom_op("memopt::bias_act_fwd", mutates_args=())
    def bias_act_fwd(x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
        return _act(x if bias is None else x + bias, activation)

    @bias_act_fwd.register_fake
    def _(x, bias, activation):
        return torch.empty_like(x)

    @torch.library.custom_op("memopt::bias_act_bwd", mutates_args=())
    def bias_act_bwd(grad_y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, activation: str, return_y: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        z = x if bias is None else x + bias
        y = _act(z, activation)
        gx = grad_y * _act_grad(z, activation)
        gb = gx.sum(0) if bias is not None else _empty(x)
        return gx, gb, (y.detach() if return_y else _empty(x))

    @bias_act_bwd.register_fake
    def _(grad_y, x, bias, activation, return_y):
        return torch.empty_like(x), (torch.empty_like(bias) if bias is not None else x.new_empty(0)), (torch.empty_like(x) if return_y else x.new_empty(0))

    def _swiglu(x):
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up

    @torch.library.custom_op("memopt::swiglu_fwd", mutates_args=())
    def swiglu_fwd(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _swiglu(x if bias is None else x + bias).contiguous()

    @swiglu_fwd.register_fake
    def _(x, bias):
        return x.new_empty(x.shape[0], x.shape[1] // 2)

    @torch.library.custom_op("memopt::swiglu_bwd", mutates_args=())
    def swiglu_bwd(grad_y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, return_y: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        z = x if bias is None else x + bias
        y = _swiglu(z)
        gate, up = z.chunk(2, -1)
        gx = torch.cat([grad_y * up * _act_grad(gate, "silu"), grad_y * F.silu(gate)], -1)
        gb = gx.sum(0) if bias is not None else _empty(x)
        return gx, gb, (y.detach().contiguous() if return_y else _empty(x))

    @swiglu_bwd.register_fake
    def _(grad_y, x, bias, return_y):
        return torch.empty_like(x), (torch.empty_like(bias) if bias is not None else x.new_empty(0)), (x.new_empty(x.shape[0], x.shape[1] // 2) if return_y else x.new_empty(0))


def _probs(q, k, v, causal, dropout_p, scale, rng_key):
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, 1).double()
    v = v.repeat_interleave(rep, 1).double()
    s = (q.double() @ k.transpose(-1, -2)) * scale
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    pr = torch.exp(s - lse[..., None])
    drop = torch.ones_like(pr)
    if dropout_p > 0:
        seed, off = (int(a) for a in rng_key.tolist())
        keep = dropout_keep_mask(pr.shape, dropout_p, seed, off)
        drop = torch.where(keep, 1 / (1 - dropout_p), 0.0).double()
    return pr, drop, k, v, lse, rep


def _attn(q, k, v, causal, dropout_p, scale, rng_key):
    pr, drop, k, v, lse, rep = _probs(q, k, v, causal, dropout_p, scale, rng_key)
    return ((pr * drop) @ v).to(q.dtype), lse.float()


def _attn_bwd(do, q, k, v, causal, dropout_p, scale, rng_key):
    pr, drop, kk, vv, lse, rep = _probs(q, k, v, causal, dropout_p, scale, rng_key)
    do = do.double()
    dv = (pr * drop).transpose(-1, -2) @ do
    dp = (do @ vv.transpose(-1, -2)) * drop
    ds = pr * (dp - (dp * pr).sum(-1, keepdim=True))
    dq = ds @ kk * scale
    dk = ds.transpose(-1, -2) @ q.double() * scale
    b, h, sk, d = dk.shape
    dk = dk.view(b, h // rep, rep, sk, d).sum(2)
    dv = dv.view(b, h // rep, rep, sk, d).sum(2)
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


if not _has("attention_fwd"):

    @torch.library.custom_op("memopt::attention_fwd", mutates_args=())
    def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, dropout_p: float, scale: float, rng_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = _attn(q, k, v, causal, dropout_p, scale, rng_key)
        return out.transpose(1, 2).contiguous().transpose(1, 2), lse

    @attention_fwd.register_fake
    def _(q, k, v, causal, dropout_p, scale, rng_key):
        b, h, s, d = q.shape
        return q.new_empty(b, s, h, d).transpose(1, 2), q.new_empty(b, h, s, dtype=torch.float32)

    @torch.library.custom_op("memopt::attention_bwd", mutates_args=())
    def attention_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool, dropout_p: float, scale: float, rng_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gq, gk, gv = _attn_bwd(grad_out, q, k, v, causal, dropout_p, scale, rng_key)
        return gq.contiguous(), gk.contiguous(), gv.contiguous()

    @attention_bwd.register_fake
    def _(grad_out, q, k, v, out, lse, causal, dropout_p, scale, rng_key):
        return torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(k, memory_format=torch.contiguous_format), torch.empty_like(v, memory_format=torch.contiguous_format)
