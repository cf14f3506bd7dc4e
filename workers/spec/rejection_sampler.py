"""Verification of a speculative round: accepted drafts plus one recovered or bonus token.

Greedy rows accept the longest prefix where draft == argmax of the target, then emit the
target's argmax at the first mismatch (or after the last draft: the bonus). Sampled rows use
speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023): draft i is kept with
probability min(1, p(d_i) / q(d_i)); at the first rejection a token is drawn from
norm(max(p - q, 0)); if every draft is kept the bonus is drawn from p. The emitted tokens are
then distributed exactly as if sampled from the target one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.sampling_params import SamplingParams
from workers.spec.sampling import draw_uniforms, processed_probs, sample_with_uniforms

PLACEHOLDER_TOKEN_ID = -1


@dataclass
class VerifyResult:
    output_token_ids: torch.Tensor  # [R, K+1], PLACEHOLDER_TOKEN_ID past each row's output
    num_accepted: list[int]  # accepted drafts per row (output length = num_accepted + 1)


class RejectionSampler:
    def __call__(
        self,
        target_logits: torch.Tensor,  # [R, K+1, V] float32 at [last, d1..dK]
        draft_token_ids: torch.Tensor,  # [R, K] (PLACEHOLDER past a row's own k)
        draft_probs: torch.Tensor | None,  # [R, K, V] q of each draft (sampled rows only)
        num_drafts: list[int],  # k of each row
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> VerifyResult:
        R, K1, V = target_logits.shape
        K = K1 - 1
        out = torch.full((R, K1), PLACEHOLDER_TOKEN_ID, dtype=torch.long)
        num_accepted = [0] * R
        greedy = [p.greedy for p in params]
        n_drafts = torch.tensor(num_drafts).unsqueeze(1)  # [R, 1]
        in_range = torch.arange(K).unsqueeze(0) < n_drafts  # [R, K]

        g_rows = [i for i in range(R) if greedy[i]]
        if g_rows:
            gi = torch.tensor(g_rows)
            target = target_logits[gi].argmax(dim=-1)  # [G, K+1]
            match = (draft_token_ids[gi] == target[:, :K]) & in_range[gi]
            acc = match.long().cumprod(dim=1).sum(dim=1)  # [G]
            self._emit(out, gi, draft_token_ids[gi], acc, target.gather(1, acc.unsqueeze(1)))
            for j, r in enumerate(g_rows):
                num_accepted[r] = int(acc[j])

        s_rows = [i for i in range(R) if not greedy[i]]
        if s_rows:
            si = torch.tensor(s_rows)
            sp = [params[i] for i in s_rows]
            p = processed_probs(target_logits[si].reshape(-1, V), [x for x in sp for _ in
                                range(K1)]).view(len(s_rows), K1, V)
            u = draw_uniforms([generators[i] for i in s_rows], K + 1)  # [S, K+1]
            drafts = draft_token_ids[si]  # [S, K]
            acc = torch.zeros(len(s_rows), dtype=torch.long)
            if K > 0:
                assert draft_probs is not None, "sampled rows need draft probabilities"
                q = draft_probs[si]  # [S, K, V]
                safe = drafts.clamp(min=0).unsqueeze(-1)
                p_d = p[:, :K].gather(2, safe).squeeze(-1)
                q_d = q.gather(2, safe).squeeze(-1)
                ok = (u[:, :K] * q_d < p_d) & in_range[si]  # u < p/q without dividing by 0
                acc = ok.long().cumprod(dim=1).sum(dim=1)
            # Recovered (first rejection) or bonus (all kept) distribution at row position acc.
            pos = acc.view(-1, 1, 1).expand(-1, 1, V)
            p_at = p.gather(1, pos).squeeze(1)  # [S, V]
            if K > 0:
                q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # q = 0 at bonus
                q_at = q_pad.gather(1, pos).squeeze(1)
                resid = (p_at - q_at).clamp_(min=0)
                # Bonus rows (acc == k) sample from p itself; a residual of all zeros (p == q)
                # can only arise with probability 0 of a rejection, fall back to p then.
                bonus = acc == torch.tensor([num_drafts[i] for i in s_rows])
                empty = resid.sum(dim=-1) <= 0
                dist = torch.where((bonus | empty).unsqueeze(1), p_at, resid)
            else:
                dist = p_at
            extra = sample_with_uniforms(dist, u[:, K])
            self._emit(out, si, drafts, acc, extra.unsqueeze(1))
            for j, r in enumerate(s_rows):
                num_accepted[r] = int(acc[j])
        return VerifyResult(out, num_accepted)

    @staticmethod
    def _emit(out, rows, drafts, acc, extra) -> None:
        K = drafts.shape[1]
        keep = torch.arange(K).unsqueeze(0) < acc.unsqueeze(1)
        out[rows, :K] = torch.where(keep, drafts, torch.full_like(drafts, PLACEHOLDER_TOKEN_ID))
        out[rows.unsqueeze(1), acc.unsqueeze(1)] = extra
