"""Qwen3-Next (hybrid Gated DeltaNet + gated full attention, MoE with a gated shared expert,
one MTP layer under `mtp.*`) against transformers' own classes on a tiny random checkpoint
saved by `Qwen3NextForCausalLM`: logits (chunked prefill longer than the delta rule's chunk,
then recurrent decode, through the state slots), MTP draft logits vs `MtpModel`, greedy
k = 0..3 == plain == transformers, rejection at every draft position, seeded sampling
batch-independent, state slots all free after each test, prefix caching refused (P/D:
tests/test_hybrid_pd.py; TP: tests/test_hybrid_tp.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from helpers import assert_mtp_steps_match_reference, hf_greedy
from safetensors.torch import load_file, save_file
from tiny_tokenizer import VOCAB_SIZE, make_tokenizer

from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model_runner import ForwardBatch, ModelRunner

CONFIG = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
    linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[1],
    max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2)


def _randomise(model: torch.nn.Module) -> None:
    """Zero-centred norms away from 0, decays and write strengths spread, routing unambiguous."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # the gated norm: plain w
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith("norm.weight"):  # (1 + w) norms
                p.copy_(torch.rand(p.shape, generator=g) - 0.5)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("shared_expert_gate.weight") or name.endswith("eh_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _mtp_checkpoint_tensors(mtp: torch.nn.Module) -> dict[str, torch.Tensor]:
    """transformers' MtpModel layer 0 under the Qwen3-Next checkpoint names (`mtp.fc`,
    `mtp.pre_fc_norm_*`, `mtp.norm`, `mtp.layers.0.*` with experts one tensor each)."""
    out = {}
    rename = {"enorm.": "pre_fc_norm_embedding.", "hnorm.": "pre_fc_norm_hidden.",
              "eh_proj.": "fc.", "post_norm.": "norm."}
    for name, t in mtp.layers[0].state_dict().items():
        if name.startswith("mtp_block."):
            inner = name[len("mtp_block."):]
            if inner == "mlp.experts.gate_up_proj":
                inter = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = t[e, :inter]
                    out[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = t[e, inter:]
            elif inner == "mlp.experts.down_proj":
                for e in range(t.shape[0]):
                    out[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = t[e]
            else:
                out[f"mtp.layers.0.{inner}"] = t
        else:
            prefix = next(p for p in rename if name.startswith(p))
            out["mtp." + rename[prefix] + name[len(prefix):]] = t
    return {k: v.contiguous().clone() for k, v in out.items()}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_qwen3_next_checkpoint(tmp_path_factory.mktemp("qwen3_next") / "ckpt")


def make_qwen3_next_checkpoint(path: Path, **overrides) -> Path:
    """The tiny random checkpoint (main model saved by transformers, MTP layer from its
    `MtpModel` under the Qwen3-Next names) plus the tiny tokenizer."""
    from transformers.modeling_layers import MtpModel

    torch.manual_seed(0)
    cfg = transformers.Qwen3NextConfig(**{**CONFIG, **overrides})
    model = transformers.Qwen3NextForCausalLM(cfg).eval()
    _randomise(model)
    model.save_pretrained(path)
    model.config.num_mtp_layers = 1
    model.config.mtp_layer_types = ["full_attention"]
    mtp = MtpModel(model, 1).eval()
    with torch.no_grad():  # MtpModel leaves the Qwen3-Next experts uninitialised
        for p in mtp.layers.parameters():
            p.normal_(0, 0.05)
    _randomise(mtp)
    tensors = load_file(path / "model.safetensors")
    tensors.update(_mtp_checkpoint_tensors(mtp))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    raw["mtp_num_hidden_layers"] = 1  # as Qwen3-Next checkpoints declare their MTP layer
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    make_tokenizer(path)
    return path


def _reference(path: Path):
    ref = transformers.Qwen3NextForCausalLM.from_pretrained(path).eval()
    ref.config.num_mtp_layers = 1
    ref.config.mtp_layer_types = ["full_attention"]
    return ref


def test_config_and_check_output(ckpt, capsys) -> None:
    from mtpserve.cluster.cli import main

    cfg = ModelConfig.from_pretrained(ckpt)
    assert cfg.is_hybrid and cfg.linear_layers == [0, 1, 2]
    assert [s.attention for s in cfg.layers] == ["linear"] * 3 + ["gqa", "gqa"]
    assert [s.mlp for s in cfg.layers] == ["moe", "dense", "moe", "moe", "moe"]
    assert cfg.num_mtp_modules == 1 and cfg.mtp_naming == "qwen3_next"
    assert cfg.rotary_dim == 4  # partial rotary 0.25 of head dim 16
    assert main(["check", str(ckpt)]) == 0
    out = capsys.readouterr().out
    # conv window 3 x (2*16 + 32) fp32 + 4 value heads x 8 x 8 fp32, per linear layer
    per_layer = (3 * 64 + 4 * 8 * 8) * 4
    for line in ("family: qwen3_next", "layer pattern (L linear, F full): LLLF",
                 f"state per request: {3 * per_layer} bytes",
                 "MTP module 0 (qwen3_next naming): GQA + moe block",
                 "gated shared expert 48", "prefix caching: off for hybrid models",
                 "disaggregated serving: the state slot travels with the KV (prefill -> decode, "
                 "re-sharded by heads"):
        assert line in out, line


def test_logits_match_transformers_through_state_slots(ckpt) -> None:
    """Two prefill chunks (the second resumes the first's conv + recurrent state from the
    slot; 150 tokens: past the delta rule's 64-token chunk), then one-token decode steps and a
    4-token verify-shaped row, all == transformers' full forward within 1e-4; the runner's
    state in slot 3 does not leak into a row in slot 5 of the same batch."""
    ref = _reference(ckpt)
    runner = ModelRunner(ckpt, num_blocks=64, block_size=8, num_state_slots=8)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB_SIZE, (170,), generator=g).tolist()
    other = torch.randint(0, VOCAB_SIZE, (20,), generator=g).tolist()
    with torch.no_grad():
        full = ref(torch.tensor([tokens])).logits[0]
        full_other = ref(torch.tensor([other])).logits[0]
    blocks = list(range(30))
    blocks_other = list(range(40, 44))
    for start, end in ((0, 70), (70, 150)):
        ours = runner.execute(ForwardBatch("main", [tokens[start:end]], [start], [blocks],
                                           list(range(end - start)), state_slots=[3]))
        assert (ours - full[start:end]).abs().max().item() <= 1e-4, f"prefill {start}:{end}"
    for pos in range(150, 160):  # decode, batched with another request's prefill (padded)
        out = runner.execute(ForwardBatch(
            "main", [[tokens[pos]], other], [pos, 0], [blocks, blocks_other],
            [0, 20 + len(other) - 1], state_slots=[3, 5]))
        assert (out[0] - full[pos]).abs().max().item() <= 1e-4, f"decode at {pos}"
        assert (out[1] - full_other[-1]).abs().max().item() <= 1e-4
    verify = runner.execute(ForwardBatch("main", [tokens[160:164]], [160], [blocks],
                                         list(range(4)), state_slots=[3]))
    assert (verify - full[160:164]).abs().max().item() <= 1e-4
    # The verify row's states after each position are kept: keep the one after token 161
    # (position 1 of the row) and continue from 162: == transformers.
    runner.keep_states([0], [1])
    step = runner.execute(ForwardBatch("main", [[tokens[162]]], [162], [blocks], [0],
                                       state_slots=[3]))
    assert (step[0] - full[162]).abs().max().item() <= 1e-4


def test_mtp_draft_logits_match_transformers_mtp_model(ckpt) -> None:
    """`mtp.*` (fc, pre_fc_norm_embedding/hidden, norm, a full-attention MoE block) == the
    checkpoint loaded by transformers' `MtpModel`: one step from the main model's post-norm
    hidden, a second reusing the module on its own post-norm output, and the same draft
    logits through the paged cache after a prefill through the state slots."""
    from transformers.modeling_layers import MtpModel

    from mtpserve.workers.model.loader import load_model

    ref = _reference(ckpt)
    mtp_ref = MtpModel.from_pretrained(ref).eval()
    ours = load_model(ckpt)
    assert type(ours.mtp[0].block.mlp).__name__ == "MoE"
    ids = torch.randint(0, VOCAB_SIZE, (1, 90), generator=torch.Generator().manual_seed(2))
    n = 88
    logits_ref = assert_mtp_steps_match_reference(ref, mtp_ref, ours, ids, n)
    runner = ModelRunner(ckpt, num_blocks=16, block_size=8, num_state_slots=2)
    table = [list(range(12))]
    runner.execute(ForwardBatch("main", [ids[0, :n].tolist()], [0], table, [n - 1],
                                state_slots=[1]))
    paged = runner.execute(ForwardBatch("mtp", [ids[0, 1:n + 1].tolist()], [0], table,
                                        list(range(n)), hidden_from="main",
                                        hidden_rows=[list(range(n))]))
    assert (paged - logits_ref[0]).abs().max().item() <= 1e-4


def _assert_slots_free(llm) -> None:
    bm = llm.engine.block_manager
    stats = llm.engine.stats()
    assert stats["state_slots_used"] == 0 and not bm.slot_of
    assert stats["state_slots_total"] == llm.engine.config.max_num_seqs
    assert stats["used_blocks"] == 0
    bm.check_integrity([])


PROMPT_LENS = (7, 75, 19)  # 75: past the 64-token delta-rule chunk and the 40-token prefill


@pytest.fixture(scope="module")
def greedy_want(ckpt) -> tuple[list[list[int]], list[list[int]]]:
    ref = _reference(ckpt)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return prompts, [hf_greedy(ref, p, 12) for p in prompts]


def test_greedy_with_drafts_equals_plain_and_transformers(ckpt, greedy_want) -> None:
    """k = 0..3 through the engine (batched, chunked prefill 40 tokens a step, state slots,
    rollback after every verify round) == transformers' greedy tokens; all slots free after."""
    from mtpserve.workers import LLM, SamplingParams

    prompts, want = greedy_want
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for k in range(4):
        llm = LLM(str(ckpt), num_speculative_tokens=k, num_kv_blocks=96, block_size=4,
                  max_num_batched_tokens=40, prefix_caching=True)
        got = [r.output_token_ids for r in llm.generate(prompts, params)]
        assert got == want, f"k={k}"
        stats = llm.engine.stats()
        assert stats["prefix_caching_refused"] == 1 and stats["cached_blocks"] == 0
        _assert_slots_free(llm)


def test_rejection_at_every_draft_position_rolls_the_state_back(ckpt, greedy_want) -> None:
    """Drafts taken from the true greedy continuation with one forced wrong at position j
    (j cycling 0..k-1 and 'none wrong' round by round): every round rejects at a different
    position, so each kept state (after 1, 2, 3 or all 4 row tokens) is exercised; the
    output stays == transformers."""
    from mtpserve.workers import LLM, SamplingParams

    prompts, want = greedy_want
    k = 3
    llm = LLM(str(ckpt), num_speculative_tokens=k, num_kv_blocks=96, block_size=4,
              max_num_batched_tokens=40)
    engine = llm.engine
    truth = {}
    original = engine.proposer.extend
    rounds = {"n": 0}
    seen_accepts: set[int] = set()

    def forced(items) -> None:
        original(items)
        for item in items:
            r = item.request
            if r.finished or not r.draft_token_ids:
                continue
            cont = truth[tuple(r.prompt_token_ids)]
            done = len(r.output_token_ids)
            good = cont[done:done + len(r.draft_token_ids)]
            if len(good) < len(r.draft_token_ids):
                continue
            j = rounds["n"] % (k + 1)  # k: all drafts right
            rounds["n"] += 1
            drafts = list(good)
            if j < len(drafts):
                drafts[j] = (drafts[j] + 1) % VOCAB_SIZE
            r.draft_token_ids = drafts
            seen_accepts.add(min(j, len(drafts)))

    for p, w in zip(prompts, want, strict=True):
        truth[tuple(p)] = w
    engine.proposer.extend = forced
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = [r.output_token_ids for r in llm.generate(prompts, params)]
    assert got == want
    assert seen_accepts == {0, 1, 2, 3}
    t = engine.totals
    assert 0 < t["accepted"] < t["drafted"]
    _assert_slots_free(llm)


def test_seeded_sampling_is_batch_independent_and_abort_frees_slots(ckpt) -> None:
    from mtpserve.workers import LLM, SamplingParams

    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in (9, 30, 14)]
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=123,
                            ignore_eos=True)
    llm = LLM(str(ckpt), num_speculative_tokens=2, num_kv_blocks=96, block_size=4)
    batched = [r.output_token_ids for r in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].output_token_ids for p in prompts]
    assert batched == alone
    _assert_slots_free(llm)
    engine = llm.engine
    engine.add_request("a", prompts[1], params)
    engine.add_request("b", prompts[0], params)
    engine.step()
    assert engine.stats()["state_slots_used"] >= 1
    assert engine.abort("a") and engine.abort("b")
    _assert_slots_free(llm)


def test_cluster_config_serves_hybrid_disaggregated_with_tp_dividing_linear_heads(
        ckpt) -> None:
    """P/D moves the state slot (tests/test_hybrid_pd.py), TP shards it by heads
    (tests/test_hybrid_tp.py); a TP size that does not divide the linear heads is refused."""
    from mtpserve.cluster.config import ClusterConfig

    ClusterConfig(model=str(ckpt), decode={"tp_size": 2})
    with pytest.raises(ValueError, match="linear key heads"):
        ClusterConfig(model=str(ckpt), prefill={"tp_size": 4})


def test_preemption_recomputes_the_state_exactly(ckpt, greedy_want) -> None:
    """A KV pool too small for the batch preempts requests mid-decode: their slot is freed
    with their blocks and the recompute (from position 0, fresh state) continues exactly."""
    from mtpserve.workers import LLM, SamplingParams

    prompts, want = greedy_want
    llm = LLM(str(ckpt), num_speculative_tokens=2, num_kv_blocks=30, block_size=4,
              max_num_batched_tokens=40)
    seen = []
    original = llm.engine.scheduler._preempt

    def spy(req) -> None:
        seen.append(req.request_id)
        original(req)

    llm.engine.scheduler._preempt = spy
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = [r.output_token_ids for r in llm.generate(prompts, params)]
    assert seen, "the pool was meant to force a preemption"
    assert got == want
    _assert_slots_free(llm)
    # Linear layers keep no KV: their cache entries are one-element placeholders.
    cfg = llm.engine.model_config
    for i, buf in enumerate(llm.engine.runner.kv_cache.buffers):
        assert (buf.numel() == 2) == (i in cfg.linear_layers)


def test_qwen3_5_text_part_of_a_multimodal_checkpoint(tmp_path) -> None:
    """Qwen3.5 (dense): the config nested under `text_config` (M-RoPE sections, a vision
    config), weights under `model.language_model.*` next to a vision tower that is ignored:
    logits == transformers' `Qwen3_5ForCausalLM` on the same text weights, through the state
    slots (chunked prefill past 64 tokens, then decode steps)."""
    text_dir, mm_dir = tmp_path / "text", tmp_path / "mm"
    torch.manual_seed(3)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_value_heads",
            "linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim", "max_position_embeddings", "tie_word_embeddings",
            "rms_norm_eps")
    ref = transformers.Qwen3_5ForCausalLM(
        transformers.Qwen3_5TextConfig(**{k: CONFIG[k] for k in keys})).eval()
    _randomise(ref)
    ref.save_pretrained(text_dir)
    text_cfg = json.loads((text_dir / "config.json").read_text())
    text_cfg["rope_parameters"].update(mrope_section=[1, 1, 0], mrope_interleaved=True)
    mm_dir.mkdir()
    (mm_dir / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": text_cfg, "vision_config": {"model_type": "qwen3_5", "depth": 1},
        "tie_word_embeddings": False}))
    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in load_file(text_dir / "model.safetensors").items()}
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(8, 8)
    save_file(tensors, mm_dir / "model.safetensors", metadata={"format": "pt"})

    cfg = ModelConfig.from_pretrained(mm_dir)
    assert cfg.model_type == "qwen3_5_text" and cfg.weights_prefix == "model.language_model."
    assert cfg.linear is not None and not cfg.linear.fused_projections
    assert cfg.rotary_dim == 4 and cfg.moe is None
    runner = ModelRunner(mm_dir, num_blocks=32, block_size=8, num_state_slots=2)
    tokens = torch.randint(0, VOCAB_SIZE, (100,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = ref(tokens.unsqueeze(0)).logits[0]
    tokens = tokens.tolist()
    table = [list(range(16))]
    ours = runner.execute(ForwardBatch("main", [tokens[:96]], [0], table, list(range(96)),
                                       state_slots=[0]))
    assert (ours - full[:96]).abs().max().item() <= 1e-4
    for pos in range(96, 100):
        step = runner.execute(ForwardBatch("main", [[tokens[pos]]], [pos], table, [0],
                                           state_slots=[0]))
        assert (step[0] - full[pos]).abs().max().item() <= 1e-4, pos
