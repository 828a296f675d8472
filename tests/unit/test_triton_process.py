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
