"""Launches whose processes must form one group: refused when they do not, trained together across machines when
they do. Real `accelerate launch` runs on CPU, as in tests/test_distributed.py."""

import json
import re
from types import SimpleNamespace

import psutil
import pytest
from accelerate.utils import DistributedType

from tvopd_trl.checks import check_process_group
from tvopd_trl.testing import free_port

from .test_distributed import (
    ACCELERATE_CONFIGS,
    GLOO_EXIT_ABORT,
    NUM_PROCESSES,
    POOLED,
    REPO,
    SCRIPTS,
    start_launch,
    wait_launch,
)
from .timeouts import time_limit


def start(launch_args, *target):
    """`accelerate launch` on ddp_cpu.yaml."""
    return start_launch(["--config_file", str(ACCELERATE_CONFIGS / "ddp_cpu.yaml"), *launch_args, *target], cwd=REPO)


def wait(process, timeout=300):
    """(exit code, stdout, stderr) of a launcher from `start`."""
    stdout, stderr = wait_launch(process, "the launch", timeout)
    return process.returncode, stdout, stderr


@pytest.mark.compat_skip
def test_processes_that_do_not_form_one_group_stop_at_construction_with_one_line(tmp_path):
    # They used to train apart and, in the main job, fail at the first evaluation, whose gather held only the
    # process's own shard: "The generator's shards must hold every response exactly once".
    # The launcher looks at the ranks every 2 s (not 0.1), so that it sees both exit, each with its own status.
    launch_args = ["--main_process_port", str(free_port()), "--monitor_interval", "2"]
    code, stdout, stderr = wait(start(launch_args, str(SCRIPTS / "no_group.py"), str(tmp_path)))
    log = f"exit code {code}\n{stdout[-2000:]}\n{stderr[-6000:]}"
    line = (
        "This process is one of 2 that the launcher started, but accelerate does not run them as one group "
        "(distributed type NO, 2 process(es)): each would train its own unsynchronised copy. Without a GPU, ask for "
        "the CPU: `--use_cpu` (or `use_cpu: true` in the recipe) with recipes/accelerate_configs/ddp_cpu.yaml; "
        "`--ddp_backend gloo` alone is for DeepSpeed (zero3_cpu.yaml)."
    )
    for rank in range(NUM_PROCESSES):
        result = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert result == {"rank": rank, "distributed_type": "NO", "world_size": 2, "error": line}, log
    # torchrun's summary of the failed ranks: each exited with the error's status, none was ended by the launcher
    failures = re.findall(r"rank\s*: (\d+) \(local_rank: \d+\)\s+exitcode\s*: (-?\d+)", stderr)
    assert code != 0 and sorted(failures) == [(str(rank), "2") for rank in range(NUM_PROCESSES)], log


@pytest.mark.compat_skip
def test_a_launch_past_its_time_is_ended_with_every_rank(tmp_path):
    # torch's elastic agent starts each rank in a session of its own: killing the launcher's left them running, and
    # holding its pipes, so that the test hung instead of failing
    script = tmp_path / "hang.py"
    script.write_text(
        "import os, sys, time\nopen(sys.argv[1] + f'/{os.getpid()}.pid', 'w').close()\ntime.sleep(600)\n"
    )
    process = start([], str(script), str(tmp_path))
    with pytest.raises(pytest.fail.Exception, match=f"did not finish within {time_limit(30):g} s") as failed:
        wait(process, timeout=30)
    assert "The machine may be slow or busy: TVOPD_TEST_TIMEOUT_SCALE multiplies every time limit" in str(failed.value)
    ranks = [int(path.stem) for path in tmp_path.glob("*.pid")]
    assert len(ranks) == NUM_PROCESSES
    assert not [pid for pid in ranks if psutil.pid_exists(pid)]


@pytest.mark.parametrize(
    "variable, launched, distributed_type, processes, refused",
    [
        (None, None, DistributedType.NO, 1, False),  # not launched: one process on its own
        ("WORLD_SIZE", "1", DistributedType.NO, 1, False),
        ("WORLD_SIZE", "2", DistributedType.MULTI_CPU, 2, False),
        ("WORLD_SIZE", "2", DistributedType.DEEPSPEED, 2, False),
        ("WORLD_SIZE", "2", DistributedType.NO, 2, True),  # the launch above
        ("WORLD_SIZE", "2", DistributedType.NO, 1, True),
        ("WORLD_SIZE", "4", DistributedType.MULTI_CPU, 2, True),
        ("OMPI_COMM_WORLD_SIZE", "2", DistributedType.NO, 1, True),  # mpirun
    ],
)
def test_check_process_group_compares_the_launch_with_accelerates_group(
    variable, launched, distributed_type, processes, refused, monkeypatch
):
    for name in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    if variable is not None:
        monkeypatch.setenv(variable, launched)
    accelerator = SimpleNamespace(distributed_type=distributed_type, num_processes=processes)
    if refused:
        with pytest.raises(ValueError, match=f"one of {launched} that the launcher started.*`--use_cpu`"):
            check_process_group(accelerator)
    else:
        check_process_group(accelerator)


@pytest.mark.compat_skip
def test_one_process_on_each_of_two_machines_on_loopback_trains_as_one_group(tmp_path):
    machines = ["--num_machines", "2", "--rdzv_backend", "static", "--main_process_ip", "127.0.0.1"]
    machines += ["--main_process_port", str(free_port())]
    launchers = [
        start([*machines, "--machine_rank", str(rank)], str(SCRIPTS / "two_machines.py"), str(tmp_path))
        for rank in range(2)
    ]
    ends = [wait(launcher) for launcher in launchers]
    log = "\n".join(
        f"machine {n}: exit code {code}\n{out[-2000:]}\n{err[-4000:]}" for n, (code, out, err) in enumerate(ends)
    )
    done = [(tmp_path / f"rank-{rank}.done").exists() for rank in range(NUM_PROCESSES)]
    assert all(done), f"ranks done: {done}\n{log}"
    # Every rank finished its work; a non-zero exit code is then only acceptable as gloo's known exit abort.
    assert all(code == 0 or GLOO_EXIT_ABORT in err for code, _, err in ends), log
    first, second = (json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(NUM_PROCESSES))
    assert [first["machine_rank"], second["machine_rank"]] == [0, 1]
    assert first["num_processes"] == second["num_processes"] == 2
    assert first["rank_sum"] == second["rank_sum"] == 3.0  # 1 + 2, summed over both machines
    assert [entry["step"] for entry in first["logs"]] == [1, 2]
    for a, b in zip(first["logs"], second["logs"], strict=True):
        assert [a[name] for name in POOLED] == [b[name] for name in POOLED], a["step"]
