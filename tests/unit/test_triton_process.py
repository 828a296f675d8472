"""The launcher's start-up retry (no process is started: launch and readiness are faked)."""

import pytest


def test_triton_that_dies_while_starting_is_started_once_more(tmp_path, monkeypatch):
    from control_plane.triton.process import TritonLaunchConfig, TritonProcess
    from domain.errors import TritonUnavailable

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


def test_a_triton_whose_picked_port_was_taken_is_started_again_on_fresh_ports(tmp_path, monkeypatch):
    """A picked port is not held (tritonserver binds it without SO_REUSEPORT), so a process
    started meanwhile may take it and the Triton dies binding it: the second start is given
    fresh ports for those asked for as 0, and keeps a port that was given."""
    from control_plane.triton.process import TritonLaunchConfig, TritonProcess
    from domain.errors import TritonUnavailable

    class DeadProc:
        returncode = 1

        def poll(self):
            return 1

    proc = TritonProcess(TritonLaunchConfig(repository=tmp_path, work_dir=tmp_path,
                                            http_port=0, grpc_port=0, metrics_port=48123))
    launched_with = []

    def launch():
        launched_with.append((proc.cfg.http_port, proc.cfg.grpc_port, proc.cfg.metrics_port))
        proc.proc = DeadProc()

    def wait_ready(timeout_s):
        if len(launched_with) == 1:
            raise TritonUnavailable("tritonserver exited with code 1 while starting; "
                                    "failed to start GRPC service: Address already in use")

    monkeypatch.setattr(proc, "launch", launch)
    monkeypatch.setattr(proc, "wait_ready", wait_ready)
    proc.start()
    (http1, grpc1, metrics1), (http2, grpc2, metrics2) = launched_with
    assert http2 != http1 and grpc2 != grpc1 and metrics1 == metrics2 == 48123
    assert proc.grpc_url.endswith(f":{grpc2}") and proc.log_path.name == f"tritonserver-{grpc2}.log"


def test_stub_environment_activates_this_interpreters_environment(monkeypatch):
    """The stub ignores PYTHONPATH; it finds packages through the python3 first on PATH."""
    import os
    import sys
    from pathlib import Path

    from control_plane.triton.process import stub_environment

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

    from control_plane.triton.process import TritonLaunchConfig, TritonProcess, process_start_ticks

    pid_file = tmp_path / "triton0.pid"
    pid_file.write_text(json.dumps({"pid": child.pid, "start_ticks": process_start_ticks(child.pid)}))
    return TritonProcess(TritonLaunchConfig(repository=tmp_path, work_dir=tmp_path, pid_file=pid_file,
                                            previous_exit_grace_s=grace_s)), pid_file


def _child(code):
    """A Python child running ``code``, returned once it has run up to its sleep: a signal
    sent to it then meets the handler ``code`` installs, not the interpreter's start."""
    import subprocess
    import sys

    code = code.replace("time.sleep(", "print('started', flush=True); time.sleep(", 1)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "started\n"
    return child


def test_start_waits_for_the_previous_triton_that_exits_on_sigterm(tmp_path):
    from control_plane.triton.process import process_start_ticks

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
    from control_plane.triton.process import TritonLaunchConfig, TritonProcess

    pid_file = tmp_path / "triton0.pid"
    pid_file.write_text("not json")
    TritonProcess(TritonLaunchConfig(repository=tmp_path, work_dir=tmp_path, pid_file=pid_file)).end_previous()
    assert not pid_file.exists()


def test_launch_forks_without_preexec_fn_in_its_own_session(tmp_path, monkeypatch):
    """preexec_fn in a threaded process can deadlock; the parent-death signal is set by an
    exec wrapper instead, and Triton gets its own session (Ctrl-C reaches the control plane)."""
    import subprocess

    from control_plane.triton import process as triton_process
    from control_plane.triton.process import TritonLaunchConfig, TritonProcess

    seen = {}

    class FakePopen:
        pid = 4242

        def __init__(self, cmd, **kwargs):
            seen["cmd"], seen["kwargs"] = cmd, kwargs

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    monkeypatch.setattr(triton_process, "build_backend_dir", lambda dest: dest)
    TritonProcess(TritonLaunchConfig(repository=tmp_path, work_dir=tmp_path)).launch()
    assert "preexec_fn" not in seen["kwargs"]
    assert seen["kwargs"]["start_new_session"] is True
    cmd = seen["cmd"]
    assert cmd[cmd.index("-c") + 1] == triton_process._PDEATHSIG_EXEC
    assert cmd[cmd.index("-c") + 3].endswith("/tritonserver")


def test_child_of_the_exec_wrapper_dies_with_a_threaded_parent(tmp_path):
    """The guarantee itself: SIGKILL a parent that has threads running, its child goes."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from tests.conftest import pid_alive

    parent_code = (
        "import subprocess, sys, threading, time\n"
        "from control_plane.triton.process import with_parent_death_signal\n"
        "for _ in range(4): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "child = subprocess.Popen(with_parent_death_signal(['/bin/sleep', '60']))\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        deadline = time.monotonic() + 5
        cmdline = Path(f"/proc/{child_pid}/cmdline")
        while b"sleep" not in cmdline.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.02)  # until the wrapper has exec'd
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=5)
        deadline = time.monotonic() + 5
        while pid_alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not pid_alive(child_pid), "the child outlived its parent"
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


def test_exec_wrapper_refuses_to_start_when_its_parent_is_already_gone():
    import subprocess
    import sys

    from control_plane.triton.process import _PDEATHSIG_EXEC

    out = subprocess.run([sys.executable, "-I", "-S", "-c", _PDEATHSIG_EXEC, "1", "/bin/echo", "started"],
                         check=False, capture_output=True, text=True, timeout=10)
    assert out.returncode == 1 and "started" not in out.stdout
    assert "exited before tritonserver started" in out.stderr


def test_triton_gets_an_allow_listed_environment_without_secrets(tmp_path, monkeypatch):
    """Every tenant's python stub inherits Triton's environment: no S3 keys, no AWS_*, no
    MMS_S3_*, no tokens; what Triton and torch need (PATH, LD_*, CUDA_*, locale) passes."""
    import subprocess

    from control_plane.triton import process as triton_process
    from control_plane.triton.process import TritonLaunchConfig, TritonProcess

    secrets = {
        "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "aws-secret",
        "AWS_SESSION_TOKEN": "aws-token", "MMS_S3_SECRET_ACCESS_KEY": "mms-secret",
        "MMS_S3_ACCESS_KEY_ID": "mms-key", "MMCTL_TOKEN": "admin-token",
        "GITHUB_TOKEN": "gh", "DATABASE_PASSWORD": "pw", "HF_TOKEN": "hf",
        "CUDA_SECRET_KEY": "sneaky",  # an allowed prefix does not let a secret through
    }
    needed = {"LD_LIBRARY_PATH": "/opt/lib", "CUDA_VISIBLE_DEVICES": "0", "LANG": "C.UTF-8",
              "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "2", "LD_PRELOAD": "/usr/lib/libjemalloc.so.2",
              "HOME": "/root", "NVIDIA_VISIBLE_DEVICES": "all", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for name, value in {**secrets, **needed}.items():
        monkeypatch.setenv(name, value)
    seen = {}

    class FakePopen:
        pid = 4242

        def __init__(self, cmd, **kwargs):
            seen["env"] = kwargs["env"]

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    monkeypatch.setattr(triton_process, "build_backend_dir", lambda dest: dest)
    TritonProcess(TritonLaunchConfig(repository=tmp_path, work_dir=tmp_path,
                                     env={"MY_MODEL_SETTING": "1"})).launch()
    env = seen["env"]
    assert not set(secrets) & set(env), sorted(set(secrets) & set(env))
    assert not any(value in env.values() for value in secrets.values())
    for name, value in needed.items():
        assert env[name] == value, name
    assert env["MY_MODEL_SETTING"] == "1"  # what the operator passes explicitly
    assert env["PATH"].split(":")[0] == triton_process.stub_environment()["PATH"].split(":")[0]


def test_a_tritons_free_ports_are_never_the_ones_reserved_for_the_admin_api_or_the_router(
        tmp_path, monkeypatch):
    """The kernel may hand out a released port again; a port the admin API or the router will
    bind (not bound yet while the Tritons start) is never picked for a Triton."""
    from control_plane.triton import launch
    from control_plane.triton.process import TritonLaunchConfig, TritonProcess

    handed = iter([8090, 8000, 41000, 8090, 41001, 41002])

    class Socket:
        def __init__(self, *_args):
            self.port = next(handed)

        def __enter__(self):
            return self

        def __exit__(self, *_exc):
            return False

        def bind(self, _address):
            pass

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(launch.socket, "socket", Socket)
    proc = TritonProcess(TritonLaunchConfig(repository=tmp_path, work_dir=tmp_path,
                                            reserved_ports=(8090, 8000, 8001)))
    assert [proc.cfg.http_port, proc.cfg.grpc_port, proc.cfg.metrics_port] == [41000, 41001, 41002]


def test_the_containers_triton_runs_the_products_flags_with_the_key_of_its_file(tmp_path, monkeypatch):
    """control_plane.runtime.triton_container: the flags of launch.triton_args (one declaration
    for mmctl up and the image), the key read from the state volume, logs to stdout."""
    import argparse

    from control_plane.runtime import triton_container as in_container
    from control_plane.triton.launch import RESTRICTED_APIS

    monkeypatch.setattr(in_container.shutil, "which", lambda name: None)  # the CPU image: the wheel's binary
    key_file = tmp_path / "triton.key"
    key_file.write_text("k" * 24 + "\n")
    args = argparse.Namespace(repository=tmp_path / "models", key_file=key_file, host="0.0.0.0",
                              http_port=8000, grpc_port=8001, metrics_port=8002,
                              work_dir=tmp_path / "work", key_wait_s=0.0)
    cmd = in_container.command(args)
    assert cmd[0].endswith("pytriton/tritonserver/bin/tritonserver")
    assert "--model-control-mode=explicit" in cmd and f"--model-repository={tmp_path / 'models'}" in cmd
    assert "--grpc-address=0.0.0.0" in cmd and "--http-port=8000" in cmd
    assert f"--grpc-restricted-protocol={','.join(RESTRICTED_APIS)}:admin-key={'k' * 24}" in cmd
    assert not any(arg.startswith("--log-file") for arg in cmd)
    assert (tmp_path / "work" / "backends" / "python" / "triton_python_backend_stub").exists()

    for text, said in (("", "empty"), ("short", "too short")):
        key_file.write_text(text)
        with pytest.raises(SystemExit, match=said):
            in_container.command(args)
    key_file.unlink()
    with pytest.raises(SystemExit, match="no Triton key file at .* after 0s"):
        in_container.command(args)


def test_the_triton_image_runs_tritonserver_arguments_as_ngcs_image_does(tmp_path, monkeypatch):
    """The Helm chart's Triton pods run `tritonserver ARGS`: the CPU image passes them to the
    wheel's binary with the python backend it assembles, unless ARGS names a backends folder;
    exec'd with the allow-listed environment (no secret of the pod's)."""
    from control_plane.runtime import triton_container as in_container

    monkeypatch.setattr(in_container.shutil, "which", lambda name: None)  # the CPU image
    monkeypatch.setattr(in_container, "WORK_DIR", tmp_path / "work")
    execs = []
    monkeypatch.setattr(in_container.os, "execve", lambda path, argv, env: execs.append((argv, env)))
    monkeypatch.setenv("TRITON_ADMIN_KEY", "k" * 24)
    chart_args = ["--model-repository=/models", "--model-control-mode=explicit",
                  f"--grpc-restricted-protocol=model-repository:admin-key={'k' * 24}"]
    in_container.main(["tritonserver", *chart_args])
    (argv, env), = execs
    backends = tmp_path / "work" / "backends"
    assert argv[0].endswith("pytriton/tritonserver/bin/tritonserver")
    assert argv[1:] == [f"--backend-directory={backends}", *chart_args]
    assert (backends / "python" / "triton_python_backend_stub").exists()
    assert "TRITON_ADMIN_KEY" not in env
    execs.clear()
    in_container.main(["tritonserver", "--backend-directory=/opt/b", *chart_args])
    assert execs[0][0][1:] == ["--backend-directory=/opt/b", *chart_args]


def test_a_held_port_is_handed_to_no_one_else_and_its_servers_bind_beside_it():
    """mmctl up holds its public and admin ports from the moment it picks them: the kernel
    hands that port to no bind(0) and refuses a plain bind of it (a Triton or another
    product starting meanwhile), while a server setting SO_REUSEPORT binds beside the hold,
    which takes none of its connections."""
    import socket

    from control_plane.triton.launch import hold_port

    held = hold_port("127.0.0.1")
    port = held.getsockname()[1]
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        picked = []
        for _ in range(500):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                picked.append(s.getsockname()[1])
        assert port not in picked
        with socket.socket() as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            server.bind(("127.0.0.1", port))
            server.listen()
            for i in range(20):
                with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
                    conn, _ = server.accept()
                    with conn:
                        conn.sendall(bytes([i]))
                        assert client.recv(1) == bytes([i])
    finally:
        held.close()


def test_a_given_port_that_something_listens_on_is_refused_with_what_to_do():
    """A fixed port with a listener (a previous life still stopping is waited for) is refused
    with the port and what to do, never shared with that listener through SO_REUSEPORT."""
    import socket

    from control_plane.triton.launch import hold_port
    from domain.errors import InvalidInput

    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(InvalidInput, match=f"port {port} on 127.0.0.1 cannot be used .*choose another port"):
            hold_port("127.0.0.1", port, wait_s=0.3)
    held = hold_port("127.0.0.1", port, wait_s=0.3)  # free again
    held.close()
