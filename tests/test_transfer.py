"""upload: host values on a device (on a GPU through pinned memory, without a stream sync: a benchmark's
matter; here the values and types)."""

from __future__ import annotations

import pytest
import torch

from specdec.transfer import upload


@pytest.mark.parametrize("values", [[3, -1, 7], torch.tensor([3, -1, 7])])
def test_upload_keeps_values_and_dtype(values):
    out = upload(values, torch.device("cpu"))
    assert out.dtype == torch.long and out.tolist() == [3, -1, 7]
    assert upload([0.5, 2.0], "cpu", torch.float32).tolist() == [0.5, 2.0]

