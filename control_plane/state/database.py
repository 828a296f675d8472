"""One interface over the two state backends: an embedded SQLite file (the default) and a
shared PostgreSQL (``--state-url postgresql://...``) for control planes on several machines.

Statements are written once, in the SQL both accept (``?`` placeholders, ``ON CONFLICT``
upserts, ``RETURNING``); the PostgreSQL side turns ``?`` into psycopg's ``%s``.  Types that
differ (an auto-increment key) are spelled per dialect in the migrations.

Fencing: a leader sets ``fence`` to the token it won (``control_plane.state.leader``).  From
then on every write runs in a transaction that first checks the token is still the lease's;
a deposed leader's write raises ``Deposed`` and changes nothing, even if its process has not
noticed yet that another control plane took over.

Off the event loop: a statement blocks its thread for as long as the database takes (a
PostgreSQL that waits on a lock, a slow network, a checkpoint).  ``off_loop(fn, ...)`` runs
``fn`` in the database's own thread, one call at a time in the order they were asked for,
so a slow write holds up the writes after it (which must land after it) but never the
event loop that serves requests.  The same object serves both threads: SQLite's one
connection is shared under a lock that keeps a transaction's statements together.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import re
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse

import psycopg

from domain.errors import ControlPlaneError, InvalidInput

_WRITES = ("INSERT", "UPDATE", "DELETE")
# What a state store that is away (network, restart, full disk) raises.
STORE_ERRORS: tuple[type[BaseException], ...] = (sqlite3.Error, psycopg.Error, OSError)
LEADER_LEASE = "control-plane"

T = TypeVar("T")


class Deposed(ControlPlaneError):
    """This control plane's leadership token is no longer the lease's: it must not write."""

    status = 409


@dataclass(frozen=True)
class Fence:
    lease: str
    token: int


class Rows:
    """A statement's result, read whole (a pooled connection goes back before it is used)."""

    def __init__(self, rows: list[tuple], description, rowcount: int):
        self._rows = rows
        self.description = description
        self.rowcount = rowcount

    def __iter__(self) -> Iterator[tuple]:
        return iter(self._rows)

    def fetchone(self) -> tuple | None:
        return self._rows[0] if self._rows else None

    def fetchall(self) -> list[tuple]:
        return list(self._rows)


class Database:
    """What the stores use: ``execute``, ``transaction``, ``clone`` for another thread."""

    dialect: str
    url: str
    fence: Fence | None = None
    migrated = False  # migrations.migrate ran through this object: the schema is current
    _worker: concurrent.futures.ThreadPoolExecutor | None = None
    # False for a connection handed in by its creator (``as_database``): it may be bound to
    # the thread that made it, so off_loop calls run where they are asked for.
    other_threads_allowed = True

    def off_loop(self, fn: Callable[..., T], /, *args, **kwargs) -> asyncio.Future[T]:
        """``fn(*args, **kwargs)`` in this database's own thread, after every call asked for
        before it (module docstring): queued now, so the order is the order of the calls,
        whenever (or whether) the caller awaits the result."""
        loop = asyncio.get_running_loop()
        if not self.other_threads_allowed:
            done = loop.create_future()
            try:
                done.set_result(fn(*args, **kwargs))
            except Exception as exc:  # noqa: BLE001  (handed to the caller, as the thread would)
                done.set_exception(exc)
            return done
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="state-store")
        return loop.run_in_executor(self._worker, functools.partial(fn, *args, **kwargs))

    def _stop_worker(self) -> None:
        """Let the calls already asked for finish, then stop the thread."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        raise NotImplementedError

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        raise NotImplementedError
        yield

    def clone(self) -> Database:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def now_sql(self) -> str:
        """The database's clock in seconds since the epoch (one clock for every node)."""
        raise NotImplementedError

    def columns(self, table: str) -> set[str]:
        raise NotImplementedError

    def _check_fence(self) -> None:
        fence = self.fence
        if fence is None:
            return
        row = self.execute("SELECT token FROM leader_lease WHERE name = ?", (fence.lease,)).fetchone()
        if row is None or int(row[0]) != fence.token:
            raise Deposed(f"this control plane's leadership (token {fence.token}) was taken over "
                          f"(the lease's token is now {row[0] if row else 'gone'}); it writes "
                          "nothing more and restarts as a standby")

    def _is_write(self, sql: str) -> bool:
        return self.fence is not None and sql.lstrip()[:6].upper() in _WRITES


class SqliteDatabase(Database):
    """The embedded default: one file, WAL, autocommit with explicit transactions."""

    dialect = "sqlite"

    def __init__(self, path: Path | str, connection: sqlite3.Connection | None = None):
        self.path = Path(path)
        self.url = f"sqlite:///{self.path}"
        if connection is None:
            if str(path) != ":memory:":
                self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                # Owner-only from its first byte (pins, routes, adapter and registry records);
                # SQLite gives its -wal and -shm files the mode of the database file.
                os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
            connection = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False,
                                         timeout=30.0)
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")
        self.connection = connection
        self._depth = 0
        # One connection, used by the event loop's thread and the off_loop thread: held for
        # a statement, and for a whole transaction, so that no other thread's statement
        # lands inside a transaction (and is committed or rolled back with it).
        self._using = threading.RLock()

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        with self._using:
            if self._depth == 0 and self._is_write(sql):
                with self.transaction():
                    return self.connection.execute(sql, params)
            return self.connection.execute(sql, params)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        with self._using:
            if self._depth:  # nested: part of the outer transaction
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            self.connection.execute("BEGIN IMMEDIATE")
            self._depth = 1
            try:
                self._check_fence()
                yield
            except BaseException:
                self.connection.execute("ROLLBACK")
                raise
            finally:
                self._depth = 0
            self.connection.execute("COMMIT")

    def clone(self) -> SqliteDatabase:
        other = SqliteDatabase(self.path)
        other.fence, other.migrated = self.fence, self.migrated
        return other

    def close(self) -> None:
        self._stop_worker()
        self.connection.close()

    def now_sql(self) -> str:
        return "((julianday('now') - 2440587.5) * 86400.0)"

    def columns(self, table: str) -> set[str]:
        with self._using:
            return {row[1] for row in self.connection.execute(f"PRAGMA table_info({table})")}


def _to_psycopg(sql: str) -> str:
    # The product's statements carry no literal '?' or '%'; escape '%' all the same.
    return sql.replace("%", "%%").replace("?", "%s")


class PostgresDatabase(Database):
    """A shared PostgreSQL through a psycopg 3 connection pool.  A transaction holds one
    pooled connection for the thread that opened it; other statements borrow one each."""

    dialect = "postgresql"

    def __init__(self, url: str, *, min_size: int = 1, max_size: int = 8, pool=None,
                 connect_timeout_s: float = 15.0):
        from psycopg_pool import ConnectionPool

        self.url = url
        self.pool = pool or ConnectionPool(url, min_size=min_size, max_size=max_size,
                                           # utf8: a SQL_ASCII database would give text back as bytes
                                           kwargs={"autocommit": True, "client_encoding": "utf8"},
                                           open=True,
                                           name="mmserve-state")
        self._owns_pool = pool is None
        self._local = threading.local()
        if pool is None:
            try:
                self.pool.wait(timeout=connect_timeout_s)
            except BaseException:
                self.pool.close()
                raise

    def _held(self):
        return getattr(self._local, "conn", None)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows:
        conn = self._held()
        if conn is None and self._is_write(sql):
            with self.transaction():
                return self.execute(sql, params)
        if conn is not None:
            return self._run(conn, sql, params)
        with self.pool.connection() as conn:
            return self._run(conn, sql, params)

    @staticmethod
    def _run(conn, sql: str, params: Sequence[Any]) -> Rows:
        cur = conn.execute(_to_psycopg(sql), tuple(params))
        rows = cur.fetchall() if cur.description is not None else []
        return Rows(rows, cur.description, cur.rowcount)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        if self._held() is not None:  # nested: part of the outer transaction
            yield
            return
        with self.pool.connection() as conn, conn.transaction():
            self._local.conn = conn
            try:
                self._check_fence()
                yield
            finally:
                self._local.conn = None

    def clone(self) -> PostgresDatabase:
        other = PostgresDatabase(self.url, pool=self.pool)
        other.fence, other.migrated = self.fence, self.migrated
        return other

    def close(self) -> None:
        self._stop_worker()
        if self._owns_pool:
            self.pool.close()

    def now_sql(self) -> str:
        return "EXTRACT(EPOCH FROM clock_timestamp())::double precision"

    def columns(self, table: str) -> set[str]:
        return {row[0] for row in self.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = ? "
            "AND table_schema = current_schema()", (table,))}


def open_database(url: str | Path, connect_timeout_s: float = 15.0) -> Database:
    """``sqlite:///path`` (or a plain path) or ``postgresql://user:pw@host/db``."""
    text = str(url)
    scheme = urlparse(text).scheme if "://" in text else ""
    if scheme in ("postgresql", "postgres"):
        try:
            return PostgresDatabase(text, connect_timeout_s=connect_timeout_s)
        except Exception as exc:  # the pool's timeout says little: say what to check
            raise InvalidInput(
                f"cannot reach the PostgreSQL state store at {redact(text)} ({exc}); check the "
                "host, port, database and credentials of --state-url") from exc
    if scheme == "sqlite":
        path = text[len("sqlite://"):]  # sqlite:///abs/path -> /abs/path
        return SqliteDatabase(":memory:" if path == "/:memory:" else path)
    if scheme:
        raise InvalidInput(f"--state-url {redact(text)}: unknown scheme {scheme!r}; use "
                           "sqlite:///path/state.db or postgresql://user:password@host/database")
    return SqliteDatabase(Path(text))


# Connection parameters whose value is a secret (libpq's names), in a URL's query or a
# keyword/value connection string.
_SECRET_PARAMS = frozenset({"password", "sslpassword"})
_HIDDEN = "***"
_URL_START = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# ``?key=`` or ``&key=`` anywhere after the scheme (a '?' inside a value starts another one:
# over-hiding beats a leak); the value, looked ahead at, runs to the next '&' as in libpq.
_URL_PARAM = re.compile(r"(?<=[?&])([^=&?]*)=(?=([^&]*))")
# ``password=secret`` / ``sslpassword = 'a secret'`` in a keyword string (libpq's quoting:
# single quotes, backslash escapes; an unclosed quote runs to the end).
_KEYWORD_SECRET = re.compile(r"\b((?:ssl)?password\s*=\s*)('(?:\\.|\\$|[^'\\])*'?|\S*)",
                             re.IGNORECASE)


def redact(url: str) -> str:
    """A state URL without its secrets, for messages and logs: the password of
    ``user:password@`` and the ``password`` / ``sslpassword`` query parameters (their names
    percent-encoded too), or those keywords in a libpq ``key=value`` string.  Each becomes
    ``***``; the rest stays as written, so the message still says which store was meant.
    Where libpq and urllib would read a malformed URL differently, what either takes for a
    secret is hidden.  Never raises: it runs while another error is being reported."""
    start = _URL_START.match(url)
    if start is None:
        return _KEYWORD_SECRET.sub(lambda m: m[1] + _HIDDEN, url)
    spans = [(m.end(), m.end() + len(m[2])) for m in _URL_PARAM.finditer(url, start.end())
             if unquote(m[1]).strip().lower() in _SECRET_PARAMS]
    # The user info: libpq ends it at the first '@' before any '/', urllib at the last '@'
    # before '/', '?' or '#'; up to the last '@' before '/' covers both.
    authority_end = url.find("/", start.end())
    authority = url[start.end():authority_end if authority_end >= 0 else len(url)]
    userinfo = authority.rpartition("@")[0]
    if ":" in userinfo:
        first = start.end() + userinfo.index(":") + 1
        spans.append((first, start.end() + len(userinfo)))
    merged: list[list[int]] = []  # spans that overlap (a malformed URL) hidden as one
    for begin, end in sorted(spans):
        if merged and begin <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([begin, end])
    out, done = [], 0
    for begin, end in merged:
        out += [url[done:begin], _HIDDEN]
        done = end
    return "".join(out) + url[done:]


def as_database(db: Database | sqlite3.Connection) -> Database:
    """A ``Database`` for a store given a bare SQLite connection (tests, older callers)."""
    if isinstance(db, Database):
        return db
    if db.in_transaction:
        db.commit()
    db.isolation_level = None  # autocommit: transactions are explicit (Database.transaction)
    wrapped = SqliteDatabase(":memory:", connection=db)
    wrapped.other_threads_allowed = False
    return wrapped
