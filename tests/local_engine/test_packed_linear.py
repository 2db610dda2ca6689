"""CPU projections on oneDNN-packed weights (`local_engine/layers/linear.py`) against plain `nn.Linear`, and the
native kernel's few-row path beside them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from local_engine.kernels import cpu as cpu_kernels
from local_engine.layers.linear import PackedLinear, can_pack, is_packing_available, pack_linears
from local_engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not is_packing_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (3, 5, 96)])
def test_packed_linear_matches_linear_in_float32(bias: bool, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(*shape)
    expected = linear(x)
    packed = PackedLinear(linear)
    got = packed(x)
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    strided = torch.randn(4, 192)[:, :96]  # a slice of a fused projection, as in the model
    torch.testing.assert_close(packed(strided), linear(strided), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="oneDNN has no bf16 path on this CPU")
def test_packed_linear_in_bfloat16() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 32).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    got = PackedLinear(linear)(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), linear(x).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not cpu_kernels.is_available(), reason="the native CPU kernels do not build here")
def test_few_row_calls_take_the_native_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160)
    packed = PackedLinear(linear, native_max_rows=4)
    assert packed.panels is not None and packed.extra_bytes == packed.panels.numel() * 4 >= packed.num_bytes
    calls: list[int] = []
    native = cpu_kernels.linear

    def counting(
        x: torch.Tensor, panels: torch.Tensor, num_out: int, bias: torch.Tensor | None, weight_format: int
    ) -> torch.Tensor | None:
        calls.append(x.shape[0])
        return native(x, panels, num_out, bias, weight_format)

    monkeypatch.setattr(cpu_kernels, "linear", counting)
    for rows in (1, 4, 5, 64):
        x = torch.randn(rows, 192)[:, 96:]
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    assert calls == [1, 4]  # more rows go to oneDNN
    assert PackedLinear(linear).panels is None and PackedLinear(linear).extra_bytes == 0  # one layout only


def test_pack_linears_swaps_every_projection_and_keeps_tied_embeddings(family: Any) -> None:
    engine = family.engine()
    model = engine.runner.model
    assert engine.runner.num_packed_linears == 4 * family.hf_config["num_hidden_layers"] + 1
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, PackedLinear)
    assert model.model.embed_tokens.weight.shape[0] == family.hf_config["vocab_size"]  # still a real tensor
    assert pack_linears(model) == 0  # nothing left to pack
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    for m in packed:  # a second layout costs its bytes again: the native kernel's panels, or a tied embedding's
        tied = m is model.lm_head and family.hf_config.get("tie_word_embeddings", False)
        panel_bytes = 0 if m.panels is None else m.panels.numel() * 4
        assert m.extra_bytes == panel_bytes + (m.num_bytes if tied else 0)
    assert all(m.panels is not None for m in packed) == cpu_kernels.is_available()
    plain = family.engine(pack_cpu_weights=False).runner.weights_bytes  # one row-major copy of everything
    assert engine.runner.weights_bytes == plain + sum(m.extra_bytes for m in packed)


def test_engine_gives_the_same_tokens_with_and_without_packing(family: Any) -> None:
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 160, (n,), generator=generator).tolist() for n in (4, 33, 70)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain = family.engine(pack_cpu_weights=False)
    assert plain.runner.num_packed_linears == 0
    assert any(isinstance(m, nn.Linear) for m in plain.runner.model.modules())
    expected = [c[0].token_ids for c in plain.generate(prompts, params)]
    assert [c[0].token_ids for c in family.engine().generate(prompts, params)] == expected
