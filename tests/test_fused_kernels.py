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
