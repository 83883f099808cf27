import torch
from specdec.models import fused


def test_compiled_pieces_survive_many_variants_in_one_process():
    """A target and its drafter in one process call each piece with many shapes, strides and modes; the
    compiled piece must keep answering (the H200 judge's drafter server once died of a recompile limit)."""
    norm = fused.compile_elementwise(fused.rms_norm, backend="eager")
    g = torch.Generator().manual_seed(0)
    variants = []
    for hidden in (64, 32):  # a target and a drafter
        for rows in (1, 5):
            for dtype in (torch.float32, torch.float64):
                x = torch.randn(rows, 2, hidden, generator=g, dtype=dtype)  # per-head norms are 3-D
                variants += [x, x[:, 0], x.transpose(0, 1)]
    for i, x in enumerate(variants):
        w = torch.rand(x.shape[-1], generator=g, dtype=x.dtype)
        eps = 1e-6 if i % 2 else 1e-5
        with torch.inference_mode(i % 3 == 0):
            assert torch.allclose(norm(x, w, eps), fused.rms_norm(x, w, eps))


# The module code each Qwen3.5 piece replaced (ZeroCentredRMSNorm, GatedRMSNorm, GatedDeltaNet._attend_group).

def old_zero_centred(x, w, eps):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + w.float())).to(x.dtype)


def old_gated(x, z, w, eps):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (w * x32.to(x.dtype) * torch.nn.functional.silu(z.float())).to(x.dtype)


def old_gates(q, k, b, a, A_log, dt_bias, k_dim):
    def l2(t):
        return t * torch.rsqrt((t * t).sum(dim=-1, keepdim=True) + 1e-6)
    q = l2(q.float()) * k_dim**-0.5
    k = l2(k.float())
    beta = b.sigmoid().float()
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    return q, k, beta, g


DTYPES = (torch.float32, torch.bfloat16)


def _heads(dtype, g, shape=(5, 3, 16)):
    """Per-head 3-D inputs and a view of them (as the hybrid's q/k norms see)."""
    x = torch.randn(*shape, generator=g).to(dtype)
    return [x, x.transpose(0, 1), x[:, 0]]


def _same(a, b):
    """Bit-identical: same dtype, shape and values."""
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_zero_centred_pieces_equal_the_module_code():
    g = torch.Generator().manual_seed(1)
    for dtype in DTYPES:
        w = (0.1 * torch.randn(16, generator=g)).to(dtype)
        for x in _heads(dtype, g):
            assert _same(fused.zero_centred_rms_norm(x, w, 1e-6), old_zero_centred(x, w, 1e-6))
            d = torch.randn(x.shape, generator=g).to(dtype)
            s = x + d
            assert _same(fused.add_zero_centred_rms_norm(x, d, w, 1e-6), (s, old_zero_centred(s, w, 1e-6)))


def test_gated_rms_norm_equals_the_module_code():
    g = torch.Generator().manual_seed(2)
    for dtype in DTYPES:
        w = (1 + 0.1 * torch.randn(16, generator=g)).to(dtype)
        for x in _heads(dtype, g):
            z = torch.randn(x.shape, generator=g).to(dtype)
            assert _same(fused.gated_rms_norm(x, z, w, 1e-6), old_gated(x, z, w, 1e-6))


def _gate_inputs(dtype, g, m=2, n=3, hk=2, hv=4, dk=16):
    """q, k [m, n, Hk, Dk] as the views _attend_group makes of the conv output; b, a [m, n, Hv]; A_log,
    dt_bias [Hv] (in dtype too, as a model cast to bf16 has them)."""
    conved = torch.randn(m, n, 3 * hk * dk, generator=g).to(dtype)
    q, k, _ = conved.split([hk * dk, hk * dk, hk * dk], dim=-1)
    q, k = (t.reshape(m, n, hk, dk) for t in (q, k))
    b, a = torch.randn(2, m, n, hv, generator=g).to(dtype)
    A_log = torch.empty(hv).uniform_(0.01, 16.0, generator=g).log().to(dtype)
    dt_bias = (1 + 0.1 * torch.randn(hv, generator=g)).to(dtype)
    return q, k, b, a, A_log, dt_bias


def test_delta_rule_gates_equal_the_module_code():
    g = torch.Generator().manual_seed(3)
    for dtype in DTYPES:
        q, k, b, a, A_log, dt_bias = _gate_inputs(dtype, g)
        got = fused.delta_rule_gates(q, k, b, a, A_log, dt_bias, 16**-0.5)
        assert _same(got, old_gates(q, k, b, a, A_log, dt_bias, 16))
        assert all(t.dtype == torch.float32 for t in got)


def test_compiled_qwen3_5_pieces_equal_the_plain_ones():
    g = torch.Generator().manual_seed(4)
    for dtype in DTYPES:
        w = (0.1 * torch.randn(16, generator=g)).to(dtype)
        for x in _heads(dtype, g):
            z = torch.randn(x.shape, generator=g).to(dtype)
            for name, args in (("zero_centred_rms_norm", (x, w, 1e-6)),
                               ("add_zero_centred_rms_norm", (x, z, w, 1e-6)),
                               ("gated_rms_norm", (x, z, w, 1e-6))):
                compiled = fused.compile_elementwise(fused.PLAIN[name], backend="eager")
                assert _same(compiled(*args), fused.PLAIN[name](*args)), name
        args = (*_gate_inputs(dtype, g), 16**-0.5)
        compiled = fused.compile_elementwise(fused.delta_rule_gates, backend="eager")
        assert _same(compiled(*args), fused.delta_rule_gates(*args))


def test_every_piece_is_registered_and_tried():
    """Each plain piece is in PLAIN, in Kernels and run by _try_compiled (so a compiler failure on any of
    them keeps the plain ones as a whole)."""
    import inspect

    tried = inspect.getsource(fused._try_compiled)
    for name, fn in fused.PLAIN.items():
        assert fused.Kernels.__dict__[name].__func__ is fn or fused.Kernels.fused
        assert f'compiled["{name}"](' in tried, name

