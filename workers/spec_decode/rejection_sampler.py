"""Verification of a speculative round: accepted drafts plus one recovered or bonus token.

Greedy rows accept the longest prefix where draft == argmax of the target, then emit the
target's argmax at the first mismatch (or after the last draft: the bonus). Sampled rows use
speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023): draft i is kept with
probability min(1, p(d_i) / q(d_i)); at the first rejection a token is drawn from
norm(max(p - q, 0)); if every draft is kept the bonus is drawn from p. The emitted tokens are
then distributed exactly as if sampled from the target one at a time.

Every uniform is keyed by (request seed, position of the token it decides, slot), so a row's
result does not depend on the batch's largest k or on any other row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.spec_decode.keyed_random import (
    MAX_DEPTH,
    SLOT_ACCEPT,
    SLOT_FINAL,
    keyed_uniforms,
)
from mtpserve.workers.spec_decode.sampling import processed_probs, sample_with_uniforms

PLACEHOLDER_TOKEN_ID = -1


@dataclass
class VerifyResult:
    output_token_ids: list[list[int]]  # per row: accepted drafts + recovered/bonus token
    num_accepted: list[int]  # accepted drafts per row (output length = num_accepted + 1)


class RejectionSampler:
    def __call__(
        self,
        target_logits: torch.Tensor,  # [R, K+1, V] float32 at [last, d1..dK]
        draft_token_ids: list[list[int]],  # row b: its own k_b drafts
        draft_probs: list[torch.Tensor | None],  # row b: [k_b, V] q (sampled rows), or None
        params: list[SamplingParams],
        seeds: list[int],
        positions: list[int],  # absolute position of the token decided at row s = 0
    ) -> VerifyResult:
        R = target_logits.shape[0]
        # Draw slots are SLOT_* + depth: deeper rounds would reuse another slot's uniforms.
        assert target_logits.shape[1] - 1 <= MAX_DEPTH, "k above the keyed-RNG slot range"
        out: list[list[int]] = [[] for _ in range(R)]
        num_accepted = [0] * R
        g_rows = [b for b in range(R) if params[b].greedy]
        s_rows = [b for b in range(R) if not params[b].greedy]
        if g_rows:
            self._greedy(target_logits, draft_token_ids, g_rows, out, num_accepted)
        if s_rows:
            self._sampled(target_logits, draft_token_ids, draft_probs, params, seeds, positions,
                          s_rows, out, num_accepted)
        return VerifyResult(out, num_accepted)

    @staticmethod
    def _drafts(draft_token_ids: list[list[int]], rows: list[int], K: int, dev) -> torch.Tensor:
        """[len(rows), K] drafts, PLACEHOLDER past each row's own k."""
        return torch.tensor(
            [draft_token_ids[b] + [PLACEHOLDER_TOKEN_ID] * (K - len(draft_token_ids[b]))
             for b in rows], dtype=torch.long, device=dev).view(len(rows), K)

    @staticmethod
    def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """logits[rows] ([len(rows), K+1, V]) without copying when `rows` is every row (the
        usual all-greedy or all-sampled batch: the copy would be R * (K+1) * V floats)."""
        if rows == list(range(logits.shape[0])):
            return logits
        return logits[torch.tensor(rows, device=logits.device)]

    @staticmethod
    def _draft_q(draft_token_ids, draft_probs, rows: list[int], K: int, V: int, dtype, dev
                 ) -> torch.Tensor:
        """[S, K, V] q of each row's drafts, zero past its own k. A sampled row's drafts must
        come with the q they were drawn from: a missing q would accept every draft p allows."""
        qs = []
        for b in rows:
            k_b = len(draft_token_ids[b])
            assert k_b == 0 or (draft_probs[b] is not None and draft_probs[b].shape[0] == k_b), (
                "sampled drafts without their q")
            qs.append(draft_probs[b] if k_b else None)
        if all(x is not None and x.shape[0] == K for x in qs):
            return torch.stack(qs).to(dev, dtype)  # every row drafted K: one copy
        q = torch.zeros(len(rows), K, V, dtype=dtype, device=dev)
        for j, x in enumerate(qs):
            if x is not None:
                q[j, : x.shape[0]] = x.to(dev, dtype)
        return q

    def _greedy(self, logits, draft_token_ids, rows, out, num_accepted) -> None:
        K = logits.shape[1] - 1
        dev = logits.device
        target = self._rows(logits, rows).argmax(dim=-1)  # [G, K+1]
        drafts = self._drafts(draft_token_ids, rows, K, dev)  # [G, K]
        acc = (drafts == target[:, :K]).long().cumprod(dim=1).sum(dim=1)  # [G]
        extra = target.gather(1, acc.unsqueeze(1))  # [G, 1]
        host = torch.cat([acc.unsqueeze(1), extra], dim=1).tolist()  # one transfer
        for (a, t), b in zip(host, rows, strict=True):
            out[b] = draft_token_ids[b][:a] + [t]
            num_accepted[b] = a

    def _sampled(self, logits, draft_token_ids, draft_probs, params, seeds, positions, rows,
                 out, num_accepted) -> None:
        S, K1, V = len(rows), logits.shape[1], logits.shape[2]
        K, dev = K1 - 1, logits.device
        p = processed_probs(self._rows(logits, rows).reshape(-1, V),
                            [params[b] for b in rows for _ in range(K1)]).view(S, K1, V)
        seed = torch.tensor([seeds[b] for b in rows], dtype=torch.int64, device=dev)  # [S]
        pos0 = torch.tensor([positions[b] for b in rows], dtype=torch.int64, device=dev)  # [S]
        k_rows = torch.tensor([len(draft_token_ids[b]) for b in rows], device=dev)  # [S]
        acc = torch.zeros(S, dtype=torch.long, device=dev)
        if K > 0:
            q = self._draft_q(draft_token_ids, draft_probs, rows, K, V, p.dtype, dev)  # [S,K,V]
            drafts = self._drafts(draft_token_ids, rows, K, dev)  # [S, K]
            depth = torch.arange(K, device=dev).unsqueeze(0)  # [1, K], draft i = depth + 1
            u = keyed_uniforms(seed.unsqueeze(1), pos0.unsqueeze(1) + depth,
                               SLOT_ACCEPT + 1 + depth)  # [S, K]
            safe = drafts.clamp(min=0).unsqueeze(-1)
            p_d = p[:, :K].gather(2, safe).squeeze(-1).double()
            q_d = q.gather(2, safe).squeeze(-1).double()
            ok = (u * q_d < p_d) & (depth < k_rows.unsqueeze(1))  # u < p/q, no division by 0
            acc = ok.long().cumprod(dim=1).sum(dim=1)
            # Recovered (first rejection) or bonus (all kept) distribution at row acc.
            p_at = p.gather(1, acc.view(-1, 1, 1).expand(-1, 1, V)).squeeze(1)  # [S, V]
            # q of the rejected draft; bonus rows (acc == k_b, so every acc == K) use p below.
            q_pos = acc.clamp(max=K - 1).view(-1, 1, 1).expand(-1, 1, V)
            resid = (p_at - q.gather(1, q_pos).squeeze(1)).clamp_(min=0)  # [S, V]
            # A residual of all zeros (p == q) arises with probability 0 of a rejection:
            # fall back to p then.
            use_p = (acc == k_rows) | (resid.sum(dim=-1) <= 0)
            dist = torch.where(use_p.unsqueeze(1), p_at, resid)
        else:
            dist = p[:, 0]
        extra = sample_with_uniforms(dist, keyed_uniforms(seed, pos0 + acc, SLOT_FINAL))
        host = torch.stack([acc, extra], dim=1).tolist()  # one transfer
        for (a, t), b in zip(host, rows, strict=True):
            out[b] = draft_token_ids[b][:a] + [t]
            num_accepted[b] = a
