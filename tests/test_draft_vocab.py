"""A draft vocabulary (the MTP head over the most frequent tokens only) changes what gets
drafted, never what gets emitted: greedy output equals plain decoding, sampled output keeps the
target distribution at every position (q is the subset's softmax, and that q is what
rejection sampling uses), drafts come from the subset, and bad settings fail clearly."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import GREEDY, drain, make_engine
from test_sampling_distribution import NUM_POS, assert_matches, exact_marginals, sample_many

from mtpserve.workers.model_runner import ModelRunner
from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.spec_decode.draft_vocab import (
    DraftVocabError,
    draft_token_ids,
    rank_tokens,
    write_ranking,
)
from mtpserve.workers.spec_decode.sampling import processed_probs


def test_ranking_is_by_frequency_then_id(tmp_path) -> None:
    ranking = rank_tokens([[5, 5, 3, 7], [3, 5, 1]], vocab_size=8)
    assert ranking[:4] == [5, 3, 1, 7]  # 5 x3, 3 x2, then ties by id
    assert sorted(ranking) == list(range(8))
    write_ranking(tmp_path, ranking, "test")
    assert draft_token_ids(tmp_path, 2, 8) == [3, 5]
    # EOS (id 0, never seen) replaces the least frequent of the top tokens.
    assert draft_token_ids(tmp_path, 3, 8, always=[0]) == [0, 3, 5]


def test_bad_settings_fail_clearly(tmp_path) -> None:
    with pytest.raises(DraftVocabError, match="mtpserve draft-vocab"):
        draft_token_ids(tmp_path, 4, 8)  # no ranking file yet
    write_ranking(tmp_path, [0, 1, 2], "test")
    with pytest.raises(DraftVocabError, match="every token id"):
        draft_token_ids(tmp_path, 2, 8)
    write_ranking(tmp_path, list(range(8)), "test")
    for size in (0, 9):
        with pytest.raises(DraftVocabError, match="draft_vocab_size"):
            draft_token_ids(tmp_path, size, 8)


def test_drafts_come_from_the_subset(tiny_qwen3, tmp_path) -> None:
    path = tmp_path / "m"
    shutil.copytree(tiny_qwen3, path)
    vocab = ModelRunner(path, num_blocks=4, block_size=4).config.vocab_size
    write_ranking(path, list(range(vocab))[::-1], "test")  # the highest ids "most frequent"
    runner = ModelRunner(path, num_blocks=4, block_size=4, draft_vocab_size=16)
    subset = set(draft_token_ids(path, 16, vocab, runner.config.eos_token_ids))
    logits = runner.model.compute_mtp_logits(0, torch.randn(64, runner.config.hidden_size))
    assert set(logits.argmax(-1).tolist()) <= subset
    q = processed_probs(logits, [SamplingParams(temperature=1.0)] * 64)
    outside = torch.tensor(sorted(set(range(vocab)) - subset))
    assert q[:, outside].sum() == 0
    assert torch.allclose(q.sum(-1), torch.ones(64))


def test_greedy_output_is_unchanged(default_model) -> None:
    """The embedded model ships its ranking; with a draft vocabulary of a quarter of the
    tokens, greedy output equals plain decoding and drafts are still accepted."""
    if not (default_model / "draft_vocab.json").is_file():
        pytest.skip("a random tiny model has no ranking (the embedded one ships it)")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4000, (12 + 7 * i,), generator=g).tolist() for i in range(3)]
    outs = {}
    for name, k, dv in (("plain", 0, None), ("dv1024", 3, 1024)):
        eng = make_engine(default_model, k, num_kv_blocks=128, draft_vocab_size=dv)
        reqs = [eng.add_request(str(i), p, GREEDY) for i, p in enumerate(prompts)]
        drain(eng)
        outs[name] = [r.output_token_ids for r in reqs]
        if k:
            assert sum(r.num_accepted for r in reqs) > 0
    assert outs["dv1024"] == outs["plain"]


@pytest.mark.parametrize("params,banned", [
    (SamplingParams(temperature=1.0, ignore_eos=True), ()),
    # min_tokens bans tokens 2 and 3 = the whole draft vocabulary: q falls back to the
    # other tokens (finite logits outside the subset), and the output stays exact.
    (SamplingParams(temperature=0.7, min_tokens=NUM_POS, stop_token_ids=(3,)), (2, 3)),
], ids=["T1.0", "subset-banned"])
def test_sampled_output_keeps_the_target_distribution(tiny_factory, tmp_path, params,
                                                      banned) -> None:
    path = tmp_path / "m"
    shutil.copytree(tiny_factory(vocab_size=6, seed=5), path)
    write_ranking(path, [3, 2, 5, 1, 4, 0], "test")
    eos = ModelRunner(path, num_blocks=4, block_size=4).config.eos_token_ids
    assert eos == (2,) and draft_token_ids(path, 2, 6, eos) == [2, 3]
    n = 2400
    exact = exact_marginals(path, params, NUM_POS, banned)
    reqs = sample_many(path, params, n, seed0=20_000, draft_vocab_size=2)
    assert sum(r.num_accepted for r in reqs) > 100  # drafts from the subset get accepted
    assert_matches(reqs, exact)


def test_cluster_config_names_the_missing_ranking(tiny_qwen3) -> None:
    from mtpserve.cluster.config import ClusterConfig

    with pytest.raises(ValueError, match="mtpserve draft-vocab"):
        ClusterConfig(model=str(tiny_qwen3), speculation={"draft_vocab_size": 64})


def test_cli_ranks_a_corpus(tmp_path) -> None:
    import json

    from tiny_tokenizer import make_checkpoint_with_tokenizer

    from mtpserve.cluster.cli import main
    from mtpserve.workers.tokenizer import load_tokenizer

    model = make_checkpoint_with_tokenizer(tmp_path / "m")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def f(x):\n    return x\n" * 50)
    (corpus / "b.txt").write_text("zzzz " * 500)  # not matched by --glob
    assert main(["draft-vocab", "--model", str(model), "--corpus", str(corpus),
                 "--glob", "*.py"]) == 0
    ranking = json.loads((model / "draft_vocab.json").read_text())["token_ids"]
    top = set(ranking[:4])
    ids = load_tokenizer(str(model))("def f(x):\n    return x\n")["input_ids"]
    assert top <= set(ids)  # the most frequent tokens are the corpus's
    assert main(["draft-vocab", "--model", str(model), "--corpus", str(corpus),
                 "--glob", "*.md"]) == 2
