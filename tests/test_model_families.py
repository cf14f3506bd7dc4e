"""Families beyond the dense ones (Qwen3-MoE, GLM-4.5 with its MoE MTP layer) and configs as
transformers 5 writes them (`rope_parameters`, YaRN, llama3): our logits, expert choices and
MTP draft logits == transformers on checkpoints its own classes saved; greedy decoding with
k = 0..3 drafts == plain decoding == transformers; unsupported pieces refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from helpers import assert_mtp_steps_match_reference, assert_tp2_engine_equals_tp1, hf_greedy
from tiny_models import HF_FAMILIES, make_hf_checkpoint
from tiny_tokenizer import VOCAB_SIZE, make_tokenizer

from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.loader import load_model
from mtpserve.workers.model.rope import UnsupportedConfig
from mtpserve.workers.model_runner import ForwardBatch, ModelRunner

YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
        "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    made: dict[str, Path] = {}

    def make(name: str, family: str, **kw) -> Path:
        if name not in made:
            made[name] = make_hf_checkpoint(tmp_path_factory.mktemp("fam") / name, family, **kw)
        return made[name]

    return make


def _reference(path: Path, family: str, num_mtp: int = 0):
    cls = getattr(transformers, HF_FAMILIES[family][1])
    ref = cls.from_pretrained(path).eval()
    if num_mtp:  # let transformers' MtpModel find the MTP layer of a tiny checkpoint
        ref._keys_to_ignore_on_load_unexpected = [
            rf"model\.layers\.{ref.config.num_hidden_layers + m}\..*" for m in range(num_mtp)]
        if family == "glm4_moe_lite":  # its config class does not declare the MTP layer yet
            ref.config.num_mtp_layers = num_mtp
            ref.config.mtp_mlp_layer_types = ["sparse"] * num_mtp
    return ref


def _check_paged_logits(path: Path, ref, n_prompt: int, n_more: int, seed: int = 1) -> None:
    """Chunked prefill + one-token steps through our paged cache == transformers' full
    forward over the same tokens, within 1e-4 (fp32)."""
    runner = ModelRunner(path, num_blocks=64, block_size=8)
    vocab = ref.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n_prompt + n_more,), generator=g).tolist()
    with torch.no_grad():
        full = ref(torch.tensor([tokens])).logits[0]
    blocks = list(range(63, 63 - (n_prompt + n_more) // 8 - 2, -1))
    half = n_prompt // 2  # two prefill chunks: the second attends to the first through the cache
    for start, end in ((0, half), (half, n_prompt)):
        ours = runner.execute(ForwardBatch("main", [tokens[start:end]], [start], [blocks],
                                           logit_rows=list(range(end - start))))
        assert (ours - full[start:end]).abs().max().item() <= 1e-4, f"prefill {start}:{end}"
    for pos in range(n_prompt, n_prompt + n_more):
        step = runner.execute(ForwardBatch("main", [[tokens[pos]]], [pos], [blocks], [0]))
        assert (step[0] - full[pos]).abs().max().item() <= 1e-4, f"decode at {pos}"


# -- configs as transformers 5 writes them ------------------------------------------------


@pytest.mark.parametrize("name,family,rope,prompt", [
    ("theta1e6", "qwen3", {"rope_type": "default", "rope_theta": 1e6}, 40),
    ("yarn", "qwen3", YARN, 150),
    ("llama3", "llama", LLAMA3, 150),
])
def test_rope_parameters_match_transformers(ckpt, name, family, rope, prompt) -> None:
    path = ckpt(name, family, rope_parameters=dict(rope))
    saved = json.loads((path / "config.json").read_text())
    assert "rope_theta" not in saved and saved["rope_parameters"]["rope_theta"] == rope[
        "rope_theta"]  # the transformers-5 layout this test is about
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.rope.theta == rope["rope_theta"] and cfg.rope.rope_type == rope["rope_type"]
    _check_paged_logits(path, _reference(path, family), prompt, 6)


def test_yarn_matters_on_the_long_prompt(ckpt) -> None:
    """The YaRN prompt is long enough that serving it without YaRN would be wrong (so the
    parity above is evidence that YaRN is applied)."""
    yarn = load_model(ckpt("yarn", "qwen3", rope_parameters=dict(YARN)))
    plain = load_model(ckpt("theta1e6-yarnweights", "qwen3", rope_parameters={
        "rope_type": "default", "rope_theta": 1e6}))
    plain.load_state_dict(yarn.state_dict())
    ids = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(150).unsqueeze(0)
    with torch.no_grad():
        gap = (yarn.compute_logits(yarn(ids, pos)) - plain.compute_logits(plain(ids, pos)))
    assert gap.abs().max().item() > 1e-2


def test_legacy_top_level_rope_keys(ckpt, tmp_path) -> None:
    """Hub configs hold `rope_theta` at the top level and the scaling in `rope_scaling`."""
    src = ckpt("yarn", "qwen3", rope_parameters=dict(YARN))
    path = tmp_path / "legacy"
    shutil.copytree(src, path)
    cfg = json.loads((path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = {**{k: v for k, v in params.items() if k != "rope_type"},
                           "type": "yarn"}
    (path / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_pretrained(path).rope == ModelConfig.from_pretrained(src).rope
    _check_paged_logits(path, _reference(path, "qwen3"), 60, 2)


@pytest.mark.parametrize("patch,named", [
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "dynamic"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
    ({"rope_parameters": {**YARN, "extrapolation_factor": 2}}, "extrapolation_factor"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}, "weight_block_size"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "awq"),
    ({"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_attention"),
    ({"index_topk": 2048}, "index_topk"),
    ({"model_type": "deepseek_v4"}, "hyper-connections"),
    ({"kv_lora_rank": 16}, "kv_lora_rank"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"model_type": "glm4_moe", "n_routed_experts": 8, "num_experts_per_tok": 2,
      "moe_intermediate_size": 32, "topk_method": "greedy"}, "topk_method"),
])
def test_unsupported_pieces_refused_by_name(ckpt, patch, named) -> None:
    cfg = json.loads((ckpt("theta1e6", "qwen3", rope_parameters={
        "rope_type": "default", "rope_theta": 1e6}) / "config.json").read_text())
    with pytest.raises(UnsupportedConfig, match=named):
        ModelConfig.from_dict({**cfg, **patch})


def test_check_prints_inventory_and_refuses(ckpt, tmp_path, capsys) -> None:
    from mtpserve.cluster.cli import main

    glm = ckpt("glm4_moe", "glm4_moe", num_mtp=1)
    assert main(["check", str(glm)]) == 0
    out = capsys.readouterr().out
    for line in ("family: glm4_moe", "layers 0: GQA + dense (1)", "layers 1: GQA + moe (1)",
                 "8 experts, top-2 (sigmoid, 1 of 2 groups", "1 shared",
                 "MTP module 0 (deepseek_v3 naming): GQA + moe block",
                 "rope: default, theta 10000, partial rotary 0.5"):
        assert line in out, line
    bad = tmp_path / "bad"
    shutil.copytree(glm, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    (bad / "config.json").write_text(json.dumps(cfg))
    assert main(["check", str(bad)]) != 0
    assert "'dynamic'" in capsys.readouterr().err


# -- MoE families ---------------------------------------------------------------------------


def _routing(model: torch.nn.Module, hf: bool) -> list[torch.Tensor]:
    """Hooks recording each MoE router's chosen experts (sorted per token)."""
    seen: list[torch.Tensor] = []

    def hook(_mod, _inp, out) -> None:
        idx = out[2] if hf else out[1]
        seen.append(idx.sort(dim=-1).values)

    for name, mod in model.named_modules():
        if name.endswith("mlp.gate") and not name.startswith("mtp"):
            mod.register_forward_hook(hook)
    return seen


MOE_FAMILIES = [("qwen3_moe", 0), ("glm4_moe", 1), ("deepseek_v3", 1), ("glm4_moe_lite", 1)]
MTP_FAMILIES = ["glm4_moe", "deepseek_v3", "glm4_moe_lite"]


@pytest.mark.parametrize("family,num_mtp", MOE_FAMILIES)
def test_moe_logits_and_expert_choices_match_transformers(ckpt, family, num_mtp) -> None:
    path = ckpt(family, family, num_mtp=num_mtp)
    ref = _reference(path, family)
    _check_paged_logits(path, ref, 24, 5)
    ours = load_model(path)
    ours_seen, ref_seen = _routing(ours, hf=False), _routing(ref, hf=True)
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours(ids, torch.arange(30).unsqueeze(0))
        ref(ids)
    assert len(ours_seen) == len(ref_seen) == 1  # layer 1 is MoE, layer 0 dense in both
    assert torch.equal(ours_seen[0], ref_seen[0])
    assert len(ours_seen[0].unique()) > 2  # the tokens do not all pick the same experts


def test_moe_gathered_and_grouped_experts_agree(ckpt) -> None:
    """The two batched expert paths (gathered weights for decode and compiled graphs,
    grouped by expert for prefill) compute the same thing."""
    moe = load_model(ckpt("glm4_moe", "glm4_moe", num_mtp=1)).model.layers[1].mlp
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    assert moe.experts(x, *moe.gate(x)).shape == (40, 64)
    w, idx = moe.gate(x)
    a = moe.experts._gathered(x, w, idx)
    b = moe.experts._grouped(x, w, idx)
    assert (a - b).abs().max().item() <= 1e-5


# -- the MTP layer --------------------------------------------------------------------------


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_mtp_draft_logits_match_transformers_mtp_model(ckpt, family) -> None:
    """Draft logits of the MoE MTP layer == transformers' `MtpModel` (the DeepSeek/GLM
    reference): first step from the main model's post-norm hidden, second step reusing the
    module on its own post-norm output (the contract in workers/model/mtp.py)."""
    from transformers.modeling_layers import MtpModel

    path = ckpt(family, family, num_mtp=1)
    ref = _reference(path, family, num_mtp=1)
    mtp_ref = MtpModel.from_pretrained(ref).eval()
    ours = load_model(path)
    assert type(ours.mtp[0].block.mlp).__name__ == "MoE"
    ids = torch.randint(0, 256, (1, 21), generator=torch.Generator().manual_seed(2))
    n = 19
    logits_ref = assert_mtp_steps_match_reference(ref, mtp_ref, ours, ids, n)

    # The same draft logits through the paged cache (prefill, then MTP over its rows).
    runner = ModelRunner(path, num_blocks=16, block_size=8)
    table = [[1, 2, 3]]
    runner.execute(ForwardBatch("main", [ids[0, :n].tolist()], [0], table, [n - 1]))
    paged = runner.execute(ForwardBatch("mtp", [ids[0, 1:n + 1].tolist()], [0], table,
                                        list(range(n)), hidden_from="main",
                                        hidden_rows=[list(range(n))]))
    assert (paged - logits_ref[0]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family,num_mtp", [("glm4_moe", 1), ("qwen3_moe", 0),
                                             ("deepseek_v3", 1)])
def test_greedy_with_drafts_equals_plain_and_transformers(ckpt, family, num_mtp) -> None:
    from mtpserve.workers import LLM, SamplingParams

    path = ckpt(f"{family}-tok", family, num_mtp=num_mtp, vocab_size=VOCAB_SIZE)
    make_tokenizer(path)
    ref = _reference(path, family)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in (7, 19)]
    want = [hf_greedy(ref, p, 16) for p in prompts]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for k in range(4 if num_mtp else 1):
        llm = LLM(str(path), num_speculative_tokens=k, num_kv_blocks=64, block_size=4)
        got = [r.output_token_ids for r in llm.generate(prompts, params)]
        assert got == want, f"k={k}"


def _tp_rank(rank: int, port: int, paths: list[str], out) -> None:
    """One TP rank: every checkpoint's batches (one process start serves them all)."""
    import os

    import torch.distributed as dist
    from test_tensor_parallel import batches

    from mtpserve.workers.model.parallel import set_tp

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    set_tp(rank, 2, dist.group.WORLD)
    results = []
    for path in paths:
        runner = ModelRunner(path, num_blocks=8, block_size=4)
        experts = runner.model.model.layers[1].mlp.experts.w13.shape[1]
        results.append(([runner.execute(b).tolist() for b in batches()],
                         runner.kv_cache.layers[0].shape[3], experts))
    if rank == 0:
        out.put(results)
        out.close()
        out.join_thread()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # as test_tensor_parallel: skip a teardown gloo sometimes aborts


def test_tp2_equals_tp1(ckpt) -> None:
    """TP=2 (gloo, two processes): each rank holds half of every expert's intermediate dim
    and of the shared expert's, routing runs replicated; main and MoE-MTP logits == TP=1,
    for GLM (GQA: one of the 2 KV heads per rank) and DeepSeek (MLA: heads split, the latent
    cache replicated, one 'head' per rank)."""
    import torch.multiprocessing as mp
    from serve_cluster import free_port
    from test_tensor_parallel import batches

    paths = [str(ckpt(f, f, num_mtp=1)) for f in ("glm4_moe", "deepseek_v3")]
    runners = [ModelRunner(p, num_blocks=8, block_size=4) for p in paths]
    wants = [[r.execute(b) for b in batches()] for r in runners]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_tp_rank, args=(r, port, paths, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = out.get(timeout=180)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for (logits, cache_heads, w13_rows), want in zip(got, wants, strict=True):
        assert cache_heads == 1 and w13_rows == 2 * 32 // 2  # half of each expert's 2 * 32
        for g, w in zip(logits, want, strict=True):
            assert (torch.tensor(g) - w).abs().max().item() <= 1e-4


def test_mla_tp2_engine_greedy_equals_tp1(ckpt) -> None:
    """The engine with k = 2 drafts and prefix caching on an MLA model split over two gloo
    ranks (heads split, the latent cache replicated; activations over shared memory, a
    later prompt extending an earlier one) == one process without prefix caching."""
    seen = assert_tp2_engine_equals_tp1(ckpt("deepseek_v3", "deepseek_v3", num_mtp=1))
    assert seen["shm"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_compiled_decode_graphs_cover_moe_and_mla_layers(ckpt, family) -> None:
    """Fixed-shape compiled graphs run the MoE layers (gathered experts, static shapes), MLA
    over the latent cache and the MoE MTP block: same logits as eager, no eager fallback."""
    path = ckpt(family, family, num_mtp=1)
    runners = [ModelRunner(path, num_blocks=32, block_size=4, decode_graphs=g)
               for g in (False, True)]
    tables = [[1, 2, 3, 4], [5, 6, 7, 8]]
    outs: list[list[torch.Tensor]] = [[], []]
    for runner, out in zip(runners, outs, strict=True):
        runner.execute(ForwardBatch("main", [[5, 6, 7, 8, 9], [10, 11]], [0, 0], tables, [4, 6]))
        out.append(runner.execute(ForwardBatch("main", [[7], [8]], [5, 2], tables, [0, 1])))
        out.append(runner.execute(ForwardBatch("mtp", [[7], [8]], [5, 2], tables, [0, 1],
                                               hidden_from="main", hidden_rows=[[0], [1]])))
    assert runners[1].graphs is not None and len(runners[1].graphs.compiled) >= 2
    for a, b in zip(*outs, strict=True):
        assert (a - b).abs().max().item() <= 1e-5


def test_cluster_config_refuses_unsupported_model(ckpt, tmp_path) -> None:
    """`mtpserve up` validates the ClusterConfig before starting Ray: the unsupported piece
    is named there."""
    from mtpserve.cluster.config import ClusterConfig

    bad = tmp_path / "bad"
    shutil.copytree(ckpt("glm4_moe", "glm4_moe", num_mtp=1), bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq"}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="awq"):
        ClusterConfig(model=str(bad))
    ClusterConfig(model=str(ckpt("glm4_moe", "glm4_moe", num_mtp=1)))  # the family itself is fine


DS_YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
           "original_max_position_embeddings": 32, "mscale": 0.707, "mscale_all_dim": 1.0,
           "beta_fast": 32, "beta_slow": 1}


def test_mla_yarn_with_attention_scale_correction(ckpt) -> None:
    """DeepSeek's YaRN: cos/sin factor mscale/mscale_all_dim and the softmax scale times
    mscale(factor, mscale_all_dim)^2, over a prompt long enough that both matter."""
    path = ckpt("ds-yarn", "deepseek_v3", num_mtp=1, rope_parameters=dict(DS_YARN))
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.rope.mscale_all_dim == 1.0 and cfg.mla is not None
    _check_paged_logits(path, _reference(path, "deepseek_v3"), 120, 4)


def test_mla_cache_holds_only_the_latent(ckpt) -> None:
    """Per token and layer the paged cache holds kv_lora_rank + qk_rope_head_dim values
    (no head axis): 40 for the tiny DeepSeek, against 2 * heads * head_dim for GQA."""
    runner = ModelRunner(ckpt("deepseek_v3", "deepseek_v3", num_mtp=1), num_blocks=8,
                         block_size=4)
    layer = runner.kv_cache.layers[0]
    assert layer.shape == (2, 8, 4, 1, 20) and len(runner.kv_cache.layers) == 3


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_disaggregated_equals_offline(ckpt, family) -> None:
    """Prefill -> decode through the real servers (TP 1 -> 1, KV over gloo): the MoE/GQA
    cache and MLA's latent cache travel and decode == the offline engine."""
    import asyncio

    from helpers import run_disaggregated as run_one
    from test_disagg_datapath import greq, make_servers, offline, prompts, shutdown

    path = ckpt(family, family, num_mtp=1)
    p, d = make_servers(path)
    try:
        ps = prompts(2, length=13)
        want = offline(path, ps, 10)

        async def main():
            return await asyncio.gather(*(run_one(p, d, greq(f"r{i}", x, 10))
                                          for i, x in enumerate(ps)))

        assert asyncio.run(main()) == want
    finally:
        shutdown(p, d)


def test_mla_accepted_with_tp_in_cluster_config(ckpt) -> None:
    """MLA under TP in a cluster: the latent is replicated on every rank and re-sharding
    copies it whole (tests/test_mla_transfer.py, tests/test_pd_families.py); a TP size that
    does not divide the heads is still refused."""
    from mtpserve.cluster.config import ClusterConfig

    path = str(ckpt("deepseek_v3", "deepseek_v3", num_mtp=1))
    ClusterConfig(model=path, prefill={"tp_size": 2}, decode={"tp_size": 4})
    with pytest.raises(ValueError, match="decode.tp_size=3 must divide"):
        ClusterConfig(model=path, decode={"tp_size": 3})


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_prefix_cache_and_seeded_sampling(ckpt, family) -> None:
    """Prefix caching on == off (a shared 16-token prefix reused from the cache, MoE and MLA
    latent blocks alike), and seeded sampling gives each request the same tokens alone or in
    a batch."""
    from helpers import make_engine, run_to_completion

    from mtpserve.workers.sampling_params import SamplingParams

    path = ckpt(family, family, num_mtp=1)
    g = torch.Generator().manual_seed(6)
    shared = torch.randint(3, 256, (16,), generator=g).tolist()
    ps = [shared + torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 7, 5)]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = []
    for on in (False, True):
        eng = make_engine(path, 2, block_size=4, num_kv_blocks=128, prefix_caching=on)
        first = run_to_completion(eng, ps[:1], greedy, prefix="a")
        outs.append(first + run_to_completion(eng, ps[1:], greedy, prefix="b"))
        # Both later requests found the shared prefix's blocks but its last (whose MTP
        # entries read the token after the prefix, which differs): 3 blocks of 4 each.
        assert eng.block_manager.cache_hits == (2 * 12 if on else 0)
    assert outs[0] == outs[1]
    sampled = [SamplingParams(max_tokens=8, temperature=0.9, seed=10 + i, ignore_eos=True)
               for i in range(3)]
    eng = make_engine(path, 2, block_size=4, num_kv_blocks=128, prefix_caching=False)
    batch = run_to_completion(eng, ps, sampled, prefix="s")
    alone = [run_to_completion(eng, [p], [sp], prefix=f"x{i}")[0]
             for i, (p, sp) in enumerate(zip(ps, sampled, strict=True))]
    assert batch == alone


def test_fp8_block_checkpoint_equals_its_dequantized_twin(ckpt, tmp_path) -> None:
    """A DeepSeek checkpoint with its projections quantized to FP8 e4m3 in 16x16 blocks
    (`weight_scale_inv`, partial edge blocks included) serves exactly what its dequantized
    twin serves, and the twin == transformers."""
    from safetensors.torch import load_file, save_file

    from mtpserve.workers.model.quantization import dequantize, quantize

    src = ckpt("deepseek_v3", "deepseek_v3", num_mtp=1)
    block = (16, 16)
    tensors = load_file(src / "model.safetensors")
    fp8, twin = dict(tensors), dict(tensors)
    n = 0
    for name, t in tensors.items():
        if name.endswith(("proj.weight", "proj_with_mqa.weight")) and t.dim() == 2:
            q, s = quantize(t, block)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            twin[name] = dequantize(q, s, block)
            n += 1
    assert n > 20 and not torch.equal(twin["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"],
                                      tensors["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"])
    paths = {}
    for kind, sd in (("fp8", fp8), ("twin", twin)):
        paths[kind] = tmp_path / kind
        shutil.copytree(src, paths[kind])
        save_file(sd, paths[kind] / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((paths["fp8"] / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    (paths["fp8"] / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_pretrained(paths["fp8"]).quant is not None
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(8))
    pos = torch.arange(24).unsqueeze(0)
    models = {k: load_model(p) for k, p in paths.items()}
    with torch.no_grad():
        out = {k: m(ids, pos) for k, m in models.items()}
        assert torch.equal(out["fp8"], out["twin"])
        assert torch.equal(models["fp8"].forward_mtp(0, ids, out["fp8"], pos),
                           models["twin"].forward_mtp(0, ids, out["twin"], pos))
        ref = _reference(paths["twin"], "deepseek_v3")(ids).logits
    assert (models["twin"].compute_logits(out["twin"]) - ref).abs().max().item() <= 1e-4


def test_mla_absorbed_decode_equals_expanded(ckpt, monkeypatch) -> None:
    """The absorbed (latent-space) attention used for short queries computes what the
    expanded form does: prefill + decode logits with each form forced."""
    import mtpserve.workers.model.mla as mla

    path = ckpt("deepseek_v3", "deepseek_v3", num_mtp=1)
    tokens = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(9)).tolist()
    outs = []
    for limit in (0, 1 << 20):  # never / always absorbed
        monkeypatch.setattr(mla, "_ABSORB_MAX_QUERY", limit)
        runner = ModelRunner(path, num_blocks=16, block_size=8)
        pre = runner.execute(ForwardBatch("main", [tokens[:26]], [0], [[1, 2, 3, 4]],
                                          list(range(26))))
        steps = [runner.execute(ForwardBatch("main", [[t]], [26 + i], [[1, 2, 3, 4]], [0]))
                 for i, t in enumerate(tokens[26:])]
        outs.append(torch.cat([pre, *steps]))
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-5


def test_mla_under_the_flex_backend_equals_gather(ckpt) -> None:
    """CUDA defaults to the flex backend: MLA layers gather their small latent under it too
    (with their own causal mask) and compute what the gather backend does."""
    path = ckpt("deepseek_v3", "deepseek_v3", num_mtp=1)
    tokens = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    outs = []
    for backend in ("gather", "flex"):
        runner = ModelRunner(path, num_blocks=16, block_size=8, attention_backend=backend)
        pre = runner.execute(ForwardBatch("main", [tokens[:17], tokens[:5]], [0, 0],
                                          [[1, 2, 3], [4, 5]], [16, 17 + 4]))
        step = runner.execute(ForwardBatch("main", [tokens[17:], [7]], [17, 5],
                                           [[1, 2, 3], [4, 5]], [0, 1, 2, 3]))
        outs.append(torch.cat([pre, step]))
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_resume_after_migration_equals_alone(ckpt, family) -> None:
    """A decode replica dies mid-request: another resumes from the sent tokens (prefill of
    prompt + sent, same seed) and continues token-exactly, seeded sampling with drafts."""
    from dataclasses import replace

    from helpers import drain, make_engine, run_to_completion

    from mtpserve.workers.sampling_params import SamplingParams

    path = ckpt(family, family, num_mtp=1)
    prompt = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(max_tokens=14, temperature=0.8, seed=21, ignore_eos=True)
    want = run_to_completion(make_engine(path, 2, block_size=4, num_kv_blocks=64), [prompt],
                             params)[0]
    for cut in (1, 7):
        eng = make_engine(path, 2, block_size=4, num_kv_blocks=64)
        left = replace(params, max_tokens=params.max_tokens - cut)
        req = eng.add_resumed("x", prompt, left, want[:cut])
        emitted = [t for o in drain(eng) for t in o.new_token_ids]
        assert req.output_token_ids == want and emitted == want[cut:], cut
