"""Secrets of the state directory and the state URL: a secret file re-made after it was
found readable by others (control_plane.state.secret_files) and the state URL as messages
and logs show it (control_plane.state.database.redact).  Each test tries the attack."""

from __future__ import annotations

import os
import stat

import pytest

from control_plane.state.database import redact
from control_plane.state.secret_files import ensure_secret_file

OLD = "old-secret-" + "o" * 32


@pytest.mark.parametrize("given", [None, "given-secret-" + "g" * 32], ids=["generated", "given"])
def test_an_old_descriptor_of_a_secret_file_never_reads_the_new_secret(tmp_path, given):
    """A file found world-readable was truncated and rewritten in place: whoever opened it
    while it was readable kept a descriptor that then read the new secret too."""
    path = tmp_path / "state" / "admin.token"
    path.parent.mkdir(mode=0o700)
    path.write_text(OLD + "\n")
    os.chmod(path, 0o644)
    with open(path) as old:  # another user's descriptor, opened while it was readable
        new = ensure_secret_file(path, given, what="admin token")
        assert new != OLD and (given is None or new == given)
        old.seek(0)
        assert new not in old.read()
    assert path.read_text() == new + "\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["admin.token"]  # no temporary left


def test_a_private_secret_file_is_reused_and_a_symlink_is_replaced_not_followed(tmp_path):
    path = tmp_path / "triton.key"
    first = ensure_secret_file(path)
    assert ensure_secret_file(path) == first
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("not ours\n")
    path.unlink()
    path.symlink_to(elsewhere)
    ensure_secret_file(path, "x" * 40)
    assert not path.is_symlink() and elsewhere.read_text() == "not ours\n"


SECRET = "s3cr3t-Pa55"


@pytest.mark.parametrize("url, shown", [
    (f"postgresql://mms:{SECRET}@db.internal:5432/mms", "postgresql://mms:***@db.internal:5432/mms"),
    (f"postgresql://mms@db.internal/mms?password={SECRET}",
     "postgresql://mms@db.internal/mms?password=***"),
    (f"postgresql://mms@db.internal/mms?sslmode=verify-full&sslpassword={SECRET}&connect_timeout=5",
     "postgresql://mms@db.internal/mms?sslmode=verify-full&sslpassword=***&connect_timeout=5"),
    (f"postgres://db.internal/mms?application_name=cp&PASSWORD={SECRET}",
     "postgres://db.internal/mms?application_name=cp&PASSWORD=***"),
    # libpq decodes parameter names: %70assword is password
    (f"postgresql://db.internal/mms?%70assword={SECRET}", "postgresql://db.internal/mms?%70assword=***"),
    # a '#' or '?' in a value is the value's to libpq, which reads to the next '&'
    (f"postgresql://db.internal/mms?password={SECRET}#x&sslmode=require",
     "postgresql://db.internal/mms?password=***&sslmode=require"),
    (f"postgresql://mms:{SECRET}?x@db.internal/mms?password={SECRET}",
     "postgresql://mms:***@db.internal/mms?password=***"),
    (f"host=db.internal user=mms password={SECRET} dbname=mms",
     "host=db.internal user=mms password=*** dbname=mms"),
    (f"host=db.internal password = '{SECRET} \\' {SECRET}' sslpassword={SECRET} dbname=mms",
     "host=db.internal password = *** sslpassword=*** dbname=mms"),
    (f"dbname=mms password='{SECRET} unclosed", "dbname=mms password=***"),
])
def test_redact_hides_every_password_of_a_state_url(url, shown):
    assert redact(url) == shown
    assert SECRET not in redact(url)


@pytest.mark.parametrize("url", ["postgresql://mms@db.internal:5432/mms?sslmode=require",
                                 "sqlite:///var/lib/mms/state.db", ".state/state.db"])
def test_redact_leaves_a_url_without_secrets_as_it_was(url):
    assert redact(url) == url
