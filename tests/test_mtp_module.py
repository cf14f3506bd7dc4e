"""MTP module(s) against a plain-torch reference of the DeepSeek-V3 formula, and the engine's
cached drafts against the same reference recomputed from the whole token history."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.model.loader import load_model
from mtpserve.workers.sampling_params import SamplingParams


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def ref_module(model, m: int, tokens: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """h'_t = Block(eh_proj([enorm(emb(tok_t)); hnorm(prev_t)])) -> shared norm, [1, S, H].

    The decoder block is the one `test_model_parity` checks against transformers; the
    formula around it is spelled out here."""
    mod = model.mtp[m]
    table = mod.embed_tokens if mod.embed_tokens is not None else model.model.embed_tokens
    emb = F.embedding(tokens, table.weight)
    x = torch.cat([rms(emb, mod.enorm.weight), rms(prev, mod.hnorm.weight)], dim=-1)
    x = x @ mod.eh_proj.weight.T
    pos = torch.arange(tokens.shape[1]).unsqueeze(0)
    x = mod.block(x, model.rotary.cos_sin(pos), None, None)
    return rms(x, mod.norm.weight)


@pytest.mark.parametrize("num_mtp", [1, 2])
def test_training_forward_matches_formula(tiny_factory, num_mtp: int) -> None:
    model = load_model(tiny_factory("qwen3", num_mtp=num_mtp))
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (1, 20), generator=g)
    S = 20 - 1 - num_mtp
    with torch.no_grad():
        h = model(w[:, :S], torch.arange(S).unsqueeze(0))
        prev_ours = prev_ref = h
        for m in range(num_mtp):
            toks = w[:, 1 + m : S + 1 + m]
            ours = model.forward_mtp(m, toks, prev_ours, torch.arange(S).unsqueeze(0))
            ref = ref_module(model, m, toks, prev_ref)
            assert (ours - ref).abs().max() < 1e-5, f"module {m}"
            assert torch.equal(
                model.compute_mtp_logits(m, ours), (ours @ model.lm_head.weight.T).float()
            )
            prev_ours, prev_ref = ours, ref


def ref_drafts(model, tokens: list[int], n_computed: int, k: int, num_mtp: int
               ) -> tuple[list[int], list[int]]:
    """Drafts the engine must propose given the committed token history.

    tokens = all tokens (last one not yet in the main KV), n_computed = len(tokens) - 1.
    Reused module: entries n..n+k-2 continue module 0's sequence. Depth modules: module m
    forms its own sequence of this chain's entries only (only drafting writes it): one entry
    (the previous module's last output, the previous draft) at its depth, one more per step
    it is reused past the module count. Draft s comes from module min(s - 1, N - 1)'s head.
    Returns the drafts and the module of each."""
    t = torch.tensor([tokens])
    n = n_computed
    with torch.no_grad():
        h = model(t[:, :n], torch.arange(n).unsqueeze(0))
        out = ref_module(model, 0, t[:, 1 : n + 1], h)
        d = [int(model.compute_mtp_logits(0, out[:, -1]).argmax())]
        modules = [0]
        # module -> (its prev-hidden sequence, its token sequence)
        seqs = {0: (h, t[:, 1 : n + 1])}
        last = out[:, -1:]
        for step in range(2, k + 1):
            m = min(step - 1, num_mtp - 1)
            prev_seq, tok_seq = seqs.get(m, (last[:, :0], t[:, :0]))
            prev_seq = torch.cat([prev_seq, last], dim=1)
            tok_seq = torch.cat([tok_seq, torch.tensor([[d[-1]]])], dim=1)
            seqs[m] = (prev_seq, tok_seq)
            out = ref_module(model, m, tok_seq, prev_seq)
            last = out[:, -1:]
            d.append(int(model.compute_mtp_logits(m, last[:, 0]).argmax()))
            modules.append(m)
    return d, modules


def test_engine_drafts_equal_reference_every_round(tiny_qwen3) -> None:
    """The MTP KV cache (filled in chunked prefill, caught up after every round, rolled back
    past rejections) gives the same drafts as recomputing from the full history."""
    k = 3
    eng = Engine(
        EngineConfig(
            model=str(tiny_qwen3),
            num_speculative_tokens=k,
            num_kv_blocks=64,
            block_size=4,
            max_num_batched_tokens=8,
        )
    )
    model = eng.runner.model
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 256, (19,), generator=g).tolist()
    req = eng.add_request(
        "r", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    )
    checked = 0
    while eng.has_unfinished():
        eng.step()
        if req.draft_token_ids and not req.finished:
            want, _ = ref_drafts(
                model, req.all_token_ids, req.num_computed_tokens, len(req.draft_token_ids), 1
            )
            assert req.draft_token_ids == want, f"after {req.num_output_tokens} tokens"
            checked += 1
    assert checked >= 5


# Several MTP modules, each its own (issue 44): draft s uses module min(s - 1, N - 1).
N_MODULES = 3


@pytest.fixture(scope="module")
def multi_module(tiny_factory, tmp_path_factory):
    """Checkpoints with N = 3 MTP modules: a tiny qwen3 (modules share the main embedding and
    head) and a DeepSeek-V3 one in its own layout (MTP layers at indices L..L+2, each with its
    own embedding and shared_head, different from the main model's and from each other)."""
    from tiny_models import make_hf_checkpoint

    ds = make_hf_checkpoint(tmp_path_factory.mktemp("ckpt") / "ds3", "deepseek_v3",
                            num_mtp=N_MODULES, distinct_mtp_heads=True)
    return {"qwen3": tiny_factory("qwen3", num_mtp=N_MODULES), "deepseek_v3": ds}


def _engine(path, k: int, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), num_speculative_tokens=k, num_kv_blocks=96,
                               block_size=4, max_num_batched_tokens=16, **kw))


def test_deepseek_layout_with_three_mtp_layers_loads(multi_module) -> None:
    from mtpserve.workers.model.checkpoint import inventory

    path = multi_module["deepseek_v3"]
    entries = inventory(path)
    assert not [e for e in entries if e.is_problem]
    for m in range(N_MODULES):  # every module's own tensors, under model.layers.{L + m}
        names = {e.tensor for e in entries if e.tensor.startswith(f"model.layers.{2 + m}.")}
        assert {f"model.layers.{2 + m}.{n}.weight" for n in (
            "enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head",
            "embed_tokens")} <= names
    model = load_model(path)
    assert len(model.mtp) == N_MODULES and model.config.num_attention_layers == 2 + N_MODULES
    heads = [mod.head.weight for mod in model.mtp]
    assert all(h is not None for h in heads)
    assert not torch.equal(heads[0], heads[1]) and not torch.equal(heads[0],
                                                                  model.lm_head.weight)


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_multi_module_greedy_equals_plain(multi_module, family: str) -> None:
    """N = 3: greedy with k = 0..4 (k < N uses the first k modules, k > N reuses the last)
    == plain decoding, two requests batched; each request's per-position counts have k
    entries, every position drafted every round."""
    from helpers import run_to_completion

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (13, 22)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = run_to_completion(_engine(multi_module[family], 0), prompts, params)
    for k in range(1, 5):
        eng = _engine(multi_module[family], k)
        reqs = [eng.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
        while eng.has_unfinished():
            eng.step()
        assert [r.output_token_ids for r in reqs] == want, f"k={k}"
        for r in reqs:
            assert len(r.drafted_per_position) == len(r.accepted_per_position) == k
            assert r.drafted_per_position[k - 1] > 0
        stats = eng.stats()
        assert len(stats["drafted_per_position"]) == k
        assert stats["mtp_module_per_position"] == [min(m, N_MODULES - 1) for m in range(k)]
        assert sum(stats["drafted_per_position"]) == stats["total_drafted"]
        assert sum(stats["accepted_per_position"]) == stats["total_accepted"]


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
@pytest.mark.parametrize("k", [2, 4])
def test_draft_step_m_comes_from_module_m(multi_module, family: str, k: int) -> None:
    """Every round, draft s of the engine == the reference that calls module min(s-1, N-1)
    directly (its own block, KV and head) on the previous step's output, and the engine's
    MTP forwards ran exactly those modules."""
    eng = _engine(multi_module[family], k)
    model = eng.runner.model
    ran: list[int] = []
    execute = eng.proposer.execute

    def recording(batch, execute=execute):
        ran.append(batch.module)
        return execute(batch)

    eng.proposer.execute = recording
    prompt = torch.randint(3, 256, (19,), generator=torch.Generator().manual_seed(3)).tolist()
    req = eng.add_request("r", prompt, SamplingParams(max_tokens=20, temperature=0,
                                                      ignore_eos=True))
    checked, longest = 0, []
    while eng.has_unfinished():
        ran.clear()
        eng.step()
        if req.draft_token_ids and not req.finished:
            want, modules = ref_drafts(model, req.all_token_ids, req.num_computed_tokens,
                                       len(req.draft_token_ids), N_MODULES)
            assert req.draft_token_ids == want, f"after {req.num_output_tokens} tokens"
            assert ran[-len(modules):] == modules
            longest = max(longest, modules, key=len)
            checked += 1
    assert checked >= 4
    assert longest == [min(s, N_MODULES - 1) for s in range(k)]


def test_depth_module_drafts_do_not_depend_on_a_prefix_sharing_neighbour(multi_module) -> None:
    """Depth modules write their chain entries in the request's own tail blocks: a request
    sharing prefix-cached blocks with another running one drafts exactly as it does alone
    (at block 0 the two wrote the same slots in the same forward)."""
    g = torch.Generator().manual_seed(1)
    common = torch.randint(3, 256, (12,), generator=g).tolist()
    a = common + torch.randint(3, 256, (5,), generator=g).tolist()
    b = common + torch.randint(3, 256, (7,), generator=g).tolist()
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def drafts(with_b: bool) -> dict[int, list[int]]:
        eng = _engine(multi_module["qwen3"], 5, prefix_caching=True)
        req = eng.add_request("a", a, params)
        for _ in range(3):  # a's prompt blocks are cached before b arrives
            eng.step()
        if with_b:
            other = eng.add_request("b", b, params)
        out = {}
        while eng.has_unfinished():
            eng.step()
            if with_b and other.block_ids and req.block_ids:
                assert other.block_ids[0] == req.block_ids[0]  # they do share
            if req.draft_token_ids and not req.finished:
                out[req.num_computed_tokens] = list(req.draft_token_ids)
        return out

    alone, shared = drafts(False), drafts(True)
    assert len(alone) >= 5 and shared == alone
