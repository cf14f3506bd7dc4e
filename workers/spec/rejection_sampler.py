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

from workers.sampling_params import SamplingParams
from workers.spec.keyed_random import SLOT_ACCEPT, SLOT_FINAL, keyed_uniforms
from workers.spec.sampling import processed_probs, sample_with_uniforms

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

    def _greedy(self, logits, draft_token_ids, rows, out, num_accepted) -> None:
        K = logits.shape[1] - 1
        dev = logits.device
        target = logits[torch.tensor(rows, device=dev)].argmax(dim=-1)  # [G, K+1]
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
        si = torch.tensor(rows, device=dev)
        p = processed_probs(logits[si].reshape(-1, V),
                            [params[b] for b in rows for _ in range(K1)]).view(S, K1, V)
        seed = torch.tensor([seeds[b] for b in rows], dtype=torch.int64, device=dev)  # [S]
        pos0 = torch.tensor([positions[b] for b in rows], dtype=torch.int64, device=dev)  # [S]
        k_rows = torch.tensor([len(draft_token_ids[b]) for b in rows], device=dev)  # [S]
        acc = torch.zeros(S, dtype=torch.long, device=dev)
        q = None
        if K > 0:
            q = torch.zeros(S, K, V, dtype=p.dtype, device=dev)  # q = 0 past a row's k
            for j, b in enumerate(rows):
                if draft_probs[b] is not None and len(draft_token_ids[b]):
                    q[j, : len(draft_token_ids[b])] = draft_probs[b].to(dev, p.dtype)
            drafts = self._drafts(draft_token_ids, rows, K, dev)  # [S, K]
            depth = torch.arange(K, device=dev).unsqueeze(0)  # [1, K], draft i = depth + 1
            u = keyed_uniforms(seed.unsqueeze(1), pos0.unsqueeze(1) + depth,
                               SLOT_ACCEPT + 1 + depth)  # [S, K]
            safe = drafts.clamp(min=0).unsqueeze(-1)
            p_d = p[:, :K].gather(2, safe).squeeze(-1).double()
            q_d = q.gather(2, safe).squeeze(-1).double()
            ok = (u * q_d < p_d) & (depth < k_rows.unsqueeze(1))  # u < p/q, no division by 0
            acc = ok.long().cumprod(dim=1).sum(dim=1)
        # Recovered (first rejection) or bonus (all kept) distribution at row position acc.
        pos = acc.view(-1, 1, 1).expand(-1, 1, V)
        p_at = p.gather(1, pos).squeeze(1)  # [S, V]
        if q is not None:
            q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # q = 0 at the bonus
            resid = (p_at - q_pad.gather(1, pos).squeeze(1)).clamp_(min=0)
            # Bonus rows (acc == k) sample from p itself; a residual of all zeros (p == q)
            # arises with probability 0 of a rejection: fall back to p then.
            use_p = (acc == k_rows) | (resid.sum(dim=-1) <= 0)
            dist = torch.where(use_p.unsqueeze(1), p_at, resid)
        else:
            dist = p_at
        extra = sample_with_uniforms(dist, keyed_uniforms(seed, pos0 + acc, SLOT_FINAL))
        host = torch.stack([acc, extra], dim=1).tolist()  # one transfer
        for (a, t), b in zip(host, rows, strict=True):
            out[b] = draft_token_ids[b][:a] + [t]
            num_accepted[b] = a
