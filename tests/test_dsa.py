"""DeepSeek Sparse Attention: DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`) against
transformers' own classes on tiny random checkpoints they saved. The indexer keeps 6 tokens per
query and every prompt here is longer, so the selection decides the logits: paged prefill and
decode logits == transformers within 1e-4 (fp32), MTP draft logits == transformers' MtpModel,
greedy k = 0..3 == transformers, GLM-5's "shared" indexer layers, the cache slot holding the
indexer key, TP = 2 with prefix caching == one process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from helpers import (
    assert_greedy_with_drafts_equals,
    assert_mtp_steps_match_reference,
    assert_tp2_engine_equals_tp1,
    hf_greedy,
    paged_mtp_logits,
)
from test_model_families import _check_paged_logits
from tiny_models import HF_FAMILIES, make_hf_checkpoint
from tiny_tokenizer import VOCAB_SIZE, make_tokenizer

from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.loader import load_model
from mtpserve.workers.model_runner import ForwardBatch, ModelRunner

DSA_FAMILIES = ["deepseek_v32", "glm_moe_dsa"]
TOPK = HF_FAMILIES["deepseek_v32"][2]["index_topk"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    made: dict[tuple, Path] = {}

    def make(family: str, **kw) -> Path:
        key = (family, repr(sorted(kw.items())))
        if key not in made:
            name = f"{family}-{len(made)}"
            made[key] = make_hf_checkpoint(tmp_path_factory.mktemp("dsa") / name, family, **kw)
        return made[key]

    return make


def _reference(path: Path, family: str, num_mtp: int = 0):
    ref = getattr(transformers, HF_FAMILIES[family][1]).from_pretrained(
        path, attn_implementation="eager").eval()
    if num_mtp:  # what transformers' MtpModel needs to find and build the MTP layer
        ref._keys_to_ignore_on_load_unexpected = [
            rf"model\.layers\.{ref.config.num_hidden_layers + m}\..*" for m in range(num_mtp)]
        ref.config.num_mtp_layers = num_mtp
        ref.config.mtp_mlp_layer_types = ["sparse"] * num_mtp
        # Its mask table knows no "indexed_attention": a causal mask is what the layer needs.
        ref.config.mtp_layer_types = ["full_attention"] * num_mtp
    return ref


@pytest.mark.parametrize("family", DSA_FAMILIES)
def test_dsa_logits_match_transformers_and_the_selection_matters(ckpt, family,
                                                                 monkeypatch) -> None:
    from mtpserve.workers.model import mla

    path = ckpt(family, num_mtp=1)
    ref = _reference(path, family)
    calls = []
    sparse = mla.MLAttention._sparse_decode
    monkeypatch.setattr(mla.MLAttention, "_sparse_decode",
                        lambda self, *a: calls.append(1) or sparse(self, *a))
    # Two prefill chunks (the second scores the first's cached indexer keys), then one-token
    # decode steps, all past top-k: read from the pages (indexer keys, then the selected
    # latents), and again from the whole gathered context.
    _check_paged_logits(path, ref, 30, 6)
    assert len(calls) >= 2 * 7  # both layers' decode steps and the second chunk
    monkeypatch.setattr(mla, "_SPARSE_DECODE", False)
    _check_paged_logits(path, ref, 30, 6)
    # The same weights attending to every token give other logits: the top-k is in effect.
    dense = path.parent / (path.name + "-dense")
    shutil.copytree(path, dense)
    cfg = json.loads((dense / "config.json").read_text())
    cfg["index_topk"] = 4096
    (dense / "config.json").write_text(json.dumps(cfg))
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(30).unsqueeze(0)
    with torch.no_grad():
        a, b = (m.compute_logits(m(ids, pos)) for m in (load_model(path), load_model(dense)))
    assert (a[0, :TOPK] - b[0, :TOPK]).abs().max().item() <= 1e-5  # nothing left out yet
    assert (a[0, TOPK:] - b[0, TOPK:]).abs().max().item() > 1e-2


def test_inventory_and_cache_slot(ckpt) -> None:
    """`check`'s inventory names the indexer; one cache slot holds [latent | indexer key]
    and the key written there is the indexer's own for that token."""
    path = ckpt("deepseek_v32", num_mtp=1)
    cfg = ModelConfig.from_pretrained(path)
    lines = "\n".join(cfg.describe())
    assert "DSA: indexer 16 heads x 16, top-6 tokens per query, half-split rope" in lines
    assert "cache 56 values/token/layer (latent 40 + indexer key 16)" in lines
    runner = ModelRunner(path, num_blocks=8, block_size=4)
    assert runner.kv_cache.layers[0].shape[-2:] == (1, 28)
    ids = list(range(3, 11))
    runner.execute(ForwardBatch("main", [ids], [0], [[2, 5]], [7]))
    layer0 = runner.model.model.layers[0]
    with torch.no_grad():
        x = layer0.input_layernorm(runner.model.model.embed_tokens(torch.tensor([ids])))
        rope = runner.model.rotary.cos_sin(torch.arange(8).unsqueeze(0))
        key = layer0.self_attn.indexer.key(x, rope)[0]
    cache = runner.kv_cache.layers[0]
    stored = torch.cat([torch.cat([cache[0, b], cache[1, b]], dim=-1).reshape(4, 56)
                        for b in (2, 5)])[:, 40:]
    assert (stored - key).abs().max().item() <= 1e-6


def test_glm5_shared_indexer_layers(ckpt) -> None:
    """GLM-5 layers listed "shared" in `indexer_types` have no indexer and reuse the previous
    full layer's top-k, as transformers' GlmMoeDsaModel does."""
    path = ckpt("glm_moe_dsa", num_layers=3, indexer_types=["full", "shared", "full"])
    assert ModelConfig.from_pretrained(path).mla.dsa.shared_layers == (1,)
    ours = load_model(path)
    assert ours.model.layers[1].self_attn.indexer is None
    assert not any(".layers.1.self_attn.indexer" in n for n, _ in ours.named_parameters())
    _check_paged_logits(path, _reference(path, "glm_moe_dsa"), 26, 4)


@pytest.mark.parametrize("family", DSA_FAMILIES)
def test_dsa_mtp_draft_logits_match_transformers_mtp_model(ckpt, family) -> None:
    """The MTP layer's own indexer and sparse attention: draft logits (two steps) ==
    transformers' MtpModel, and the same through the paged cache."""
    from transformers.modeling_layers import MtpModel

    path = ckpt(family, num_mtp=1)
    ref = _reference(path, family, num_mtp=1)
    mtp_ref = MtpModel.from_pretrained(ref).eval()
    if family == "glm_moe_dsa":  # its decoder layer also returns its top-k, which MtpLayer
        block = mtp_ref.layers[0].mtp_block  # does not expect: keep the hidden states
        forward = block.forward
        block.forward = lambda *a, **kw: forward(*a, **kw)[0]
    ours = load_model(path)
    assert ours.mtp[0].block.self_attn.indexer is not None
    ids = torch.randint(0, 256, (1, 21), generator=torch.Generator().manual_seed(2))
    n = 19
    logits_ref = assert_mtp_steps_match_reference(ref, mtp_ref, ours, ids, n)
    paged = paged_mtp_logits(path, ids, n, block_size=8)
    assert (paged - logits_ref[0]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", DSA_FAMILIES)
def test_dsa_greedy_with_drafts_equals_transformers(ckpt, family) -> None:
    path = ckpt(family, num_mtp=1, vocab_size=VOCAB_SIZE)
    make_tokenizer(path)
    assert_greedy_with_drafts_equals(path, _reference(path, family), VOCAB_SIZE, lens=(9, 21))


def test_dsa_tp2_engine_with_prefix_caching_equals_tp1(ckpt) -> None:
    """Two gloo ranks (heads split, the indexer and the [latent | key] slot replicated), k = 2
    and prefix caching (a later prompt reuses an earlier one's blocks, indexer keys included)
    == one process without prefix caching."""
    assert_tp2_engine_equals_tp1(str(ckpt("deepseek_v32", num_mtp=1)))


def test_dsa_seeded_sampling_batch_independent_and_resumable(ckpt) -> None:
    """A seeded sampled request (k = 3) on DeepSeek-V3.2 gives the same tokens alone, batched
    with other requests, under preemption, and resumed after a migration at round ends."""
    import test_seeded_reproducibility as seeded

    path = ckpt("deepseek_v32", num_mtp=1)
    seeded.test_batched_and_preempted_equal_alone(path)
    seeded.test_resume_after_migration_equals_alone(path)


def test_several_mtp_modules_each_draft_at_their_depth(ckpt) -> None:
    """GLM-5 with 5 MTP modules (GLM-5.2 drafts 5): each module's draft logits == transformers'
    MtpModel layer m on the same inputs; greedy k = 5 == transformers, and the stats name the
    module behind each draft depth."""
    from transformers.modeling_layers import MtpModel

    from mtpserve.workers import LLM, SamplingParams

    path = ckpt("glm_moe_dsa", num_mtp=5, vocab_size=VOCAB_SIZE)
    make_tokenizer(path)
    ref = _reference(path, "glm_moe_dsa", num_mtp=5)
    ref.config.indexer_types = ["full"] * 5  # MtpModel builds layer m from entry m
    mtp_ref = MtpModel.from_pretrained(ref).eval()
    for layer in mtp_ref.layers:  # GLM-5's layer also returns its top-k (see above)
        forward = layer.mtp_block.forward
        layer.mtp_block.forward = (lambda f: lambda *a, **kw: f(*a, **kw)[0])(forward)
    ours = load_model(path)
    ids = torch.randint(0, VOCAB_SIZE, (1, 20), generator=torch.Generator().manual_seed(6))
    n = 18
    pos = torch.arange(n).unsqueeze(0)
    with torch.no_grad():
        h = ref.model(ids[:, :n]).last_hidden_state
        for m in range(5):
            want = mtp_ref._project_to_logits(
                mtp_ref.forward_layer(m, h, pos, None, input_ids=ids[:, 1:n + 1]))
            got = ours.compute_mtp_logits(m, ours.forward_mtp(m, ids[:, 1:n + 1], h, pos))
            assert (got - want).abs().max().item() <= 1e-4, f"module {m}"
    prompt = ids[0, :13].tolist()
    llm = LLM(str(path), num_speculative_tokens=5, num_kv_blocks=64, block_size=4)
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert out[0].output_token_ids == hf_greedy(ref, prompt, 12)
    stats = llm.engine.stats()
    assert stats["mtp_module_per_position"] == [0, 1, 2, 3, 4]
    assert len(stats["drafted_per_position"]) == 5 and stats["drafted_per_position"][4] > 0


def test_glm5_indexer_schedule_without_indexer_types(ckpt) -> None:
    """Without `indexer_types`, GLM-5's schedule comes from `index_topk_freq` /
    `index_skip_topk_offset` (or `index_topk_pattern`), as transformers derives it."""
    cfg = json.loads((ckpt("glm_moe_dsa", num_mtp=1) / "config.json").read_text())
    for key in ("indexer_types", "mlp_layer_types", "layer_types"):  # 2 layers long
        cfg.pop(key)
    freq = ModelConfig.from_dict({**cfg, "num_hidden_layers": 4, "index_topk_freq": 2})
    assert freq.mla.dsa.shared_layers == (2,)
    pattern = ModelConfig.from_dict({**cfg, "num_hidden_layers": 4,
                                     "index_topk_pattern": "FSSF"})
    assert pattern.mla.dsa.shared_layers == (1, 2)
