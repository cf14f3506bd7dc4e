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

from mtpserve.workers.host_sync import to_host
from mtpserve.workers.model.attention_metadata import stage, stage_lists
from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.spec_decode.keyed_random import (
    MAX_DEPTH,
    SLOT_ACCEPT,
    SLOT_FINAL,
    uniform_table,
)
from mtpserve.workers.spec_decode.sampling import processed_probs, sample_with_uniforms


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
        """The round's result on the host (one copy): `on_device` with host drafts."""
        R, K = target_logits.shape[0], target_logits.shape[1] - 1
        counts = [len(d) for d in draft_token_ids]
        (drafts,) = stage_lists([[t for d in draft_token_ids for t in d + [0] * (K - len(d))]],
                                target_logits.device)
        acc, extra = self.on_device(target_logits, drafts.view(R, K), counts, draft_probs,
                                    params, seeds, positions)
        acc_h, extra_h = to_host([acc, extra], "accepted ids")
        return VerifyResult([d[:a] + [t] for d, a, t in zip(draft_token_ids, acc_h, extra_h,
                                                            strict=True)], acc_h)

    def on_device(
        self,
        target_logits: torch.Tensor,  # [R, K+1, V] float32 at [last, d1..dK]
        drafts: torch.Tensor,  # [R, K] long on the device; row b's first counts[b] are its own
        counts: list[int],  # drafts per row (k_b <= K)
        draft_probs: list[torch.Tensor | None],  # row b: [k_b, V] q (sampled rows), or None
        params: list[SamplingParams],
        seeds: list[int],
        positions: list[int],  # absolute position of the token decided at row s = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted drafts [R], recovered / bonus token [R]), long on the logits' device; the
        host learns them in the caller's one copy. Per-row host inputs reach the device in
        one staged non-blocking copy, so nothing here waits for the device."""
        R, K1 = target_logits.shape[0], target_logits.shape[1]
        K, dev = K1 - 1, target_logits.device
        # Draw slots are SLOT_* + depth: deeper rounds would reuse another slot's uniforms.
        assert K <= MAX_DEPTH, "k above the keyed-RNG slot range"
        g_rows = [b for b in range(R) if params[b].greedy]
        s_rows = [b for b in range(R) if not params[b].greedy]
        if not s_rows:  # the usual all-greedy batch: no scatter
            if all(c == K for c in counts):  # every row drafted K: no mask to stage
                return self._greedy(target_logits, drafts, None)
            (k_rows,) = stage_lists([counts], dev)
            return self._greedy(target_logits, drafts, self._valid(k_rows, K))
        # The sampled rows' uniforms, drawn on the host: the acceptance test of draft d + 1
        # ([S, K], at position pos0 + d) and the final token's draw for every count a of
        # accepted drafts ([S, K + 1], at pos0 + a; the round picks its column on the device
        # once it knows a). They and the per-row counts (small ints, exact in float64) reach
        # the device in one staged copy.
        seeds_s, pos_s = [seeds[b] for b in s_rows], [positions[b] for b in s_rows]
        k_rows, u_acc, u_final = stage(
            [torch.tensor(counts, dtype=torch.float64),
             uniform_table(seeds_s, pos_s, K, SLOT_ACCEPT + 1, 1),
             uniform_table(seeds_s, pos_s, K + 1, SLOT_FINAL)], dev)
        valid = self._valid(k_rows, K)
        if not g_rows:
            return self._sampled(target_logits, drafts, valid, k_rows, counts, draft_probs,
                                 params, u_acc, u_final)
        g_idx, s_idx = stage_lists([g_rows, s_rows], dev)
        acc = torch.empty(R, dtype=torch.long, device=dev)
        extra = torch.empty(R, dtype=torch.long, device=dev)
        a, t = self._greedy(target_logits[g_idx], drafts[g_idx], valid[g_idx])
        acc[g_idx], extra[g_idx] = a, t
        a, t = self._sampled(target_logits[s_idx], drafts[s_idx], valid[s_idx], k_rows[s_idx],
                             [counts[b] for b in s_rows], [draft_probs[b] for b in s_rows],
                             [params[b] for b in s_rows], u_acc, u_final)
        acc[s_idx], extra[s_idx] = a, t
        return acc, extra

    @staticmethod
    def _valid(k_rows: torch.Tensor, K: int) -> torch.Tensor:
        """[R, K]: draft slot i holds a row's own draft (past its k nothing is accepted)."""
        return torch.arange(K, device=k_rows.device).unsqueeze(0) < k_rows.unsqueeze(1)

    @staticmethod
    def _draft_q(draft_probs: list[torch.Tensor | None], counts: list[int], K: int, V: int,
                 dtype, dev) -> torch.Tensor:
        """[S, K, V] q of each row's drafts, zero past its own k. A sampled row's drafts must
        come with the q they were drawn from: a missing q would accept every draft p allows."""
        qs = []
        for x, k_b in zip(draft_probs, counts, strict=True):
            assert k_b == 0 or (x is not None and x.shape[0] == k_b), (
                "sampled drafts without their q")
            qs.append(x if k_b else None)
        if all(x is not None and x.shape[0] == K for x in qs):
            return torch.stack(qs).to(dev, dtype)  # every row drafted K: one copy
        q = torch.zeros(len(qs), K, V, dtype=dtype, device=dev)
        for j, x in enumerate(qs):
            if x is not None:
                q[j, : x.shape[0]] = x.to(dev, dtype)
        return q

    @staticmethod
    def _greedy(logits, drafts, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """valid None: every draft slot holds a draft."""
        K = logits.shape[1] - 1
        target = logits.argmax(dim=-1)  # [G, K+1]
        match = drafts == target[:, :K]
        acc = (match if valid is None else match & valid).long().cumprod(dim=1).sum(dim=1)
        return acc, target.gather(1, acc.unsqueeze(1)).squeeze(1)

    def _sampled(self, logits, drafts, valid, k_rows, counts, draft_probs, params, u_acc,
                 u_final) -> tuple[torch.Tensor, torch.Tensor]:
        S, K1, V = logits.shape
        K, dev = K1 - 1, logits.device
        p = processed_probs(logits.reshape(-1, V),
                            [pp for pp in params for _ in range(K1)]).view(S, K1, V)
        if K == 0:
            return torch.zeros(S, dtype=torch.long, device=dev), sample_with_uniforms(
                p[:, 0], u_final[:, 0])
        rows = torch.arange(S, device=dev)
        q = self._draft_q(draft_probs, counts, K, V, p.dtype, dev)  # [S, K, V]
        safe = drafts.clamp(min=0).unsqueeze(-1)
        p_d = p[:, :K].gather(2, safe).squeeze(-1).double()
        q_d = q.gather(2, safe).squeeze(-1).double()
        ok = (u_acc * q_d < p_d) & valid  # u < p/q, no division by 0
        acc = ok.long().cumprod(dim=1).sum(dim=1)
        # Recovered (first rejection) or bonus (all kept) distribution at row acc.
        p_at = p[rows, acc]  # [S, V]
        # q of the rejected draft; bonus rows (acc == k_b, so every acc == K) use p below.
        resid = (p_at - q[rows, acc.clamp(max=K - 1)]).clamp_(min=0)  # [S, V]
        # A residual of all zeros (p == q) arises with probability 0 of a rejection: fall
        # back to p then.
        use_p = (acc == k_rows) | (resid.sum(dim=-1) <= 0)
        dist = torch.where(use_p.unsqueeze(1), p_at, resid)
        return acc, sample_with_uniforms(dist, u_final[rows, acc])
