import pytest
from multiprocess import run_workers


@pytest.mark.slow
def test_reshard_across_process_boundaries_is_exact():
    outputs = run_workers("reshard_across_processes.py", num_processes=2, devices_per_process=4)
    assert [out.strip().splitlines()[-1] for out in outputs] == ["process 0 ok", "process 1 ok"]
