"""MiMo-V2-Flash against transformers' `MiMoV2FlashForCausalLM` on tiny random checkpoints it
saved: full and sliding layers with their own KV head counts, 24-dim keys over 16-dim scaled
values, attention sinks, per-type partial ropes, the sigmoid MoE; MTP layers under
`model.mtp.layers.{i}` (transformers builds none: the reference is its own decoder layer,
norms and LM head around the same weights). Paged logits within 1e-4 (fp32), the sinks matter,
MTP draft logits == the reference, greedy k = 0..3 == transformers, TP 2 == TP 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from helpers import assert_graphs_match_eager, hf_greedy
from test_model_families import _check_paged_logits
from tiny_models import make_mimo_v2_flash_checkpoint, mimo_mtp_blocks
from tiny_tokenizer import VOCAB_SIZE, make_tokenizer

from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.loader import load_model
from mtpserve.workers.model_runner import ForwardBatch, ModelRunner


@pytest.fixture(scope="module")
def mimo(tmp_path_factory) -> Path:
    path = make_mimo_v2_flash_checkpoint(tmp_path_factory.mktemp("mimo2") / "mimo", num_mtp=1,
                                         vocab_size=VOCAB_SIZE)
    make_tokenizer(path)
    return path


def _reference(path: Path):
    return transformers.MiMoV2FlashForCausalLM.from_pretrained(path).eval()


def test_mimo_config(mimo) -> None:
    cfg = ModelConfig.from_pretrained(mimo)
    assert cfg.num_key_value_heads == 2 and cfg.v_head_dim == 16 and cfg.value_scale == 0.707
    assert [s.num_kv_heads for s in cfg.layers] == [1, None, None, 1, None]
    assert [s.attention_sinks for s in cfg.layers] == [False, True, True, False, True]
    assert [s.sliding_window for s in cfg.layers] == [None, 5, 5, None, 5]
    assert cfg.rotary_dim == 8 and cfg.mtp_naming == "mimo_v2" and cfg.num_mtp_modules == 1
    lines = "\n".join(cfg.describe())
    assert "2 KV heads (1 in full layers, repeated into the cache)" in lines
    assert "attention sinks in windowed layers" in lines


def test_mimo_logits_match_transformers_and_the_sinks_matter(mimo) -> None:
    _check_paged_logits(mimo, _reference(mimo), 24, 6)
    ids = torch.randint(0, VOCAB_SIZE, (1, 16), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(16).unsqueeze(0)
    ours = load_model(mimo)
    with torch.no_grad():
        a = ours.compute_logits(ours(ids, pos))
        for layer in ours.model.layers:
            if layer.self_attn.sinks is not None:
                layer.self_attn.sinks.fill_(-1e4)  # a sink nobody attends to: plain softmax
        b = ours.compute_logits(ours(ids, pos))
    assert (a - b).abs().max().item() > 1e-3


def _reference_mtp(path: Path, ref, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Draft logits of MTP module 0 from transformers' parts: its decoder layer (layer 4 of
    the model saved beside the checkpoint, the same tensors), RMSNorms, eh_proj, LM head."""
    from safetensors.torch import load_file

    longer = transformers.MiMoV2FlashForCausalLM.from_pretrained(mimo_mtp_blocks(path)).eval()
    w = load_file(path / "model.safetensors")
    p = "model.mtp.layers.0."

    def norm(x, name):
        x32 = x.float()
        return w[p + name + ".weight"] * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True)
                                                            + 1e-6))

    n = tokens.shape[1]
    pos = torch.arange(n).unsqueeze(0)
    e = ref.model.embed_tokens(tokens)
    x = torch.nn.functional.linear(torch.cat([norm(e, "enorm"), norm(h, "hnorm")], -1),
                                   w[p + "eh_proj.weight"])
    d = pos[0].view(-1, 1) - pos[0].view(1, -1)
    mask = torch.zeros(n, n).masked_fill(~((d >= 0) & (d < 5)), float("-inf")).view(1, 1, n, n)
    rope = longer.model.rotary_emb(x, pos, "sliding_attention")
    y = longer.model.layers[4](x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
    return ref.lm_head(norm(y, "final_layernorm"))


def test_mimo_mtp_draft_logits_match_the_reference(mimo) -> None:
    ref = _reference(mimo)
    ours = load_model(mimo)
    block = ours.mtp[0].block.self_attn
    assert block.window == 5 and block.sinks is not None
    ids = torch.randint(0, VOCAB_SIZE, (1, 21), generator=torch.Generator().manual_seed(2))
    n = 19
    pos = torch.arange(n).unsqueeze(0)
    with torch.no_grad():
        h_ref = ref.model(ids[:, :n]).last_hidden_state
        h = ours(ids[:, :n], pos)
        assert (h - h_ref).abs().max().item() <= 1e-4
        want = _reference_mtp(mimo, ref, h_ref, ids[:, 1:n + 1])
        got = ours.compute_mtp_logits(0, ours.forward_mtp(0, ids[:, 1:n + 1], h, pos))
    assert (got - want).abs().max().item() <= 1e-4
    runner = ModelRunner(mimo, num_blocks=16, block_size=4)
    table = [list(range(1, 7))]
    runner.execute(ForwardBatch("main", [ids[0, :n].tolist()], [0], table, [n - 1]))
    paged = runner.execute(ForwardBatch("mtp", [ids[0, 1:n + 1].tolist()], [0], table,
                                        list(range(n)), hidden_from="main",
                                        hidden_rows=[list(range(n))]))
    assert (paged - want[0]).abs().max().item() <= 1e-4


def test_mimo_greedy_with_drafts_equals_transformers(mimo) -> None:
    from mtpserve.workers import LLM, SamplingParams

    ref = _reference(mimo)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in (7, 19)]
    want = [hf_greedy(ref, p, 12) for p in prompts]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for k in range(4):
        llm = LLM(str(mimo), num_speculative_tokens=k, num_kv_blocks=64, block_size=4)
        got = [r.output_token_ids for r in llm.generate(prompts, params)]
        assert got == want, f"k={k}"


def test_mimo_tp2_engine_with_prefix_caching_equals_tp1(mimo) -> None:
    """Two gloo ranks: 2 query heads and their sinks per rank, the sliding layers' 2 KV heads
    split, the full layers' one replicated; k = 2 and prefix caching == one process."""
    import torch.multiprocessing as mp
    from serve_cluster import free_port
    from test_tensor_parallel import PROMPT, _greedy_tokens, _split_rank

    path = str(mimo)
    prompts = [PROMPT, [9, 8, 7, 6, 5, 4, 3], PROMPT + [1, 2, 3, 4, 5]]
    want, _ = _greedy_tokens(None, path, prompts, caching=False)
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_split_rank, args=(r, port, path, prompts, out, True))
             for r in range(2)]
    for p in procs:
        p.start()
    results = dict((role, rest) for role, *rest in (out.get(timeout=240) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (_, (got, hits)), (_, worker_failed) = results["driver"], results["worker"]
    assert got == want and hits == 8 and not worker_failed


@pytest.mark.slow
def test_mimo_graph_forwards_match_eager(mimo) -> None:
    """Compiled decode graphs (sinks in the in-place paged attention) == eager."""
    assert_graphs_match_eager(mimo)


def test_mimo_seeded_sampling_batch_independent_and_resumable(mimo) -> None:
    """A seeded sampled request (k = 3) gives the same tokens alone, batched, under
    preemption, and resumed after a migration at round ends."""
    import test_seeded_reproducibility as seeded

    seeded.test_batched_and_preempted_equal_alone(mimo)
    seeded.test_resume_after_migration_equals_alone(mimo)
