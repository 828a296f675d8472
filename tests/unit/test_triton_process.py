"""The launcher's start-up retry (no process is started: launch and readiness are faked)."""

import pytest


def test_triton_that_dies_while_starting_is_started_once_more(tmp_path, monkeypatch):
    from control_plane.errors import TritonUnavailable
    from control_plane.triton_process import TritonLaunchConfig, TritonProcess

    class DeadProc:
        returncode = -6

        def poll(self):
            return -6

    proc = TritonProcess(TritonLaunchConfig(repository=tmp_path, work_dir=tmp_path))
    launches = []

    def launch():
        launches.append(1)
        proc.proc = DeadProc()

    def wait_ready(timeout_s):
        if len(launches) == 1:
            raise TritonUnavailable("tritonserver exited with code -6 while starting")

    monkeypatch.setattr(proc, "launch", launch)
    monkeypatch.setattr(proc, "wait_ready", wait_ready)
    proc.start()
    assert len(launches) == 2
    launches.clear()
    monkeypatch.setattr(proc, "wait_ready", lambda t: (_ for _ in ()).throw(
        TritonUnavailable("tritonserver exited with code -6 while starting")))
    with pytest.raises(TritonUnavailable):
        proc.start()
    assert len(launches) == 2


def test_stub_environment_activates_this_interpreters_environment(monkeypatch):
    """The stub ignores PYTHONPATH; it finds packages through the python3 first on PATH."""
    import os
    import sys
    from pathlib import Path

    from control_plane.triton_process import stub_environment

    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    env = stub_environment()
    first = env["PATH"].split(os.pathsep)[0]
    assert first == str(Path(sys.executable).parent)
    assert env["PATH"].endswith("/usr/bin:/bin")
    assert "PYTHONPATH" not in env
    if sys.prefix != sys.base_prefix:  # running in a virtualenv, as `make setup` makes
        assert env["VIRTUAL_ENV"] == sys.prefix
        assert (Path(first).parent / "pyvenv.cfg").is_file()


def _previous_life(tmp_path, child, grace_s=0.5):
    """A TritonProcess whose pid file names ``child`` as the Triton of a previous run."""
    import json

    from control_plane.triton_process import TritonLaunchConfig, TritonProcess, process_start_ticks

    pid_file = tmp_path / "triton0.pid"
    pid_file.write_text(json.dumps({"pid": child.pid, "start_ticks": process_start_ticks(child.pid)}))
    return TritonProcess(TritonLaunchConfig(repository=tmp_path, work_dir=tmp_path, pid_file=pid_file,
                                            previous_exit_grace_s=grace_s)), pid_file


def _child(code):
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", code])
    time.sleep(0.3)  # let it install its signal handler
    return child


def test_start_waits_for_the_previous_triton_that_exits_on_sigterm(tmp_path):
    from control_plane.triton_process import process_start_ticks

    child = _child("import time; time.sleep(60)")
    proc, pid_file = _previous_life(tmp_path, child, grace_s=10)
    proc.end_previous()
    assert process_start_ticks(child.pid) is None  # gone (at most a zombie until reaped)
    assert child.wait(timeout=5) != 0
    assert not pid_file.exists()


def test_start_kills_a_previous_triton_that_outlives_the_grace(tmp_path):
    import signal
    import time

    child = _child("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)")
    proc, pid_file = _previous_life(tmp_path, child, grace_s=0.5)
    t0 = time.monotonic()
    proc.end_previous()
    assert child.wait(timeout=5) == -signal.SIGKILL
    assert time.monotonic() - t0 < 5
    assert not pid_file.exists()


def test_a_reused_pid_is_never_signalled(tmp_path):
    import json

    child = _child("import time; time.sleep(60)")
    try:
        proc, pid_file = _previous_life(tmp_path, child)
        record = json.loads(pid_file.read_text())
        record["start_ticks"] -= 1  # the recorded process started at another time: not this one
        pid_file.write_text(json.dumps(record))
        proc.end_previous()
        assert child.poll() is None
        assert not pid_file.exists()
    finally:
        child.kill()
        child.wait()


def test_an_unreadable_pid_file_is_ignored(tmp_path):
    from control_plane.triton_process import TritonLaunchConfig, TritonProcess

    pid_file = tmp_path / "triton0.pid"
    pid_file.write_text("not json")
    TritonProcess(TritonLaunchConfig(repository=tmp_path, work_dir=tmp_path, pid_file=pid_file)).end_previous()
    assert not pid_file.exists()
