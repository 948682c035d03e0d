"""What a verifier tells a frozen-KV drafter of each request (decode/target_kv.py): nothing
unless its KV pool is shared; then the block table and the committed rows (prompt + committed
output but the last token), and nothing while the prompt's K/V is still arriving."""

from __future__ import annotations

from specmesh.decode.request import Request, RequestStatus
from specmesh.decode.target_kv import target_kv_rows
from specmesh.protocol.messages import SamplingParams


def _req(status: RequestStatus) -> Request:
    r = Request(request_id="r", gateway="g", prompt_token_ids=list(range(10)),
                sampling=SamplingParams(max_tokens=8), num_speculative_tokens=3, status=status,
                block_table=[7, 3, 9])
    r.output_token_ids = [11, 12, 13]
    return r


def test_nothing_is_sent_without_a_shared_pool_or_before_the_request_runs():
    assert target_kv_rows(_req(RequestStatus.RUNNING), shared=False) is None
    assert target_kv_rows(_req(RequestStatus.PREFILLING), shared=True) is None


def test_a_running_request_sends_its_committed_rows():
    rows = target_kv_rows(_req(RequestStatus.RUNNING), shared=True)
    assert rows.block_table == [7, 3, 9]
    assert rows.num_rows == 10 + 3 - 1  # the last committed token's K/V is not written yet
