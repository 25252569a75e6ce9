"""Tenants: who a request's API key belongs to, and what that tenant may use.

A keys file (`specdec serve --api-keys-file FILE`) names one tenant a line:

    # tenant   key                  limits (each optional)
    alice      sk-alice-7Hq2...     concurrency=4 queue=16 cache_share=0.5
    bob        sk-bob-k29X...

Blank lines and lines starting with `#` are skipped. A tenant's name is 1-64 letters, digits,
`_`, `.` or `-`; a key is at least 8 characters without spaces; names and keys are unique. Limits:
`concurrency` (requests of the tenant generating at once; default: the server's --max-batch),
`queue` (requests of the tenant waiting for one of those places; default: --max-queue; more get
429, to that tenant only) and `cache_share` (the fraction of the prefix cache the tenant's entries
may hold, in (0, 1]; default: 1 / the number of tenants, so by default no tenant evicts another's
entries). A single `--api-key KEY` is one tenant named `default` with the default limits, and so is
a server without keys.

Errors about the file name the line, never the key. `KeyRing.reload` reads the file again (the
server does on SIGHUP): a file that fails to parse leaves the previous keys in force.

Keys are compared in constant time against every key (`hmac.compare_digest`), so the time of a
refusal says nothing about how much of a key was right or which tenant's it was near.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidRequestError, SpecdecError

DEFAULT_TENANT = "default"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MIN_KEY_CHARS = 8
CACHE_SALT_MODES = ("request", "tenant", "off")
log = logging.getLogger("specdec.server")


@dataclass(frozen=True)
class Tenant:
    name: str
    concurrency: int  # requests generating at once
    queue: int  # requests waiting for a place; more get 429
    cache_share: float  # fraction of the prefix cache its entries may hold


class TenantBusyError(SpecdecError):
    """The tenant has `concurrency` requests generating and `queue` waiting (HTTP 429)."""

    http_status = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"


def parse_keys(text: str, source: str, concurrency: int, queue: int) -> dict[bytes, Tenant]:
    """key (UTF-8) -> tenant, from a keys file's text; `concurrency` and `queue` are the defaults."""
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        where = f"{source} line {number}"
        if len(words) < 2:
            raise InvalidRequestError(f"{where}: expected 'TENANT KEY [concurrency=N] [queue=N] [cache_share=F]'")
        name, key, limits = words[0], words[1], _limits(words[2:], where)
        if not _NAME.fullmatch(name):
            raise InvalidRequestError(f"{where}: a tenant name is 1-64 letters, digits, '_', '.' or '-'")
        if len(key) < MIN_KEY_CHARS:
            raise InvalidRequestError(f"{where}: the key is shorter than {MIN_KEY_CHARS} characters")
        rows.append((where, name, key, limits))
    if not rows:
        raise InvalidRequestError(f"{source}: no keys (one 'TENANT KEY' a line)")
    out: dict[bytes, Tenant] = {}
    names: set[str] = set()
    for where, name, key, limits in rows:
        if name in names:
            raise InvalidRequestError(f"{where}: tenant {name!r} is named twice")
        if key.encode() in out:
            raise InvalidRequestError(f"{where}: this key is already another line's")
        names.add(name)
        out[key.encode()] = Tenant(name, limits.get("concurrency", concurrency), limits.get("queue", queue),
                                   limits.get("cache_share", 1.0 / len(rows)))
    return out


def _limits(words: list[str], where: str) -> dict:
    wanted = {"concurrency": (int, 1, None, "an integer >= 1"), "queue": (int, 0, None, "an integer >= 0"),
              "cache_share": (float, 0.0, 1.0, "in (0, 1]")}
    limits: dict = {}
    for word in words:
        name, _, text = word.partition("=")
        if name not in wanted:
            raise InvalidRequestError(f"{where}: unknown limit {name!r} (concurrency, queue, cache_share)")
        kind, low, high, say = wanted[name]
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and not low < value <= high):
            raise InvalidRequestError(f"{where}: {name} must be {say}, got {text!r}")
        limits[name] = value
    return limits


class KeyRing:
    """The server's tenants by key: from a keys file, a single key, or none (everyone is `default`)."""

    def __init__(self, keys: dict[bytes, Tenant], path: Path | None, concurrency: int, queue: int,
                 metrics_key: str | None = None):
        self._keys = keys
        self.path, self._defaults = path, (concurrency, queue)
        self._metrics_key = metrics_key.encode() if metrics_key else None
        self.open = not keys  # no keys: every request is the default tenant's
        self._open_tenant = Tenant(DEFAULT_TENANT, concurrency, queue, 1.0)

    @classmethod
    def build(cls, api_key: str | None, keys_file: str | None, concurrency: int, queue: int,
              metrics_key: str | None = None) -> "KeyRing":
        if api_key is not None and keys_file is not None:
            raise InvalidRequestError("--api-key and --api-keys-file together: put every key in the file", "api_key")
        if keys_file is not None:
            path = Path(keys_file)
            return cls(parse_keys(_read(path), str(path), concurrency, queue), path, concurrency, queue, metrics_key)
        keys = {}
        if api_key is not None:
            if not api_key:
                raise InvalidRequestError("--api-key must not be empty", "api_key")
            keys = {api_key.encode(): Tenant(DEFAULT_TENANT, concurrency, queue, 1.0)}
        return cls(keys, None, concurrency, queue, metrics_key)

    @property
    def tenants(self) -> list[Tenant]:
        return list(self._keys.values()) if self._keys else [self._open_tenant]

    def identify(self, authorization: str | None) -> Tenant | None:
        """The tenant whose key `authorization` ("Bearer KEY") carries; None for no or a wrong key."""
        if self.open:
            return self._open_tenant
        key = _bearer(authorization)
        found = None
        for candidate, tenant in self._keys.items():  # every key compared: the time says nothing
            if hmac.compare_digest(key, candidate):
                found = tenant
        return found

    def is_metrics_key(self, authorization: str | None) -> bool:
        return self._metrics_key is not None and hmac.compare_digest(_bearer(authorization), self._metrics_key)

    def reload(self) -> bool:
        """Read the keys file again; on any error keep the keys in force and log one line."""
        if self.path is None:
            log.warning("specdec: no keys file to reload (--api-keys-file)")
            return False
        try:
            keys = parse_keys(_read(self.path), str(self.path), *self._defaults)
        except SpecdecError as exc:
            log.warning("specdec: keys file not reloaded, the previous %d keys stay in force: %s", len(self._keys), exc)
            return False
        self._keys = keys  # one assignment: a request sees the old ring or the new one
        log.warning("specdec: keys file %s reloaded: %d tenants", self.path, len(keys))
        return True


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read the keys file {path}: {getattr(exc, 'strerror', None) or exc}",
                                  "api_keys_file") from None


def _bearer(authorization: str | None) -> bytes:
    # RFC 9110: the scheme name is case-insensitive ("bearer" = "Bearer"); the key is not.
    scheme, _, key = (authorization or "").strip().partition(" ")
    return key.strip().encode("utf-8", "surrogateescape") if scheme.lower() == "bearer" else b""


def cache_partition(mode: str, tenant: Tenant, salt: str | None) -> tuple[str, str] | None:
    """The prefix-cache partition of a request (`--cache-salt`): request = tenant and the request's
    salt; tenant = the tenant alone; off = None, nothing shared at all."""
    if mode == "off":
        return None
    return (tenant.name, (salt or "") if mode == "request" else "")


class TenantGate:
    """Per-tenant admission in front of the scheduler: at most `concurrency` requests of a tenant
    generate at once, `queue` more wait in arrival order, the rest get 429. Event-loop thread only;
    a place is given back with `release(name)` when the scheduler has finished the request."""

    def __init__(self):
        self._running: dict[str, int] = {}
        self._waiting: dict[str, deque[asyncio.Future]] = {}
        self._limits: dict[str, Tenant] = {}  # the limits each tenant last came with

    def running(self, name: str) -> int:
        return self._running.get(name, 0)

    def waiting(self, name: str) -> int:
        return sum(not f.done() for f in self._waiting.get(name, ()))

    async def acquire(self, tenant: Tenant) -> None:
        name = tenant.name
        self._limits[name] = tenant
        queue = self._waiting.setdefault(name, deque())
        if self.running(name) < tenant.concurrency and not self.waiting(name):
            self._running[name] = self.running(name) + 1
            return
        if self.waiting(name) >= tenant.queue:
            raise TenantBusyError(f"too many requests from tenant {name!r}: {self.running(name)} generating "
                                  f"(its limit {tenant.concurrency}) and {self.waiting(name)} waiting "
                                  f"(its limit {tenant.queue})")
        ticket = asyncio.get_running_loop().create_future()
        queue.append(ticket)
        try:
            await ticket  # `release` hands a place over by completing it
        except asyncio.CancelledError:
            if ticket.done() and not ticket.cancelled():
                self.release(name)  # handed a place just as it left: pass it on
            else:
                ticket.cancel()
            raise

    def release(self, name: str) -> None:
        if name not in self._limits:  # a request that did not come through `acquire`
            return
        queue = self._waiting.get(name, deque())
        limit = self._limits[name].concurrency
        while queue and self.running(name) <= limit:
            ticket = queue.popleft()
            if not ticket.done():
                ticket.set_result(None)  # its place passes to the next in line
                return
        self._running[name] = self.running(name) - 1
