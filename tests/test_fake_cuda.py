"""The fake-CUDA tier (issue 41 item 1): the engine's GPU code paths on this CPU-only machine.

Every engine here runs with `device="cuda"` inside `fake_cuda()` (tests/fake_cuda.py): fake
tensors carry shapes, dtypes and devices without data, so what a GPU run would break on
fails here too: a host tensor meeting device tensors in one op (device mismatch), and any
read of device values on the host besides the round's one counted sync (`to_host`, whose
values the test supplies). CUDA's defaults apply: flex attention, the device-side draft
chain, pinned staging. What this cannot show (numerics, kernels, graphs, NCCL, speed) is
`benchmarks/gpu_check.py`'s; CONTRIBUTING.md says which is which.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from fake_cuda import fake_cuda, zeros
from tiny_models import make_hf_checkpoint, make_mimo_v2_flash_checkpoint, make_step_checkpoint

from mtpserve.workers.engine import Engine
from mtpserve.workers.engine_config import EngineConfig
from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.scheduler import decode_slots, draft_slots

PROMPTS = [[5, 17, 99, 3, 250, 7, 42, 8, 1, 77, 31], [3, 4, 5, 6, 7, 8],
           [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113]]
LONG = [(7 * i + 3) % 250 + 1 for i in range(40)]  # past MLA's absorbed query length: expanded
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
SAMPLED = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=7)
LOGPROBS = SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=2)


_NEWER = ("deepseek_v32", "step3p5", "mimo_v2_flash")


def accept_some(n: int, reason: str) -> list[int]:
    """Host values of a counted sync: 1 wherever it is read (one draft accepted per row,
    token 1): the accepting branches run, not only the all-rejected ones."""
    return [1] * n


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    from test_qwen3_next import make_qwen3_next_checkpoint

    root = tmp_path_factory.mktemp("fake_cuda")
    return {
        "qwen3": make_hf_checkpoint(root / "qwen3", "qwen3", num_mtp=1),
        "qwen3_moe": make_hf_checkpoint(root / "qwen3_moe", "qwen3_moe", num_mtp=1),
        "deepseek_v3": make_hf_checkpoint(root / "deepseek_v3", "deepseek_v3", num_mtp=1),
        "qwen3_next": make_qwen3_next_checkpoint(root / "qwen3_next"),
        "deepseek_v32": make_hf_checkpoint(root / "deepseek_v32", "deepseek_v32", num_mtp=1),
        "step3p5": make_step_checkpoint(root / "step3p5", num_mtp=1),
        "mimo_v2_flash": make_mimo_v2_flash_checkpoint(root / "mimo_v2_flash", num_mtp=1),
    }


def cuda_engine(model: Path, k: int = 2, **kw) -> Engine:
    return Engine(EngineConfig(model=str(model), num_speculative_tokens=k, device="cuda",
                               compile="off", num_kv_blocks=64, block_size=4, **kw))


def _assert_on_cuda(eng: Engine) -> None:
    assert {b.device.type for b in eng.runner.kv_cache.buffers} == {"cuda"}
    assert {p.device.type for p in eng.runner.model.parameters()} == {"cuda"}


@pytest.mark.parametrize(("values", "family"), [
    pytest.param(v, f, id=f"{v}-{f}",
                 # The newer families run the accepting variant by default, both in the slow tier.
                 marks=pytest.mark.slow if v == "zeros" and f in _NEWER else ())
    for f in ("qwen3", "qwen3_moe", "deepseek_v3", "qwen3_next", *_NEWER)
    for v in ("zeros", "accept_some")])
def test_rounds_run_on_cuda_with_one_sync_each(ckpts, family: str, values: str) -> None:
    """Prefill with MTP drafts, then mixed greedy / sampled / logprobs verify rounds and the
    draft chain, per family (dense GQA, MoE, MLA + MoE, hybrid Gated DeltaNet, MLA + DSA past
    its top-k, Step's windows / gates / clamps, MiMo-V2-Flash's sinks and repeated KV heads):
    everything on the device, one counted host read per step."""
    with fake_cuda(zeros if values == "zeros" else accept_some) as rt:
        eng = cuda_engine(ckpts[family])
        _assert_on_cuda(eng)
        for i, (p, sp) in enumerate(zip([*PROMPTS, LONG], (GREEDY, SAMPLED, LOGPROBS, GREEDY),
                                        strict=True)):
            eng.add_request(f"r{i}", p, sp)
        steps = 0
        while eng.has_unfinished():
            before = len(rt.reads)
            outs = eng.step()
            steps += 1
            assert len(rt.reads) - before == 1, rt.reads[before:]
            assert steps < 40
            for o in outs:
                assert o.error is None, o.error
        reasons = collections.Counter(r for r, _ in rt.reads)
        assert reasons["first tokens"] >= 1 and reasons["accepted ids"] >= 1, reasons
        assert set(reasons) <= {"first tokens", "accepted ids"}, reasons
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_transferred_request_first_sampled_round(ckpts) -> None:
    """The P/D bug of issue 41: a transferred sampled request's draft q arrives as the
    puller's host copy; its first verify round runs beside local sampled rows whose q is on
    the device. Installing the arrival's extras moves the q to the device: one round, no
    device mismatch, and the transferred request's drafts are verified."""
    ckpt = ckpts["qwen3"]
    with fake_cuda(accept_some):
        pre = cuda_engine(ckpt, role="prefill")
        dec = cuda_engine(ckpt, role="decode")
        dec.add_request("local", PROMPTS[1], SAMPLED)
        dec.step()  # prefill: its drafts' q on the device
        dec.step()  # a sampled round
        local = dec.requests["local"]
        assert local.draft_probs is not None and local.draft_probs.device.type == "cuda"
        pre.add_request("x", PROMPTS[0], SAMPLED)
        (first,) = pre.step()
        held = pre.prefilled["x"]
        k = len(held.draft_token_ids)
        assert k == 2 and held.draft_probs is not None
        # What the decode side's puller hands over: host copies of the prefill's extras.
        extras = {"draft_token_ids": torch.tensor(held.draft_token_ids, dtype=torch.long),
                  "draft_probs": torch.rand(k, held.draft_probs.shape[-1])}
        r = dec.make_request("x", PROMPTS[0], SAMPLED)
        r.output_token_ids += first.new_token_ids
        r.num_computed_tokens = held.num_computed_tokens
        dec.add_transferred(r, max(draft_slots(held), decode_slots(r)))
        assert dec.scheduler.admit_transferred() == [r]
        dec.activate_transferred(r, extras)
        assert r.draft_token_ids == held.draft_token_ids
        assert r.draft_probs is not None and r.draft_probs.device.type == "cuda"
        outs = dec.step()  # the first round of "x" beside "local": q stacked on the device
        by_id = {o.request_id: o for o in outs}
        assert by_id["x"].error is None and by_id["local"].error is None
        assert (by_id["x"].num_drafted, by_id["x"].num_accepted) == (2, 1)  # 1: the values
        assert len(r.output_token_ids) == 3  # first token, one accepted draft, the bonus
        pre.release_prefilled("x")


def test_kv_pack_reshard_scatter_and_state_install_on_cuda(ckpts) -> None:
    """The KV wire on the device: a prefill rank packs a request's blocks and extras into one
    payload, decode ranks of TP 2 unpack it and scatter their heads into their own caches
    (TP 1 -> 2 re-sharding); a hybrid slot's states travel as extras and are installed.
    No host read, no host tensor in a device op."""
    from mtpserve.workers.kv_transfer.packing import pack_payload, scatter_blocks, unpack_payload
    from mtpserve.workers.kv_transfer.resharding import pull_plan
    from mtpserve.workers.kv_transfer.states import install_states, split_states, state_extras

    with fake_cuda(accept_some) as rt:
        pre = cuda_engine(ckpts["qwen3"], role="prefill")
        pre.add_request("x", PROMPTS[2], SAMPLED)
        pre.step()
        held = pre.prefilled["x"]
        layers = pre.runner.kv_cache.layers
        H = layers[0].shape[3]
        extras = {"draft_token_ids": torch.tensor(held.draft_token_ids, dtype=torch.long),
                  "draft_probs": held.draft_probs.float().contiguous()}
        reads = len(rt.reads)
        for dst_rank in range(2):
            dst = [torch.zeros(2, 16, *lay.shape[2:3], H // 2, lay.shape[4], dtype=lay.dtype,
                               device="cuda") for lay in layers]
            (pull,) = pull_plan(H, 1, 2, dst_rank)
            payload, kv, meta = pack_payload(layers, held.block_ids,
                                             slice(pull.head_start, pull.head_end), extras,
                                             device="cuda")
            got, got_extras = unpack_payload(payload, list(kv.shape), kv.dtype, meta)
            assert got.device.type == "cuda" and got.shape[4] == H // 2
            scatter_blocks(dst, list(range(len(held.block_ids))), got)
            assert got_extras["draft_probs"].device.type == "cuda"
        assert len(rt.reads) == reads  # the wire reads nothing on the host
        pre.release_prefilled("x")

        hybrid = cuda_engine(ckpts["qwen3_next"], role="prefill")
        cache = hybrid.runner.state_cache
        states, rest = split_states({**state_extras(cache, 0), "draft_token_ids": extras[
            "draft_token_ids"]})
        assert states and set(rest) == {"draft_token_ids"}
        install_states(cache, 1, [(0, states)], 1, 1, 0)
        assert {t.device.type for t in cache.recurrent.values()} == {"cuda"}


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64])
def test_fp8_block_linear_meets_scaled_mm_layout_rules_on_cuda(rows: int) -> None:
    """The kept-FP8 linear's call of `F.scaled_mm` on a CUDA device, checked by torch's own
    layout rules for the 1x128 x 128x128 recipe (its meta function runs on fake tensors) at
    decode and prefill row counts, padded rows included."""
    from mtpserve.workers.model import fp8

    with fake_cuda():
        w = torch.zeros(384, 256, device="cuda").to(fp8.FP8)
        lin = fp8.Fp8BlockLinear(w, torch.ones(3, 2, device="cuda"), use_scaled_mm=True)
        y = lin(torch.zeros(2, rows, 256, dtype=torch.bfloat16, device="cuda"))
        assert y.shape == (2, rows, 384) and y.dtype == torch.bfloat16 and y.is_cuda


@pytest.mark.parametrize("cap", [(8, 9), (10, 0), (12, 0)])
def test_fp8_kept_only_on_hopper(cap: tuple[int, int]) -> None:
    """Ada (8.9) has fp8 tensor cores but torch 2.13's block-scaled recipe dispatches on sm90
    only; Blackwell parts too are refused until a probe-backed path exists for them."""
    from mtpserve.workers.model import fp8
    from mtpserve.workers.model.quantization import FP8BlockConfig

    with fake_cuda() as rt:
        rt.compute_capability = cap
        path, why = fp8.select_path(FP8BlockConfig(block=(128, 128)), torch.bfloat16, "cuda")
    assert path == fp8.DEQUANTIZED and "sm90" in why, why


def test_moe_both_paths_on_cuda(ckpts) -> None:
    """The routed experts' gathered path (one pair) and grouped path (sorted pairs, device
    offsets) on the device: no host read, outputs on the device."""
    from mtpserve.workers.model.moe import MoE

    with fake_cuda() as rt:
        eng = cuda_engine(ckpts["qwen3_moe"])
        moe = next(m for m in eng.runner.model.modules() if isinstance(m, MoE))
        H = moe.gate.weight.shape[1]
        for tokens in (1, 37):
            x = torch.zeros(tokens, H, device="cuda", dtype=moe.experts.w13.dtype)
            weights, idx = moe.gate(x)
            if tokens == 1:  # one token, top-k pairs: gather one pair at a time
                y = moe.experts._gathered(x, weights[:, :1], idx[:, :1])
            else:
                y = moe.experts._grouped(x, weights, idx)
            assert y.shape == (tokens, H) and y.is_cuda
            assert moe(x.unsqueeze(0)).is_cuda
        assert not rt.reads
