"""Trace files: JSON Lines (optionally gzip'ed), header line, writer, clear errors."""
import gzip
import json

import numpy as np
import pytest

from vllm_gaudi_unified.bucket_plans import TraceError, TraceWriter, append_step, read_trace
from vllm_gaudi_unified.bucket_plans.trace import TraceStep, write_trace
from vllm_gaudi_unified.plan import plan_step

STEPS = [
    TraceStep(16, np.array([5, 1]), np.array([0, 20]), [[3], [7, 9]]),
    TraceStep(16, np.array([1, 1, 40]), np.array([5, 21, 16]), [[3], [7, 9], [11, 12, 13, 14]]),
]


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_round_trip_with_header(tmp_path, name):
    path = str(tmp_path / "sub" / name)
    assert write_trace(path, STEPS, header={"max_num_seqs": 4}) == 2
    tr = read_trace(path)
    assert tr.header == {"max_num_seqs": 4} and len(tr) == 2 and tr.block_size == 16
    for a, b in zip(tr.steps, STEPS):
        assert a.to_json() == b.to_json()


def test_reads_the_recorded_format(tmp_path):
    """The format of the traces recorded from vLLM (bucketing/traces/): no header, one step a line."""
    path = tmp_path / "r.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"block_size": 16, "query_lens": [3], "context_lens": [16], "block_ids": [[4, 5]]}) + "\n")
    step = read_trace(str(path)).steps[0]
    assert step.block_table().tolist() == [[4, 5]]
    plan = plan_step(step.query_lens, step.context_lens, step.block_table(), step.block_size)
    assert plan.shape.query_len == 3


def test_writer_appends_and_cuts_block_rows(tmp_path):
    path = str(tmp_path / "w.jsonl")
    with TraceWriter(path) as w:
        w.append_step([2], [0], np.array([[8, 9, 10]]), 16)  # only 1 block needed: cut
    append_step(path, [1], [2], [[8]], 16)
    tr = read_trace(path)
    assert [s.block_ids for s in tr.steps] == [[[8]], [[8]]]


def test_errors(tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text('{"trace_header": {}}\n')
    with pytest.raises(TraceError, match="no scheduler step"):
        read_trace(str(empty))
    with pytest.raises(TraceError, match="no such trace"):
        read_trace(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"block_size": 16, "query_lens": [3], "context_lens": [16], "block_ids": [[4]]}\n')
    with pytest.raises(TraceError, match="b.jsonl:1: request 0 has 1 block ids for 19 tokens"):
        read_trace(str(bad))
    bad.write_text('{"block_size": 16, "query_lens": [0], "context_lens": [0], "block_ids": [[]]}\n')
    with pytest.raises(TraceError, match="query_lens must be >= 1"):
        read_trace(str(bad))
    bad.write_text('not json\n')
    with pytest.raises(TraceError, match="invalid JSON"):
        read_trace(str(bad))
    mixed = tmp_path / "m.jsonl"
    write_trace(str(mixed), [STEPS[0], TraceStep(32, np.array([1]), np.array([0]), [[1]])])
    with pytest.raises(TraceError, match="different block sizes"):
        read_trace(str(mixed))
