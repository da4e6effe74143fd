"""ThroughputMonitor on 2 gloo processes (DDP, and FSDP2 with the FLOPs counted on the first
batch): samples/s is this rank's times the world size, items/s the sum over the ranks
(``scripts/throughput.py``, a fake one-second-per-batch clock)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dist_helpers import SCRIPTS, explain, run


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_global_samples_are_local_times_world_and_items_are_summed_over_ranks(tmp_path: Path, strategy: str) -> None:
    out = tmp_path / "values"
    args = [str(SCRIPTS / "throughput.py"), "--out", str(out), "--devices", "2", "--strategy", strategy]
    count = strategy == "fsdp"  # FSDP2: count the FLOPs on the first batch (DTensor shards gathered)
    proc = run(args + (["--count"] if count else []), timeout=110)
    assert proc.returncode == 0, explain(proc)
    written = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]
    # Linear(3, 1) on 4 samples: forward 2 x 3 x 4, the weight's gradient as much (the input needs none).
    flops = 4 * 3 * 4 if count else 1e6
    assert [w["flops"] for w in written] == [flops, flops]
    ranks = [w["rows"] for w in written]
    # 40 samples / 2 ranks / batches of 4: 5 batches per rank. Batch 0 starts the clock; the
    # window to step 2 holds batch 1 (1 s), the one to step 4 batches 2 and 3 (2 s).
    # Rank r's items per batch: (r + 1) * (batch_idx + 1).
    batches = {"2": [1], "4": [2, 3]}
    for rank, rows in enumerate(ranks):
        assert sorted(rows) == ["2", "4"]
        for step, idx in batches.items():
            row, seconds = rows[step], len(idx)
            assert row["throughput/samples_per_sec_per_device"] == 4 * len(idx) / seconds
            assert row["throughput/samples_per_sec"] == 2 * 4 * len(idx) / seconds
            local = sum((rank + 1) * (i + 1) for i in idx)
            both = sum((r + 1) * (i + 1) for r in (0, 1) for i in idx)
            assert row["throughput/items_per_sec_per_device"] == local / seconds
            assert row["throughput/items_per_sec"] == both / seconds
            assert row["throughput/tflops_per_device"] == pytest.approx(flops * len(idx) / seconds / 1e12, rel=1e-12)
