"""A burst of KV arrivals into one decode replica: the real PrefillServer / DecodeServer in one
process (gloo over loopback, no Ray; helpers from test_disagg_datapath). Sixteen requests are
prefilled and held first, so their transfers reach the decode replica together; it must take
them on several pull lanes at once (`kv_transfer.max_concurrent_pulls`), not one at a time, and
every output must still be the offline engine's. The served version, timed, is
benchmarks/kv_burst_bench.py."""

from __future__ import annotations

import asyncio

import pytest
from test_disagg_datapath import greq, make_servers, offline, prompts, shutdown

BURST = 16


@pytest.mark.parametrize("lanes", [1, 4])
def test_a_burst_of_16_arrivals_is_pulled_concurrently(tiny_qwen3, lanes: int,
                                                       monkeypatch) -> None:
    # Traced (MTPSERVE_TRACE_HOPS=1): each first decode-side chunk carries its arrival hops,
    # in order, and nothing is left noted once the streams end.
    from mtpserve.workers import hop_trace

    monkeypatch.setattr(hop_trace, "ENABLED", True)
    firsts: list[dict] = []
    # Prefill holds all 16 (3 blocks each) until decode pulls; decode runs all 16 at once.
    p, d = make_servers(tiny_qwen3, decode_max_num_seqs=BURST, prefill_blocks=128,
                        kv={"max_concurrent_pulls": lanes})
    try:
        ps = prompts(BURST, length=40, seed=18)
        want = offline(tiny_qwen3, ps, 8)
        reqs = [greq(f"burst{i}", x, 8) for i, x in enumerate(ps)]

        async def decode(req, params) -> list[int]:
            out = [params.first_token_id]
            async for chunk in d.generate(req, params):
                assert chunk.error is None, chunk.error
                if chunk.token_ids and len(out) == 1:
                    firsts.append(chunk.stamps)
                out += chunk.token_ids
            return out

        async def main() -> list[list[int]]:
            held = [params for _, params in await asyncio.gather(*(p.prefill(r)
                                                                     for r in reqs))]
            assert all(x is not None for x in held)  # nothing ended at its first token
            return await asyncio.gather(*(decode(r, x) for r, x in zip(reqs, held,
                                                                       strict=True)))

        assert asyncio.run(main()) == want
        order = (*hop_trace.ARRIVAL_HOPS, "engine", "decode_out")
        assert len(firsts) == BURST
        for st in firsts:
            assert [st[h] for h in order] == sorted(st[h] for h in order), st
        assert not hop_trace._pending
        s = d.driver.core.puller.stats()
        assert s["pulls"] == BURST and s["failures"] == 0
        if lanes == 1:  # the serial puller: the counter sees one pull at a time
            assert s["peak_in_flight"] == 1
        else:  # the burst was admitted together and pulled on several lanes at once
            assert 2 <= s["peak_in_flight"] <= lanes, s
    finally:
        shutdown(p, d)
