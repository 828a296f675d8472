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
