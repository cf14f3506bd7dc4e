"""What many tests share: one greedy setting, one engine factory, one run-until-done loop.

Tests import it as `from helpers import ...` (conftest puts this folder on sys.path)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

from mtpserve.workers.engine import Engine, EngineConfig, RequestOutput
from mtpserve.workers.messages import GenerateRequest, TokenChunk
from mtpserve.workers.sampling_params import SamplingParams


def greedy(max_tokens: int = 40, **kw) -> SamplingParams:
    """Greedy decoding of exactly `max_tokens` tokens (EOS ignored, so lengths are fixed and
    outputs compare token for token)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


GREEDY = greedy()

# The decode settings of conftest's `compiled_decode`: one sequence, k = 1, a small pool, a
# 128-token window (one block-table bucket: 4 graphs, not 12). Compiling a graph costs 10-50 s
# on 2 shared cores, so the suite compiles this set once and every compiled test with these
# settings loads it from that fixture's cache.
COMPILED_DECODE = dict(num_speculative_tokens=1, num_kv_blocks=48, block_size=4, max_num_seqs=1,
                       max_model_len=128)


def make_engine(model: str | Path, k: int = 2, **kw) -> Engine:
    """An offline engine on `model` with `k` speculative tokens; `kw` are EngineConfig
    fields."""
    return Engine(EngineConfig(model=str(model), num_speculative_tokens=k, **kw))


def drain(eng: Engine, check_blocks: bool = False) -> list[RequestOutput]:
    """Step `eng` until every request finished; the outputs of every step, in order.
    `check_blocks`: check the block manager's integrity after every step."""
    outs: list[RequestOutput] = []
    while eng.has_unfinished():
        outs += eng.step()
        if check_blocks:
            eng.block_manager.check_integrity(eng.scheduler.running + eng.scheduler.prefilling)
    return outs


def run_to_completion(eng: Engine, prompts: Sequence[list[int]],
                      params: SamplingParams | Sequence[SamplingParams] = GREEDY,
                      prefix: str = "r", check_blocks: bool = False) -> list[list[int]]:
    """Submit `prompts` together (ids `{prefix}{i}`; one params for all or one each), step
    until done; each request's output token ids."""
    each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    reqs = [eng.add_request(f"{prefix}{i}", p, sp)
            for i, (p, sp) in enumerate(zip(prompts, each, strict=True))]
    drain(eng, check_blocks)
    return [r.output_token_ids for r in reqs]


def assert_mtp_steps_match_reference(ref, mtp_ref, ours, ids, n: int, tol: float = 1e-4):
    """Our main hidden states and two MTP draft steps (the second reusing module 0, fed the
    last post-norm output and the first draft) equal transformers' model `ref` and its
    `MtpModel` `mtp_ref` on the first `n` tokens of `ids`, within `tol`. Returns the
    reference's first-step draft logits."""
    import torch

    pos = torch.arange(n).unsqueeze(0)
    with torch.no_grad():
        h_ref = ref.model(ids[:, :n]).last_hidden_state
        h = ours(ids[:, :n], pos)
        assert (h - h_ref).abs().max().item() <= tol
        out_ref = mtp_ref.forward_layer(0, h_ref, pos, None, input_ids=ids[:, 1:n + 1])
        out = ours.forward_mtp(0, ids[:, 1:n + 1], h, pos)
        logits = ours.compute_mtp_logits(0, out)
        logits_ref = mtp_ref._project_to_logits(out_ref)
        assert (logits - logits_ref).abs().max().item() <= tol
        d1 = logits[:, -1].argmax(-1, keepdim=True)
        prev_ref = torch.cat([h_ref, out_ref[:, -1:]], dim=1)
        prev = torch.cat([h, out[:, -1:]], dim=1)
        toks = torch.cat([ids[:, 1:n + 1], d1], dim=1)
        pos2 = torch.arange(n + 1).unsqueeze(0)
        step_ref = mtp_ref._project_to_logits(
            mtp_ref.forward_layer(0, prev_ref, pos2, None, input_ids=toks))
        step = ours.compute_mtp_logits(0, ours.forward_mtp(0, toks, prev, pos2))
        assert (step - step_ref).abs().max().item() <= tol
    return logits_ref


def assert_graphs_match_eager(path, vocab: int = 300) -> None:
    """Compiled decode graphs (CPU: one dynamic package per kind) give the eager logits on a
    ragged batch: a prefill, then 1-3 new tokens per row, then an MTP forward over them."""
    import torch

    from mtpserve.workers.model_runner import ForwardBatch, ModelRunner

    runners = [ModelRunner(path, num_blocks=32, block_size=4, decode_graphs=g)
               for g in (False, True)]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 13, 2)]
    tables = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
    outs: list[list[torch.Tensor]] = [[], []]
    for runner, out in zip(runners, outs, strict=True):
        runner.execute(ForwardBatch("main", prompts, [0, 0, 0], tables, [0]))
        news = [[7], [8, 9], [10, 11, 12]]
        starts = [len(p) for p in prompts]
        out.append(runner.execute(ForwardBatch("main", news, starts, tables,
                                               [0, 3, 4, 6, 7, 8])))
        out.append(runner.execute(ForwardBatch(
            "mtp", news, starts, tables, [0, 4, 8], hidden_from="main",
            hidden_rows=[[0], [3, 4], [6, 7, 8]])))
    assert runners[1].graphs is not None and runners[1].graphs.compiled
    for eager, graph in zip(*outs, strict=True):
        assert (eager - graph).abs().max().item() <= 1e-4


def assert_tp2_engine_equals_tp1(path) -> dict:
    """The engine with k = 2 drafts and prefix caching on `path` split over two gloo ranks
    (activations over shared memory; a later prompt extends an earlier one, reusing its two
    full blocks) == one process without prefix caching. Returns the driver's plane counts."""
    import torch.multiprocessing as mp
    from serve_cluster import free_port
    from test_tensor_parallel import PROMPT, _greedy_tokens, _split_rank

    path = str(path)
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
    (seen, (got, hits)), (_, worker_failed) = results["driver"], results["worker"]
    assert got == want
    assert hits == 8  # the third prompt reused PROMPT's first two blocks
    assert not worker_failed
    return seen


def assert_greedy_with_drafts_equals(path, ref, vocab: int, ks=range(4), n: int = 12,
                                     lens=(7, 19)) -> None:
    """`LLM.generate` greedy at each k in `ks` == transformers' `ref` (`hf_greedy`) on random
    prompts of `lens` tokens."""
    import torch

    from mtpserve.workers import LLM, SamplingParams

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]
    want = [hf_greedy(ref, p, n) for p in prompts]
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    for k in ks:
        llm = LLM(str(path), num_speculative_tokens=k, num_kv_blocks=64, block_size=4)
        got = [r.output_token_ids for r in llm.generate(prompts, params)]
        assert got == want, f"k={k}"


def paged_mtp_logits(path, ids, n: int, block_size: int = 4):
    """MTP module 0's draft logits over entries 0..n-1 through the paged cache: a main prefill
    of ids[:n], then the MTP forward over its rows (token t + 1 for entry t)."""
    from mtpserve.workers.model_runner import ForwardBatch, ModelRunner

    runner = ModelRunner(path, num_blocks=16, block_size=block_size)
    table = [list(range(1, 1 + -(-(n + 1) // block_size)))]
    runner.execute(ForwardBatch("main", [ids[0, :n].tolist()], [0], table, [n - 1]))
    return runner.execute(ForwardBatch("mtp", [ids[0, 1:n + 1].tolist()], [0], table,
                                       list(range(n)), hidden_from="main",
                                       hidden_rows=[list(range(n))]))


def hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens of transformers' model `ref` after `prompt`, without its KV cache
    (a full forward per token: the plainest reference)."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


async def run_disaggregated(p, d, req: GenerateRequest,
                            on_chunk: Callable[[str, TokenChunk], None] | None = None) -> list[int]:
    """The orchestrator's flow over a prefill and a decode server: prefill, first token, decode
    stream (every chunk error-free)."""
    first, params = await p.prefill(req)
    tokens = list(first.token_ids)
    if params is None:  # the first token ended it: nothing held
        return tokens
    async for chunk in d.generate(req, params):
        assert chunk.error is None, chunk.error
        tokens += chunk.token_ids
        if on_chunk:
            on_chunk(req.request_id, chunk)
    return tokens


class HandleStream:
    """A server's async generator as a Serve streaming response (what the orchestrator
    iterates and cancels)."""

    def __init__(self, agen) -> None:
        self.agen = agen

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenChunk:
        return await self.agen.__anext__()

    def cancel(self) -> None:
        asyncio.ensure_future(self.agen.aclose())
