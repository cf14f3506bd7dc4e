"""The Gated DeltaNet kernel path (workers/model/gated_deltanet.py): which backend a layer
picks, and the layout mapping between our torch delta rule and flash-linear-attention's, pinned
against fla's own torch reference (fla/ops/gated_delta_rule/naive.py) where fla is installed.

No GPU here: the fla kernels themselves never run. What runs is (a) the selection logic,
(b) our torch recurrence == fla's reference on the inputs the fast path hands the kernels, and
(c) the fast path's plumbing (per-step states for rollback, padded rows, fresh rows, GVA,
in-kernel l2norm) with fla's reference standing in for the kernels == the torch path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from mtpserve.workers.model import gated_deltanet as gdn
from mtpserve.workers.model.families.base import LinearAttentionConfig
from mtpserve.workers.model.gated_deltanet import (
    LINEAR_ATTENTION_ENV,
    GatedDeltaNet,
    LinearState,
    linear_attention_backend,
    select_linear_attention_backend,
)


@pytest.fixture
def auto_env(monkeypatch):
    monkeypatch.delenv(LINEAR_ATTENTION_ENV, raising=False)
    return monkeypatch


def test_cpu_device_selects_torch(auto_env) -> None:
    backend, why = select_linear_attention_backend("cpu")
    assert backend == "torch" and "device is cpu" in why


def test_env_forces_torch_even_on_cuda(auto_env) -> None:
    auto_env.setenv(LINEAR_ATTENTION_ENV, "torch")
    assert select_linear_attention_backend("cuda") == ("torch", f"{LINEAR_ATTENTION_ENV}=torch")


def test_cuda_without_a_usable_fla_selects_torch(auto_env) -> None:
    # None in sys.modules makes the import raise ImportError, whether fla is installed or not.
    auto_env.setitem(sys.modules, "fla.ops.gated_delta_rule", None)
    backend, why = select_linear_attention_backend("cuda")
    assert backend == "torch" and "flash-linear-attention not usable" in why


def test_env_fla_refuses_instead_of_falling_back(auto_env) -> None:
    auto_env.setenv(LINEAR_ATTENTION_ENV, "fla")
    with pytest.raises(RuntimeError, match="fla kernels need CUDA"):
        select_linear_attention_backend("cpu")
    auto_env.setenv(LINEAR_ATTENTION_ENV, "triton")
    with pytest.raises(ValueError, match="expected auto, torch or fla"):
        select_linear_attention_backend("cpu")


LIN = LinearAttentionConfig(num_key_heads=2, num_value_heads=4, key_head_dim=8,
                            value_head_dim=8, conv_kernel=4)
HIDDEN = 32


def _layer(seed: int = 0) -> GatedDeltaNet:
    layer = GatedDeltaNet(HIDDEN, LIN, 1e-6)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return layer


def test_layer_built_on_cpu_records_torch(auto_env) -> None:
    layer = _layer()
    assert layer.backend == "torch" and linear_attention_backend() == "torch"


def test_check_line_and_stats_say_which_path_runs(auto_env) -> None:
    """`mtpserve check` (ModelConfig.describe of a hybrid) names this host's path, or the
    refusal the env asks for; the hybrid block manager's stats carry the built layers' path."""
    from mtpserve.workers.model.config import _linear_kernels_line
    from mtpserve.workers.state_pool import HybridBlockManager

    here = "cuda" if torch.cuda.is_available() else "cpu"
    auto_env.setenv(LINEAR_ATTENTION_ENV, "torch")
    assert _linear_kernels_line() == (f"linear attention kernels on this host ({here}): torch "
                                      f"({LINEAR_ATTENTION_ENV}=torch)")
    if here == "cpu":
        auto_env.setenv(LINEAR_ATTENTION_ENV, "fla")
        assert "refused: MTPSERVE_LINEAR_ATTENTION=fla but device is cpu" in \
            _linear_kernels_line()
    auto_env.delenv(LINEAR_ATTENTION_ENV)
    _layer()  # built on CPU: torch
    assert HybridBlockManager(8, 4, 2).stats()["linear_attention_fla"] == 0


def _fla_naive():
    """fla's torch reference, loaded from its file: importing the `fla` package pulls in the
    Triton kernels, which need a Triton matching fla (and fail at import otherwise)."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("flash-linear-attention not installed (pip install mtpserve[cuda])")
    path = Path(spec.submodule_search_locations[0]) / "ops" / "gated_delta_rule" / "naive.py"
    pytest.importorskip("einops")
    mod_spec = importlib.util.spec_from_file_location("_fla_gdr_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def _l2norm_as_fla(x: torch.Tensor) -> torch.Tensor:
    """fla's `use_qk_l2norm_in_kernel` (fla/modules/l2norm.py): x / sqrt(sum x^2 + 1e-6)."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _naive_as_kernels(naive):
    """fla's reference wrapped to the kernels' signatures: GVA (value head i reads key head
    i // (Hv / Hk)) and the in-kernel l2norm, which the reference does not do itself."""

    def prep(q, k, v, use_qk_l2norm_in_kernel):
        r = v.shape[2] // q.shape[2]
        if use_qk_l2norm_in_kernel:
            q, k = _l2norm_as_fla(q), _l2norm_as_fla(k)
        return q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)

    def as_kernel(reference):
        def kernel(q, k, v, g, beta, scale, initial_state, output_final_state,
                   use_qk_l2norm_in_kernel):
            q, k = prep(q, k, v, use_qk_l2norm_in_kernel)
            return reference(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state)

        return kernel

    return (as_kernel(naive.naive_chunk_gated_delta_rule),
            as_kernel(naive.naive_recurrent_gated_delta_rule))


def _inputs(B: int, S: int, seed: int):
    """The fast path's kernel inputs, sequence-first: raw q, k on the key heads, v on the value
    heads, g in log space (<= 0), beta in (0, 1), a random fp32 initial state."""
    g = torch.Generator().manual_seed(seed)
    Hk, Hv, Dk, Dv = LIN.num_key_heads, LIN.num_value_heads, LIN.key_head_dim, LIN.value_head_dim
    q = torch.randn(B, S, Hk, Dk, generator=g)
    k = torch.randn(B, S, Hk, Dk, generator=g)
    v = torch.randn(B, S, Hv, Dv, generator=g)
    gate = torch.nn.functional.logsigmoid(torch.randn(B, S, Hv, generator=g) + 2)
    beta = torch.rand(B, S, Hv, generator=g)
    h0 = torch.randn(B, Hv, Dk, Dv, generator=g) * 0.5
    return q, k, v, gate, beta, h0


@pytest.mark.parametrize("S", [1, 5, 150])  # decode, a verify row, a prefill past a chunk
def test_torch_delta_rule_equals_fla_reference(S: int) -> None:
    """Our torch path (head-first, its own l2norm / GVA / scale) == fla's reference fed the
    sequence-first tensors the fast path hands the kernels: output and final state [B, Hv, Dk,
    Dv], within 1e-5. The recurrent and the chunked forms are both covered (S=150 > 16)."""
    naive = _fla_naive()
    chunk, recurrent = _naive_as_kernels(naive)
    q, k, v, gate, beta, h0 = _inputs(2, S, seed=S)
    out, final = GatedDeltaNet._torch_delta_rule(q, k, v, gate, beta, h0)
    kern = chunk if S > gdn.RECURRENT_MAX else recurrent
    ref_out, ref_final = kern(q, k, v, g=gate, beta=beta, scale=LIN.key_head_dim ** -0.5,
                              initial_state=h0, output_final_state=True,
                              use_qk_l2norm_in_kernel=True)
    assert (out.transpose(1, 2) - ref_out).abs().max().item() <= 1e-5
    assert (final - ref_final).abs().max().item() <= 1e-5
    if S <= gdn.RECURRENT_MAX:  # the state kept after each position == fla's over a prefix
        keep = torch.full((2, S - 1, LIN.num_value_heads, LIN.key_head_dim,
                           LIN.value_head_dim), float("nan"))
        out2, final2 = GatedDeltaNet._torch_delta_rule(q, k, v, gate, beta, h0, keep)
        assert torch.equal(out2, out) and torch.equal(final2, final)
        for t in range(S - 1):
            _, ref_t = kern(q[:, :t + 1], k[:, :t + 1], v[:, :t + 1], g=gate[:, :t + 1],
                            beta=beta[:, :t + 1], scale=LIN.key_head_dim ** -0.5,
                            initial_state=h0, output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
            assert (keep[:, t] - ref_t).abs().max().item() <= 1e-5


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("S", [1, 5, 150])
def test_fla_path_equals_torch_path_through_the_reference(S: int, keep: bool) -> None:
    """`fla_gated_delta_rule` (the function the CUDA path calls) with fla's reference as the
    kernels == our torch delta rule: outputs, final state and, for verify rows, the state after
    every position but the last (what rollback keeps, written into the given buffer), within
    1e-5."""
    naive = _fla_naive()
    q, k, v, gate, beta, h0 = _inputs(3, S, seed=10 + S)
    keep = keep and 1 < S <= gdn.RECURRENT_MAX
    shape = (3, S - 1, LIN.num_value_heads, LIN.key_head_dim, LIN.value_head_dim)
    buf, t_buf = (torch.full(shape, float("nan")) if keep else None for _ in range(2))
    out, final = gdn.fla_gated_delta_rule(q, k, v, gate, beta, h0, buf,
                                          kernels=_naive_as_kernels(naive))
    t_out, t_final = GatedDeltaNet._torch_delta_rule(q, k, v, gate, beta, h0, t_buf)
    assert (out.transpose(1, 2) - t_out).abs().max().item() <= 1e-5
    assert (final - t_final).abs().max().item() <= 1e-5
    if keep:
        assert (buf - t_buf).abs().max().item() <= 1e-5


def _state(slots: list[int], fresh: list[bool], lens: list[int], seed: int,
           k: int = 3) -> LinearState:
    """8 slots, verify buffers for 2 rows of k drafts (StateCache's layout)."""
    g = torch.Generator().manual_seed(seed)
    conv = torch.randn(8, LIN.conv_dim, LIN.conv_kernel - 1, generator=g)
    rec = torch.randn(8, LIN.num_value_heads, LIN.key_head_dim, LIN.value_head_dim,
                      generator=g) * 0.5
    keep_rec = torch.empty(2, k, LIN.num_value_heads, LIN.key_head_dim, LIN.value_head_dim)
    keep_conv = torch.empty(2, LIN.conv_dim, LIN.conv_kernel - 1 + k)
    return LinearState(conv, rec, torch.tensor(slots), torch.tensor(fresh),
                       torch.tensor(lens), keep_rec, keep_conv)


def test_layer_forward_with_fla_backend_equals_torch_and_rolls_back() -> None:
    """A whole layer over state slots: a padded mixed batch (a fresh 20-token prefill row beside
    a 3-token continuation), then a verify row of 4 and `keep` at position 1, then one decode
    step. The layer switched to the fla backend (fla's reference as its kernels) == the same
    weights on the torch backend: outputs and every slot's conv + recurrent state."""
    naive = _fla_naive()
    torch_layer, fla_layer = _layer(1), _layer(1)
    fla_layer.backend, fla_layer.kernels = "fla", _naive_as_kernels(naive)
    g = torch.Generator().manual_seed(7)
    x1 = torch.randn(2, 20, HIDDEN, generator=g)
    x2 = torch.randn(1, 4, HIDDEN, generator=g)
    x3 = torch.randn(1, 1, HIDDEN, generator=g)
    states = [_state([3, 5], [True, False], [20, 3], seed=3) for _ in range(2)]
    with torch.no_grad():
        outs = []
        for layer, st in zip((torch_layer, fla_layer), states, strict=True):
            o1 = layer(x1, st)
            st.slots, st.fresh, st.lens = torch.tensor([5]), torch.tensor([False]), \
                torch.tensor([4])
            o2 = layer(x2, st)
            st.keep(torch.tensor([0]), torch.tensor([1]))
            st.lens = torch.tensor([1])
            o3 = layer(x3, st)
            outs.append((o1[0], o1[1, :3], o2, o3))
    for a, b in zip(*outs, strict=True):
        assert (a - b).abs().max().item() <= 1e-5
    for name in ("conv", "recurrent"):
        a, b = getattr(states[0], name), getattr(states[1], name)
        assert (a - b).abs().max().item() <= 1e-5, name
