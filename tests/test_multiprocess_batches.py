from multiprocess import run_workers


def test_host_local_slices_become_one_global_batch():
    outputs = run_workers("host_local_batch.py", num_processes=2, devices_per_process=4)
    last_lines = [out.strip().splitlines()[-1] for out in outputs]
    assert last_lines == [f"process {i} ok {2.0 * sum(range(96))}" for i in range(2)]
